# dpmini: `make demo` runs the main job, `make test` the whole test suite.
# Both create ./.venv on first use and (re)build the extension in place.
# `make test` also runs the notebooks in notebooks/ (nbmake, 60 s each).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: demo test build bench clean

$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip "setuptools>=77" wheel "numpy>=1.26"
	$(PY) -m pip install -q --no-build-isolation -e ".[test,demo]"
	touch $@

build: $(VENV)/.installed
	DPMINI_WERROR=1 $(PY) setup.py -q build_ext --inplace

demo: build
	$(PY) -m dpmini.demo

test: build
	$(PY) -m pytest -q tests
	$(PY) -m pytest -q --nbmake --nbmake-timeout=60 notebooks

bench: build
	$(PY) benchmarks/bench_cpu.py

clean:
	rm -rf build $(VENV) dpmini/*.so *.egg-info
