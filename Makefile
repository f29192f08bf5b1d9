# Quickstart: `make demo` (venv + install + train the embedded tiny model), `make test` (install + tests).
PY ?= python3
VENV ?= .venv
# The CPU build of torch (this disk carries it); on a GPU machine set TORCH_SPEC="torch>=2.11".
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.moetune-installed

.PHONY: install demo test clean

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

clean:
	rm -rf $(VENV) runs build *.egg-info
