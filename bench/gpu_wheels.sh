#!/usr/bin/env bash
# Fill .whl/ (ignored) with the py3.12 wheels bench/gpu_check.sh installs on a lent GPU machine: what its image
# (torch, transformers, accelerate, pyarrow, pytest, ...) lacks or pins differently from gyre's lock. Versions
# are this venv's, so the GPU runs the code with the pins CI tests. Needs PyPI; run from the repo root.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
NAMES="annotated_types cffi cryptography filelock google_crc32c grpcio grpcio_health_checking hjson protobuf pydantic
pycparser pydantic_core structlog tenacity typing_extensions typing_inspection zstandard"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
mkdir -p .whl
for name in $NAMES; do
    version=$($PY -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "${name//_/-}")
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "${name//_/-}==$version"
done
# DeepSpeed is an sdist on PyPI: build its pure-Python wheel here (no ops; they JIT-build on the GPU machine).
DS_BUILD_OPS=0 $PY -m pip wheel -q --no-deps --no-build-isolation -w .whl \
    "deepspeed==$($PY -c 'import importlib.metadata as m; print(m.version("deepspeed"))')"
# SmolLM2's tokenizer (no weights) for tests/gpu/test_reward_model_cuda.py: the GPU machine has no HF cache
mkdir -p .whl/smollm2-tokenizer
cp .cache/models/SmolLM2-135M-Instruct/{config.json,tokenizer.json,tokenizer_config.json} .whl/smollm2-tokenizer/
ls .whl
