#!/usr/bin/env bash
# The vLLM connector's device check, for a machine with a GPU (CI has none, and no test
# depends on it): the connector's worker halves (KVPusher, KVReceiver) in three processes,
# one prefill rank and two decode ranks, with CUDA KV caches laid out as vLLM lays them
# out, FlashAttention content (K and V per head) and MLA content (one latent vector per
# token), in LBHNC (the layout the connector asks vLLM for) and BLHNC (cross-layer blocks):
# tensor parallel size 1 into 1, and 1 into 2 (each decode rank takes its half of the KV
# heads, a head slice of every block; MLA's latent whole, replicated as vLLM replicates it).
# Every cache moves through pinned staging (kvxfer/integrations/vllm/cache_paths.py); each
# decode rank compares every moved block with the prefiller's digests of its heads and
# checks that no other byte of its cache changed.
# Then the same check on host tensors through the same staging path, as a baseline.
# Needs vLLM importable (its layout and view code are the oracle: scripts/device_kit_vllm.py adds
# them to the device kit for a machine without vLLM) and, where the machine has
# no libfabric or another Python, the device kit (scripts/device_kit.sh; carry .devicekit).
#   scripts/device_check_vllm.sh OUTDIR [device_check_vllm.py options]
# Logs and JSON verdicts go to OUTDIR. Under 5 minutes (each run's timeout below; the CPU
# run took 87 s on a loaded 2-core machine, most of it three processes importing vLLM);
# exits non-zero when a case failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/device_check_vllm.sh OUTDIR [options]}
shift
mkdir -p "$out"
if [[ -f .devicekit/env.sh ]] && ! python3 -c 'import kvxfer._native' 2>/dev/null; then
    # shellcheck disable=SC1091
    source .devicekit/env.sh
fi
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
{ nvidia-smi -L; "$py" -c 'import torch, sys; print(sys.version.split()[0], "torch", torch.__version__,
  "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'; } \
    2>&1 | tee "$out/machine.txt"
if ! "$py" -c 'import vllm.v1.kv_cache_layout' 2>/dev/null; then
    echo "vLLM is not importable with $py: install it (or set PYTHON) to run this check" | tee -a "$out/machine.txt"
    exit 2
fi
status=0
timeout 180 "$py" scripts/device_check_vllm.py --device cuda --json "$out/cuda.json" "$@" 2>&1 \
    | tee "$out/cuda.log" || status=1
timeout 110 "$py" scripts/device_check_vllm.py --device cpu --staged --json "$out/cpu_staged.json" "$@" 2>&1 \
    | tee "$out/cpu_staged.log" || status=1
exit $status
