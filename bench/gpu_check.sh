#!/usr/bin/env bash
# The GPU check, one command on a lent CUDA machine: `bash bench/gpu_check.sh` from the repo root, carrying .whl.
#
# The machine has torch (CUDA), transformers, accelerate, pyarrow, pytest, ... but not deepspeed and some of
# gyre's pins: .whl/ (ignored, never committed; `bash bench/gpu_wheels.sh` fills it) holds those as py3.12
# wheels. They install into /tmp/site, first on PYTHONPATH (its grpcio/protobuf/typing_extensions shadow the
# image's).
# Then: tests/gpu (LearnerEngine on CUDA, lockstep's exact resume with deterministic kernels, the NCCL weight
# transport, the reward-model service's classifier on CUDA) and `bench.nccl --quick`.
# Writes to $OUT: gpu_check.log (everything), learner_cuda.jsonl (a line per learner config),
# lockstep_cuda lines in learner_cuda.jsonl, nccl_quick.json (bench.nccl's result line). Each part runs even if one before it failed; the exit code
# is non-zero if any did. Bounded by timeouts to ~10 minutes
# (a normal run on an H100 or H200: ~5 minutes).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gyre-gpu-check}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
: > "$LOG"
rc=0
step() { echo; echo "== $* ($(date +%T))"; }

{ step install; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl; } 2>&1 | tee -a "$LOG" || rc=1
export PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=/tmp/ds_ext TOKENIZERS_PARALLELISM=false \
    HF_HUB_OFFLINE=1 GYRE_GPU_RESULTS=$OUT/learner_cuda.jsonl GYRE_SMOLLM2_DIR=$PWD/.whl/smollm2-tokenizer
rm -f "$GYRE_GPU_RESULTS"

{ step versions; nvidia-smi -L; timeout -k 5 60 python3 - <<'EOF'
import sys, importlib
print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "deepspeed", "transformers", "accelerate", "grpc", "google.protobuf", "pydantic", "pyarrow"):
    try:
        mod = importlib.import_module(name)
        print(name, getattr(mod, "__version__", "?"), mod.__file__)
    except Exception as e:
        print(name, "IMPORT FAILED:", repr(e))
import torch
print("cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
import gyre.proto.weights_pb2_grpc, gyre.proto.replay_pb2_grpc, gyre.learner.engine  # gencode version checks, deepspeed import
import gyre.services.rollout.transport.nccl, gyre.services.learner.weight_broadcast  # the NCCL path's deps (tenacity, ...)
print("gyre imports ok")
EOF
} 2>&1 | tee -a "$LOG" || rc=1

{ step pytest tests/gpu; timeout -k 10 420 python3 -m pytest -q -s -p no:cacheprovider --durations=5 tests/gpu; } \
    2>&1 | tee -a "$LOG" || rc=1

{ step bench.nccl --quick; timeout -k 10 120 python3 -m bench.nccl --quick; } 2>&1 | tee "$OUT/nccl_quick.out" \
    | tee -a "$LOG" || rc=1
grep '^{' "$OUT/nccl_quick.out" | tail -n 1 >> "$OUT/nccl_quick.json" || rc=1

{ step summary "rc=$rc"; cat "$GYRE_GPU_RESULTS" "$OUT/nccl_quick.json" 2>/dev/null; } 2>&1 | tee -a "$LOG"
exit $rc
