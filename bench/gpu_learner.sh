#!/usr/bin/env bash
# The GPU-shaped learner bench, one command on a lent CUDA machine: `bash bench/gpu_learner.sh` from the repo root,
# carrying .whl (as bench/gpu_check.sh: `bash bench/gpu_wheels.sh` fills it with DeepSpeed and gyre's pins as
# py3.12 wheels). Builds a random Qwen2.5-1.5B from its config (nothing downloaded), then
# `python -m bench.learner --shape qwen2.5-1.5b --lengths grpo-math` at ZeRO-2 (and ZeRO-3 when time is left).
# Writes $OUT/learner_shape.jsonl (one JSON line per config) and $OUT/gpu_learner.log. Bounded to ~9 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gyre-gpu-learner}
mkdir -p "$OUT"
LOG=$OUT/gpu_learner.log
: > "$LOG"
rc=0
{ python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl; } 2>&1 | tee -a "$LOG" || rc=1
export PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=/tmp/ds_ext TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
for stage in 2 3; do
  { echo "== ZeRO-$stage ($(date +%T))"; timeout -k 10 240 python3 -m bench.learner --shape qwen2.5-1.5b \
      --lengths grpo-math --zero-stage "$stage" --models-dir /tmp/gyre-bench-models; } 2>&1 | tee "$OUT/stage$stage.out" \
      | tee -a "$LOG" || rc=1
  grep '^{' "$OUT/stage$stage.out" | tail -n 1 >> "$OUT/learner_shape.jsonl" || rc=1
done
cat "$OUT/learner_shape.jsonl" 2>/dev/null
exit $rc
