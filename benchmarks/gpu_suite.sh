#!/usr/bin/env bash
# All GPU work in one command (`make gpu`): the CUDA tests, the kernel tuning sweep, the paper's time
# table in fp32 and bf16 (with the bare kernels' GB/s), peak memory of full training steps, and the
# time of a causal LM's head + loss (benchmarks/loss_time.py), the planner's whole-step peak and longest
# sequence against real steps (benchmarks/step_plan_gpu.py), and, on the GPU machine's own CPU (another
# CPU than CI's), the norms' CPU time (benchmarks/norm_time.py: the CPU speed point wants every CPU seen).
# Results land in benchmarks/results/ named for the device, with one log per part in
# benchmarks/results/gpu_logs/. Parts can be run alone (each must fit a 10-minute device command):
#   benchmarks/gpu_suite.sh [tests] [tune] [speed-fp32] [speed-bf16] [memory] [host] [loss] [plan] [cpu] [quick]
# (default: all but quick, which `make gpu-quick` runs alone: benchmarks/gpu_quick.py, the short check)
# PYTHON picks the interpreter (default python3). A part that fails is reported and the others still
# run; the exit status is non-zero if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
LOGS=benchmarks/results/gpu_logs
mkdir -p "$LOGS"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests tune speed-fp32 speed-bf16 memory host loss plan cpu)

if ! "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
  echo "gpu_suite: no CUDA device visible to $PYTHON" >&2
  exit 2
fi
"$PYTHON" - <<'PY' | tee "$LOGS/environment.txt"
import platform, torch, triton
print("gpu:", torch.cuda.get_device_name(), "| torch", torch.__version__, "| triton", triton.__version__,
      "| cuda", torch.version.cuda, "| python", platform.python_version())
PY
grep -m1 "model name" /proc/cpuinfo | tee -a "$LOGS/environment.txt"

failed=()
run() {  # run NAME COMMAND...: log to $LOGS/NAME.log, remember failures
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$LOGS/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$LOGS/$name.log"
  [ "$rc" -eq 0 ] || failed+=("$name")
}

for part in "${parts[@]}"; do
  case $part in
    tests) run tests "$PYTHON" -m pytest -q -p no:cacheprovider tests/invact/test_cuda.py \
             tests/invact/test_triton.py -m "gpu or not gpu" ;;
    tune) run tune "$PYTHON" benchmarks/tune.py ;;
    speed-fp32) run speed-fp32 "$PYTHON" benchmarks/speed.py --device cuda --preset paper --dtype float32 \
                  --repeats 20 ;;
    speed-bf16) run speed-bf16 "$PYTHON" benchmarks/speed.py --device cuda --preset paper --dtype bfloat16 \
                  --repeats 20 ;;
    memory)
      run memory-fp32 "$PYTHON" benchmarks/train_memory.py --device cuda --dtype float32
      run memory-bf16 "$PYTHON" benchmarks/train_memory.py --device cuda --dtype bfloat16 ;;
    host) run host "$PYTHON" benchmarks/host_time.py --device cuda --profile ;;
    quick)  # the gated MLP kernels bitwise against the separate ops in every dtype first (the CPU's
      # tests check fp32 alone: the interpreter truncates where a GPU rounds), for the activations the
      # real-shape steps run; then the measurements
      run quick-kernels "$PYTHON" -m pytest -q -p no:cacheprovider tests/invact/test_triton.py \
        -k "gated and (silu or gelu_tanh or bitwise)"
      run quick "$PYTHON" benchmarks/gpu_quick.py ;;
    loss) run loss "$PYTHON" benchmarks/loss_time.py --rounds 7 ;;
    plan) run plan "$PYTHON" benchmarks/step_plan_gpu.py ;;
    cpu)  # the file named for the CPU, beside (not over) the result of the CPU sessions work on
      slug=$("$PYTHON" -c 'import re, sys; sys.path.insert(0, "benchmarks"); from timing import cpu_model
print(re.sub(r"[^a-z0-9]+", "-", re.sub(r"\(r\)|\(tm\)", "", cpu_model().lower())).strip("-"))')
      run cpu "$PYTHON" benchmarks/norm_time.py --device cpu --threads 1 --rounds 9 \
        --out "benchmarks/results/norm_time_cpu_$slug.json" ;;
    *) echo "gpu_suite: unknown part '$part' (tests, tune, speed-fp32, speed-bf16, memory, host, loss, plan, cpu, quick)" >&2
       exit 2 ;;
  esac
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu_suite: failed: ${failed[*]}"
  exit 1
fi
echo "gpu_suite: all parts passed"
