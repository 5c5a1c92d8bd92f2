# The README's two set-up commands: `make chat` (the app on the default model) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
RUNTIME := $(VENV)/.installed-runtime
TESTDEPS := $(VENV)/.installed-test
CUDA := $(VENV)/.installed-cuda
# after any install into a venv `make install-cuda` made: the base `mlx[cpu]` comes back with it,
# and both backends ship mlx/lib/libmlx.so, so mlx-cpu goes and mlx-cuda-13 is installed again
# over what it left
MLX_VERSION = $$($(PY) -c 'from importlib.metadata import version; print(version("mlx"))')
CUDA_SWAP = if [ -f $(CUDA) ]; then $(PY) -m pip uninstall -q -y mlx-cpu; \
	$(PY) -m pip install -q --force-reinstall --no-deps "mlx-cuda-13==$(MLX_VERSION)"; fi

.PHONY: install install-cuda install-test test test-all test-fast lint chat bench models references fuzz mutants clean

# `make chat` installs only what the app needs; `make test` adds the test extras
install: $(RUNTIME)

install-test: $(TESTDEPS)

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(RUNTIME): pyproject.toml setup.py $(wildcard mlxlis/runtime/*.c mlxlis/runtime/*.h mlxlis/runtime/kernels/src/*) | $(VENV)/bin/python
	$(PY) -m pip install -q -e .
	$(CUDA_SWAP)
	[ -f $(CUDA) ] || $(PY) -m mlxlis.runtime.kernels
	[ -f $(CUDA) ] || $(PY) -m mlxlis.generation.warmup
	touch $(RUNTIME)

# Linux + NVIDIA: MLX's CUDA backend in place of its CPU one (CUDA_SWAP above), for this venv
# from now on. The CPU kernels and the warm-up of MLX's CPU compiler are not built: nothing
# CPU-specific runs on the GPU device.
install-cuda: | $(VENV)/bin/python
	$(PY) -m pip install -q -e '.[cuda]'
	touch $(CUDA)
	$(CUDA_SWAP)
	$(PY) -c "from mlxlis.runtime import device; print(device.policy(device.gpu_kind(), None))"
	touch $(RUNTIME)

$(TESTDEPS): $(RUNTIME)
	# llama-cpp-python (a test reference) builds from its sdist here: a few minutes, once
	$(PY) -m pip install -q -e '.[test]'
	$(CUDA_SWAP)
	touch $(TESTDEPS)

models: install
	$(VENV)/bin/mlxlis pull

# llama.cpp's official chat templates and tokenizer test files (from its PyPI source release)
references: install
	$(PY) scripts/fetch_references.py

# under 10 minutes on 2 cores from a clean clone; prints its 15 slowest tests
test: install-test models references
	$(PY) -m pytest -q -m "not extended" --durations=15

# what `make test` leaves out (marked `extended`: long soaks, more real-model runs of what it
# proves already); `make test test-all` is the whole suite, as .ci/run runs it
test-all: install-test models references
	$(VENV)/bin/mlxlis pull qwen2.5-coder-1.5b
	$(PY) -m pytest -q -m extended --durations=15

test-fast: install-test
	$(PY) -m pytest -q -m "not real"

lint: install-test
	$(VENV)/bin/ruff check mlxlis tui tests scripts
	$(VENV)/bin/ruff format --check mlxlis tui tests scripts

# the app fetches the default model itself (with progress) the first time; MLX's CPU kernels
# are compiled first (about 12 s once, then cached; see mlxlis/generation/warmup.py)
chat: install
	$(PY) -m mlxlis.generation.warmup
	$(VENV)/bin/mlxlis chat

bench: install-test models
	$(PY) scripts/bench.py
	$(PY) scripts/bench_moe.py
	$(PY) scripts/bench_families.py
	$(PY) scripts/bench_pipeline.py
	$(PY) scripts/bench_batch.py
	$(PY) scripts/bench_core.py
	$(PY) scripts/bench_grammar.py
	$(PY) scripts/bench_serve.py
	$(PY) scripts/bench_agent.py
	$(PY) scripts/bench_agent_http.py
	$(PY) scripts/bench_kv.py
	$(PY) scripts/bench_spec.py
	$(PY) scripts/bench_qmv.py
	$(PY) scripts/bench_qmv.py --steady --prompts 512 8192
	$(PY) scripts/profile_decode.py
	$(PY) scripts/bench_tool_stream.py
	$(PY) scripts/bench_models.py
	$(PY) scripts/bench_lora.py
	$(PY) scripts/bench_embed.py

# does the suite notice small wrong changes to the numerics? (before a refactor, after a family)
mutants: install-test models references
	$(PY) scripts/mutants.py

fuzz: install-test
	MLXLIS_FUZZ_EXAMPLES=5000 $(PY) -m pytest -q tests -k fuzz

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
