# dpmini: `make demo` runs the main job, `make test` the whole test suite.
# Both create ./.venv on first use and (re)build the extension in place.
# `make test` also runs the notebooks in notebooks/ (nbmake, 60 s each).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

# GPU code paths without a GPU: an emulated build (DPMINI_CUDA_EMULATE=1,
# csrc/backend/cuda_emulate.c) in its own folder, and the tests marked gpu run on it
# with two fake GPUs. `make test` runs both suites.
EMU := build/emulated

# Every build here also compiles the test-only extension dpmini._testing
# (csrc/testing/: the tests' hooks into _dpmini; setup.py leaves it out otherwise).
export DPMINI_TESTING := 1

.PHONY: demo test test-quick build bench clean build-emulated test-emulated bench-gpu test-asan fuzz fuzz-build test-valgrind \
	deps-mpi demo-distributed test-distributed bench-distributed test-interop

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

# The core C and Python tests in a few minutes, for a contributor between edits: no
# tests marked slow, no notebooks, emulated GPU build, interop, MPI, demo, README blocks,
# or the tooling checks (layers, stubtest, citations). `make test` runs all of them.
QUICK_SKIP := interop distributed test_distributed.py test_demo.py test_readme_blocks.py \
	test_layers.py test_stubtest.py test_check_citations.py test_plot_many_devices.py

test-quick: build
	$(PY) -m pytest -q -m "not slow" $(addprefix --ignore=tests/,$(QUICK_SKIP)) tests

# Against the real PyTorch and JAX (tests/interop; they skip under `make test`
# when the libraries are missing). Installs them into the venv from PyPI when
# missing: torch (the PyPI wheel is a CUDA build, ~5 GB, ~5 minutes; it runs on
# the CPU here), jax (~0.6 GB) and array-api-compat.
INTEROP_PKGS := torch jax array-api-compat

test-interop: build
	@$(PY) -c "import torch, jax, array_api_compat" 2>/dev/null || \
		$(PY) -m pip install -q $(INTEROP_PKGS)
	$(PY) -m pytest -q -p no:cacheprovider tests/interop tests/test_readme_blocks.py

build-emulated: $(VENV)/.installed
	DPMINI_CUDA_EMULATE=1 DPMINI_WERROR=1 $(PY) setup.py -q build_ext --build-lib $(EMU) --build-temp $(EMU)-tmp
	cp dpmini/*.py dpmini/*.pyi dpmini/py.typed $(EMU)/dpmini/

test-emulated: build-emulated
	DPMINI_EMULATE_GPUS=2 PYTHONPATH=$(EMU) $(VENV)/bin/pytest -q -m gpu -p no:cacheprovider tests

bench-gpu: build
	$(PY) benchmarks/bench_gpu.py

bench: build
	$(PY) benchmarks/bench_cpu.py

# ---------------------------------------------------------------- distributed (MPI)
# dpmini.distributed needs a system MPI and mpi4py; deps-mpi installs Open MPI
# (apt-get, only when mpirun/mpicc are missing) and mpi4py (only when it does
# not import), then rebuilds so that the optional extension dpmini._dist is
# compiled. The OMPI_* variables let Open MPI run as root and put more ranks
# than cores on this machine (MPICH ignores them). Every mpirun runs inside an
# outer timeout, so a hang fails the target instead of stalling CI.
MPI_ENV := OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
MPI_NP  ?= 4

deps-mpi: $(VENV)/.installed
	tools/deps.sh mpi
	$(PY) -c "import mpi4py" 2>/dev/null || $(PY) -m pip install -q "mpi4py>=3.1"
	$(MAKE) --no-print-directory build
	$(PY) -c "import dpmini._dist" || { echo "dpmini._dist was not built: see the build output above" >&2; exit 1; }

demo-distributed: deps-mpi
	$(MPI_ENV) timeout 300 mpirun -np $(MPI_NP) $(PY) -m dpmini.demo_distributed

# tests/test_distributed.py launches mpirun -np 4 and -np 1 itself (each in `timeout`);
# its GPU-array cases run on the emulated build (NCCL emulated over MPI).
# Also across two hosts made as network namespaces (tools/multihost.py makes
# them for the run and tears them down; without root or namespaces the
# multi-host tests skip, saying why).
test-distributed: deps-mpi build-emulated
	timeout 1800 $(PY) tools/multihost.py run -- \
	  $(PY) -m pytest -q tests/test_distributed.py tests/test_distributed_guard.py \
	  tests/test_distributed_multihost.py

bench-distributed: deps-mpi
	$(MPI_ENV) timeout 600 mpirun -np $(MPI_NP) $(PY) benchmarks/bench_distributed.py

# ---------------------------------------------------------------- reliability
# docs/reliability.md says what each of these checks and what CI runs.
# Each builds out of tree (build/asan, build/valgrind, build/fuzz), so the
# in-place extension that `make test` uses is never replaced.
# -fno-wrapv undoes the -fwrapv in CPython's own CFLAGS, so UBSan sees signed overflow.
SAN_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -fno-wrapv
ASAN_DIR  := build/asan
# detect_leaks=0: CPython does not free its own objects at exit, so LeakSanitizer
# would report thousands of its blocks; dpmini's leaks are checked by
# tests/test_memory.py, test_faults.py and test-valgrind (docs/reliability.md).
ASAN_ENV = LD_PRELOAD=$$(gcc -print-file-name=libasan.so) PYTHONMALLOC=malloc \
	ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	DPMINI_TEST_CFLAGS="$(SAN_FLAGS)" DPMINI_SANITIZER=asan

# The whole pytest suite against an ASan+UBSan build of the extension.
# ASAN_TESTS picks test files or folders, relative to the checkout
# (make test-asan ASAN_TESTS="tests/test_structures.py tests/c"); PYTEST_ARGS
# adds pytest options (-x, -k NAME, -m gpu).
ASAN_TESTS ?= tests
test-asan: $(VENV)/.installed
	tools/deps.sh asan
	rm -rf $(ASAN_DIR) && mkdir -p $(ASAN_DIR)/dpmini
	cp dpmini/*.py dpmini/*.pyi dpmini/py.typed $(ASAN_DIR)/dpmini/
	CC=gcc DPMINI_WERROR=1 DPMINI_CFLAGS="$(SAN_FLAGS) -O1 -g" DPMINI_LDFLAGS="$(SAN_FLAGS)" \
		$(PY) setup.py -q build_ext --force --build-lib $(ASAN_DIR) --build-temp $(ASAN_DIR)/tmp
	cd $(ASAN_DIR) && $(ASAN_ENV) $(abspath $(PY)) -m pytest -q -p no:cacheprovider \
		$(PYTEST_ARGS) $(addprefix $(CURDIR)/,$(ASAN_TESTS))

# libFuzzer over plan.c and copy.c (fuzz/fuzz_core.c). New inputs go to
# build/fuzz/corpus; fuzz/corpus (committed seeds and past crashes) is read.
# A crash leaves build/fuzz/crash-* and fails the target.
FUZZ_SECONDS ?= 60
FUZZ_DIR     := build/fuzz
FUZZ_FLAGS   := -std=c11 -g -O1 -Wall -Wextra -Werror -fsanitize=fuzzer,address,undefined \
	-fno-sanitize-recover=undefined -fno-omit-frame-pointer -Icsrc/core

fuzz-build:
	tools/deps.sh fuzz
	mkdir -p $(FUZZ_DIR)/corpus
	clang $(FUZZ_FLAGS) fuzz/fuzz_core.c csrc/core/plan.c csrc/core/copy.c csrc/core/alloc.c -o $(FUZZ_DIR)/fuzz_core

fuzz: fuzz-build
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
	$(FUZZ_DIR)/fuzz_core -max_total_time=$(FUZZ_SECONDS) -max_len=512 -timeout=10 \
		-print_final_stats=1 -artifact_prefix=$(FUZZ_DIR)/ $(FUZZ_DIR)/corpus fuzz/corpus

# valgrind memcheck over the Python tests that run in-process and in seconds
# (not the 100k-call leak loops, subprocess or compiler tests). The baseline
# run (tools/valgrind_baseline.py, no dpmini) becomes the suppression file;
# then tools/valgrind_supp.py --check fails on any error or definite leak with
# a dpmini frame in its stacks (allocation and origin stacks included).
VG_DIR   := build/valgrind
VG_OPTS  := --tool=memcheck --fullpath-after= --leak-check=full --show-leak-kinds=definite \
	--errors-for-leak-kinds=definite --num-callers=40
VG_TESTS := test_api.py test_chunk_rule.py test_device.py test_explain.py test_comm.py \
	test_dataparallel.py test_structures.py test_exceptions.py test_argument_errors.py \
	test_argument_errors_catalogue.py test_faults.py
VG_ENV   := PYTHONMALLOC=malloc DPMINI_SANITIZER=valgrind

test-valgrind: $(VENV)/.installed
	tools/deps.sh valgrind
	rm -rf $(VG_DIR) && mkdir -p $(VG_DIR)/dpmini
	cp dpmini/*.py dpmini/*.pyi dpmini/py.typed $(VG_DIR)/dpmini/
	DPMINI_WERROR=1 DPMINI_CFLAGS="-O1 -g -fno-omit-frame-pointer" \
		$(PY) setup.py -q build_ext --force --build-lib $(VG_DIR) --build-temp $(VG_DIR)/tmp
	cd $(VG_DIR) && $(VG_ENV) valgrind $(VG_OPTS) --gen-suppressions=all \
		--log-file=baseline.log $(abspath $(PY)) -m pytest -q -p no:cacheprovider \
		$(CURDIR)/tools/valgrind_baseline.py
	$(PY) tools/valgrind_supp.py $(VG_DIR)/baseline.log $(VG_DIR)/python.supp
	cd $(VG_DIR) && $(VG_ENV) valgrind $(VG_OPTS) --suppressions=python.supp --track-origins=yes \
		--log-file=memcheck.log $(abspath $(PY)) -m pytest -q -p no:cacheprovider -k "not ctrl_c" \
		$(addprefix $(CURDIR)/tests/,$(VG_TESTS))
	$(PY) tools/valgrind_supp.py --check $(VG_DIR)/memcheck.log

clean:
	rm -rf build $(VENV) dpmini/*.so *.egg-info
