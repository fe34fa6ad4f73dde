#!/usr/bin/env bash
# On a machine with one or more NVIDIA GPUs: one GPU's figures beside the estimator's
# (benchmarks/gpu_step.py), the CUDA tests, the examples with NCCL (torchrun, one process
# per GPU) and the GPU benchmarks, each step bounded in time.
#
#     bash benchmarks/gpu_check.sh [LOG_DIR]                 # LOG_DIR: $OUT where set
#     ONLY="generate decode" bash benchmarks/gpu_check.sh    # some steps only
#     REPS=1 IMPLS=unsharded,autotp ONLY=decode bash benchmarks/gpu_check.sh
#     BUDGET=0 bash benchmarks/gpu_check.sh                  # every step, however long
#
# Every step's output goes to LOG_DIR/<step>.log; a summary line per step is printed last.
# BUDGET (seconds; 450 on a machine with one GPU, else none) skips each step that could
# end past it: on one GPU, gpu_step alone runs (its figures in under 8 minutes).
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${1:-${OUT:-gpu-logs}}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())" || echo 0)
TP=$(( GPUS >= 2 ? 2 : 1 ))
BUDGET=${BUDGET:-$(( GPUS >= 2 ? 0 : 450 ))}
DEMO=$(mktemp -d)/demo-llama
REPS=${REPS:-2}  # decode benchmark repetitions
IMPLS=${IMPLS:-unsharded,dtensor,autotp,autotp-eager,hf-tp-plan}
declare -a SUMMARY

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  if [ "$BUDGET" -gt 0 ] && [ $((SECONDS + limit)) -gt "$BUDGET" ]; then
    SUMMARY+=("$(printf '%-18s skipped: %ss could pass BUDGET=%ss' "$name" "$limit" "$BUDGET")")
    return
  fi
  local start=$SECONDS
  timeout "$limit" "$@" >"$LOG/$name.log" 2>&1
  local rc=$?
  SUMMARY+=("$(printf '%-18s rc=%-3s %4ss' "$name" "$rc" $((SECONDS - start)))")
  tail -n "${TAIL:-15}" "$LOG/$name.log"
}

python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers',
transformers.__version__, torch.cuda.get_device_name(), 'x', torch.cuda.device_count())" \
  | tee "$LOG/versions.log"
python3 -c "import autotp" 2>/dev/null || python3 -m pip install -q --no-deps \
  --no-build-isolation -e . >"$LOG/install.log" 2>&1

# training steps (eager, compile=True, torch.compile; tp 1 and simulated tp 2), ring
# attention at 16k tokens and host syncs, each beside the estimate; tracebacks in .err
TAIL=80 step gpu_step 400 bash -c 'exec python3 -m benchmarks.gpu_step --out "$1" 2>"$2"' _ \
  "$LOG/gpu_step.jsonl" "$LOG/gpu_step.err"
step tests 300 python3 -m pytest -q -p no:cacheprovider -m "slow or not slow" -k "cuda or nccl" \
  tests/test_distributed.py tests/test_equivalence.py tests/test_robustness.py \
  tests/test_generate.py
step hf_llama 120 torchrun --nproc-per-node "$TP" examples/hf_llama.py
step nanogpt 120 torchrun --nproc-per-node "$TP" examples/train_nanogpt.py --steps 10
step train_2d 120 torchrun --nproc-per-node "$TP" examples/train_2d.py --dp 1 --tp "$TP" --check
if [ "$GPUS" -ge 8 ]; then  # pipeline x data x tensor on one node
  step train_3d 300 torchrun --nproc-per-node 8 examples/train_3d.py --pp 2 --dp 2 --tp 2 \
    --checkpointing --check
elif [ "$GPUS" -ge 2 ]; then
  step train_3d 300 torchrun --nproc-per-node 2 examples/train_3d.py --pp 2 --dp 1 --tp 1 \
    --stages-per-rank 2 --check
fi
step make_demo 60 python3 examples/train_from_checkpoint.py --make-demo "$DEMO"
step checkpoint 120 torchrun --nproc-per-node "$TP" examples/train_from_checkpoint.py \
  --model "$DEMO" --steps 3 --checkpoint "$DEMO-ckpt"
step generate 120 torchrun --nproc-per-node "$TP" examples/generate.py --model "$DEMO" --check
step generate_bf16 120 torchrun --nproc-per-node "$TP" examples/generate.py --model "$DEMO" \
  --check --dtype bfloat16
step decode 300 python3 -m benchmarks.decode --device cuda --tp "$TP" --reps "$REPS" \
  --impls "$IMPLS" --out "$LOG/decode.jsonl"
step decode_bf16 300 python3 -m benchmarks.decode --device cuda --tp "$TP" --reps "$REPS" \
  --impls "$IMPLS" --dtype bfloat16 --out "$LOG/decode.jsonl"
step train_bench 300 python3 -m benchmarks.tp_bench --device cuda --tp "$TP" \
  --dtype bfloat16 --reps 10 --out "$LOG/tp_bench.jsonl"

printf '%s\n' "${SUMMARY[@]}" | tee "$LOG/summary.log"
