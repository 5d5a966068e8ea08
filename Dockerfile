# syntax=docker/dockerfile:1
# kvxfer image: `kvxfer prefill|decode ...` (the entrypoint) and the router
# (`python -m kvxfer_router`). Build from the repository root:
#   docker build -t kvxfer:0.1.0 .
# The tag is the package version (pyproject.toml), which k8s/base/kustomization.yaml deploys
# (`images:`; tested): bump all three together.
# Two stages: compilers and headers stay in the build stage; the runtime stage gets the
# virtual environment (same path, same Debian python, so it runs unchanged) and the
# libfabric runtime with the verbs/EFA providers.

FROM debian:bookworm-slim AS build
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
        build-essential pkg-config libfabric-dev python3-venv python3-dev ca-certificates \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/kvxfer
ENV PATH=/opt/kvxfer/bin:$PATH
# torch first, pinned and from the CPU index: resolved from PyPI, the same pin would pull a
# CUDA build (gigabytes of libraries the CPU model never uses). Its own layer, so source
# edits do not re-download it.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
WORKDIR /src
COPY . .
# Builds the native engine (scikit-build-core + CMake against Debian's libfabric); the
# installed torch 2.13.0+cpu satisfies the package's torch==2.13.0 pin. The import check
# runs from / so it sees the installed package, not the source tree in /src.
RUN pip install . \
 && cd / && python -c "import kvxfer._native, kvxfer_router"

FROM debian:bookworm-slim
ENV DEBIAN_FRONTEND=noninteractive
# libfabric1 brings ibverbs-providers (mlx5 for RoCE, efa for EFA) that its verbs and efa
# providers load at run time; the devices themselves come from the Kubernetes device plugins.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 libfabric1 ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/kvxfer /opt/kvxfer
# A fixed numeric uid so Kubernetes' runAsNonRoot can verify it (k8s/base uses 10001).
RUN groupadd --system --gid 10001 kvxfer \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/kvxfer kvxfer
USER 10001:10001
WORKDIR /home/kvxfer
ENV PATH=/opt/kvxfer/bin:$PATH \
    PYTHONUNBUFFERED=1
# router, prefill and decode defaults (docs/architecture.md).
EXPOSE 8000 8100 8200
ENTRYPOINT ["kvxfer"]
CMD ["--help"]
