#!/usr/bin/env bash
# Builds the "device kit": what it takes to import kvxfer on a machine with a GPU that has
# no libfabric and another Python than this one (the GPU machine's python3 is 3.12; the
# project's own venv here is 3.11). The kit holds the CPython 3.12 build of kvxfer._native,
# the bare fi_writedata benchmark binary, and libfabric's shared libraries with every
# library they need beyond glibc, libstdc++ and libgcc:
#
#   .devicekit/kvxfer_native/_native.cpython-312-x86_64-linux-gnu.so
#   .devicekit/bin/kvxfer-bare-writedata
#   .devicekit/lib/            libfabric.so.1, libibverbs.so.1, librdmacm.so.1, ... (by SONAME)
#   .devicekit/lib/fabric-providers/   libfabric's provider DSOs (empty where Debian builds them in)
#   .devicekit/env.sh          source it from the repository root
#
# .devicekit/ is ignored through .git/info/exclude, so a command on the device must name it
# among the ignored paths it carries. There, from the repository root:
#   source .devicekit/env.sh && python3 -c 'import kvxfer.transfer.engine'
# The build needs glibc >= 2.35 on the device (epoll_pwait2) and libstdc++ from GCC >= 11.
#
#   scripts/device_kit.sh [PYTHON3.12]    (default: pyenv's 3.12.1)
# Needs libfabric-dev (scripts/run setup installs it), cmake and ninja (pip-installed into
# the build venv when absent). Idempotent: the kit is rebuilt from scratch every run; the
# venv (KIT_VENV, /tmp/py312) and the CMake build (KIT_BUILD, /tmp/build312) are reused.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
python312=${1:-/root/.pyenv/versions/3.12.1/bin/python3.12}
venv=${KIT_VENV:-/tmp/py312}
build=${KIT_BUILD:-/tmp/build312}
kit=$root/.devicekit

log() { printf '\033[1m[device kit]\033[0m %s\n' "$*" >&2; }

# 1. Keep the kit (and the cp312 module env.sh copies into kvxfer/) out of git.
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
touch "$exclude"
grep -qxF '/.devicekit/' "$exclude" || echo '/.devicekit/' >>"$exclude"
if ! git check-ignore -q kvxfer/_native.cpython-312-x86_64-linux-gnu.so; then
    grep -qxF '/kvxfer/_native.cpython-*.so' "$exclude" || echo '/kvxfer/_native.cpython-*.so' >>"$exclude"
fi

# 2. A 3.12 venv with pybind11, then a plain CMake build of the module and the bare binary.
pkg-config --exists 'libfabric >= 1.14' || { log "libfabric-dev missing: run scripts/run setup"; exit 1; }
"$python312" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' \
    || { log "$python312 is not Python 3.12"; exit 1; }
[[ -x $venv/bin/python ]] || "$python312" -m venv "$venv"
"$venv/bin/python" -c 'import pybind11' 2>/dev/null || "$venv/bin/pip" install -q pybind11
PATH=$venv/bin:$PATH
command -v cmake >/dev/null && command -v ninja >/dev/null || "$venv/bin/pip" install -q cmake ninja
py=$venv/bin/python
log "configuring $build for $($py -V)"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVXFER_BUILD_PYTHON=ON \
    -Dpybind11_DIR="$($py -m pybind11 --cmakedir)" -DPython_EXECUTABLE="$py" -DPYTHON_EXECUTABLE="$py" \
    >"$build.configure.log" 2>&1 || { cat "$build.configure.log" >&2; exit 1; }  # quiet: pybind11's deprecation warnings
cmake --build "$build" --target _native kvxfer-bare-writedata
module=$(ls "$build"/native/_native.cpython-312-*.so)
bare=$build/native/kvxfer-bare-writedata

rm -rf "$kit"
mkdir -p "$kit/kvxfer_native" "$kit/bin" "$kit/lib/fabric-providers"
cp "$module" "$kit/kvxfer_native/"
cp "$bare" "$kit/bin/"
echo '/*' >"$kit/.gitignore"  # ignored even in a checkout whose info/exclude lacks it

# 3. libfabric and every library it and the two artifacts load, except the toolchain's and
# glibc's, which the device has. Copied as real files under the name the loader asks for.
system='^(linux-vdso|ld-linux-x86-64|libc|libm|libdl|libpthread|librt|libutil|libresolv|libstdc\+\+|libgcc_s)\.so'
libfabric=$(ldd "$bare" | awk '$1 == "libfabric.so.1" {print $3}')
[[ -n $libfabric ]] || { log "ldd does not resolve libfabric.so.1 for $bare"; exit 1; }
ldd "$module" "$bare" "$libfabric" | awk '$2 == "=>" {print $1, $3}' | sort -u |
while read -r name path; do
    [[ $name =~ $system ]] && continue
    [[ $path == /* ]] || { log "unresolved: $name"; exit 1; }
    cp -L "$path" "$kit/lib/$name"
done
libfabric_dir=$(dirname "$(readlink -f "$libfabric")")/libfabric
[[ -d $libfabric_dir ]] && cp -L "$libfabric_dir"/*.so "$kit/lib/fabric-providers/" 2>/dev/null || true

# 4. env.sh: sourced from the repository root on the device.
cat >"$kit/env.sh" <<'EOF'
# Sourced from the repository root: makes kvxfer importable with the kit's cp312 build and
# libfabric (made by scripts/device_kit.sh).
_kit="$PWD/.devicekit"
if [ ! -f "$_kit/env.sh" ]; then
    echo "source .devicekit/env.sh from the repository root" >&2
    return 1 2>/dev/null || exit 1
fi
export LD_LIBRARY_PATH="$_kit/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export FI_PROVIDER_PATH="$_kit/lib/fabric-providers"
export PATH="$_kit/bin:$PATH"
for _so in "$_kit"/kvxfer_native/_native*.so; do
    cmp -s "$_so" "kvxfer/${_so##*/}" 2>/dev/null || cp -f "$_so" kvxfer/  # cmp may be absent: then copy
done
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# What the vLLM check needs of vLLM (scripts/device_kit_vllm.py), where it was added.
if [ -d "$_kit/pylib" ]; then export PYTHONPATH="$PYTHONPATH:$_kit/pylib"; fi
unset _kit _so
EOF

log "kit: $(du -sh "$kit" | cut -f1) in $kit"
find "$kit" -type f | sed "s|^$root/||" | sort >&2
