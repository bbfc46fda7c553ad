VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test bench env clean

env: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[torch,jax,bench,test]"
	touch $(STAMP)

# two worker processes, one test file each at a time (module fixtures run once): the suite's tests are mostly
# single-threaded, 17.5 -> 10.5 minutes on a 2-core host without AVX-512
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

bench: $(STAMP)
	$(PY) -m bench --config tiny

clean:
	rm -rf $(VENV)
