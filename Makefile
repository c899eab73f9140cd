# dpmini: `make demo` runs the main job, `make test` the whole test suite.
# Both create ./.venv on first use and (re)build the extension in place.
# `make test` also runs the notebooks in notebooks/ (nbmake, 60 s each).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

# GPU code paths without a GPU: an emulated build (DPMINI_CUDA_EMULATE=1,
# csrc/cuda_emulate.c) in its own folder, and the tests marked gpu run on it
# with two fake GPUs. `make test` runs both suites.
EMU := build/emulated

.PHONY: demo test build bench clean build-emulated test-emulated bench-gpu

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
	$(MAKE) --no-print-directory test-emulated

build-emulated: $(VENV)/.installed
	DPMINI_CUDA_EMULATE=1 DPMINI_WERROR=1 $(PY) setup.py -q build_ext --build-lib $(EMU) --build-temp $(EMU)-tmp
	cp dpmini/*.py dpmini/py.typed $(EMU)/dpmini/

test-emulated: build-emulated
	DPMINI_EMULATE_GPUS=2 PYTHONPATH=$(EMU) $(VENV)/bin/pytest -q -m gpu -p no:cacheprovider tests

bench-gpu: build
	$(PY) benchmarks/bench_gpu.py

bench: build
	$(PY) benchmarks/bench_cpu.py

clean:
	rm -rf build $(VENV) dpmini/*.so *.egg-info
