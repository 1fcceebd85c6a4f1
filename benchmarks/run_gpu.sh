#!/usr/bin/env bash
# Runs the whole GRPO step, rollout, continuous-batching and training-step benchmarks on one GPU, all results in
# one folder.
#
#   bash benchmarks/run_gpu.sh                       # -> benchmarks/results/gpu-<date>/
#   bash benchmarks/run_gpu.sh /tmp/bench            # into /tmp/bench
#   SMOKE=1 DEVICE=cpu bash benchmarks/run_gpu.sh    # the same steps with a tiny random model, to check the script
#
# Each step has its own time limit so that the whole script ends within 8 minutes on one GPU (480 s of limits; a
# step that runs out of time is recorded in summary.txt and the next one starts). Every step writes <name>.json and
# <name>.log.
set -uo pipefail

OUT=${1:-benchmarks/results/gpu-$(date +%Y%m%d-%H%M%S)}
PY=${PYTHON:-python}
DEVICE=${DEVICE:-cuda}
SMOKE=${SMOKE:-0}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

if [ "$SMOKE" = "1" ]; then
  SMALL="--model random-tiny --dtype fp32"; BIG="--model random-tiny --dtype fp32"
  ROLL="--trajectories 4 --group-size 2"; ROLL_BIG="--trajectories 4 --group-size 2"
  CB="--trajectories 4 --group-size 2"; TRAIN="--trajectories 8 --group-size 2 --micro-batch 4 --steps 1"
  STEP="--group-size 2 --prompts 2 --turns 2 --micro-batch 2 --max-completion-length 512 --max-think 8"
  STEP="$STEP --warmup 0 --steps 1"
else
  SMALL="--model smollm2 --dtype bf16"; BIG="--model random-1.7b --dtype bf16"
  ROLL="--trajectories 64 --group-size 8"; ROLL_BIG="--trajectories 32 --group-size 4"
  CB="--trajectories 32 --group-size 4"; TRAIN="--trajectories 32 --group-size 8 --micro-batch 8 --steps 2"
  STEP="--group-size 8 --prompts 8 --turns 4 --micro-batch 8 --warmup 1 --steps 2"
fi

{
  echo "started $(date -Is)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
  "$PY" -c "import torch, transformers, trl; print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__)"
} > "$OUT/machine.txt" 2>&1

step() {  # step NAME SECONDS SCRIPT ARGS...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$PY" "$@" --device "$DEVICE" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - start)) s (limit $limit s)" | tee -a "$OUT/summary.txt"
  grep -E "speed-up|speed ours|step-time ratio|identical token ids" "$OUT/$name.log" | sed "s/^/  /" | tee -a "$OUT/summary.txt"
}

# 1. whole GRPO optimizer steps through trainer.train(), SmolLM2-135M + LoRA, 8 prompts x G=8, 4 turns: TRL vs ours
step grpo_step_g8 150 benchmarks/grpo_step.py $SMALL $STEP --repeats 1 --threads 1
# 2. rollout, SmolLM2-135M, 64 trajectories (8 prompts x G=8), 4 turns: TRL's multi-turn path vs ours
step rollout_smollm2 120 benchmarks/rollout.py $SMALL $ROLL --turns 4 --repeats 2
# 3. training step on one rollout batch: TRL's GRPOTrainer vs MultiTurnGRPOTrainer
step train_step 70 benchmarks/train_step.py $SMALL $TRAIN --repeats 1
# 4. our turn engine vs transformers' continuous batching on the same turns
step continuous_batching 70 benchmarks/continuous_batching.py $SMALL $CB --repeats 1
# 5. rollout, a random-weights 1.7B model (Llama shape), 32 trajectories, 4 turns
step rollout_1.7b 70 benchmarks/rollout.py $BIG $ROLL_BIG --turns 4 --repeats 1

echo "finished $(date -Is); results in $OUT" | tee -a "$OUT/summary.txt"
