#!/usr/bin/env bash
# The checks that need a GPU, for a machine with one (CI has none, and no test depends on
# it): kvxfer with CUDA memory, through pinned host staging (kvxfer.transfer.device_staging).
#   1. tests/transfer/test_device_staging.py, whose device cases then run on "cuda" too;
#   2. benchmarks/bench_device_staging.py on cuda: staged GB/s next to D2H, H2D and the host
#      paged write, bytes compared page by page.
# Run from the repository root, with the device kit when the machine has no libfabric or
# another Python (scripts/device_kit.sh builds it; carry .devicekit):
#   scripts/device_check.sh OUTDIR [--total 1G] [--page-sizes 16K,64K,256K]
# Logs and the benchmark's JSON and PNG go to OUTDIR. Exits non-zero when either step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/device_check.sh OUTDIR [benchmark options]}
shift
mkdir -p "$out"
if [[ -f .devicekit/env.sh ]] && ! python3 -c 'import kvxfer._native' 2>/dev/null; then
    # shellcheck disable=SC1091
    source .devicekit/env.sh
fi
export PYTHONUNBUFFERED=1
{ nvidia-smi -L; python3 -c 'import torch, sys; print(sys.version.split()[0], "torch", torch.__version__,
  "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'; } \
    2>&1 | tee "$out/machine.txt"
status=0
python3 -m pytest -q -p no:cacheprovider tests/transfer/test_device_staging.py 2>&1 | tee "$out/pytest.log" || status=1
python3 benchmarks/bench_device_staging.py --device cuda --json "$out/device_staging.json" "$@" 2>&1 \
    | tee "$out/bench.log" || status=1
exit $status
