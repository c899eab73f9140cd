#!/usr/bin/env bash
# gpu_check.sh - the GPU check of issue [2], for a lent GPU machine (H200):
# builds dpmini from this source tree, runs the GPU tests and
# benchmarks/bench_gpu.py, writes $OUT/gpu_check.log (everything) and
# $OUT/summary.txt (build, tests passed/failed, each benchmark figure).
# Budget: under 5 minutes (build ~30 s, tests ~1 min, benchmark ~2 min).
#
# Assumptions about the machine (it has no network): python3 with numpy,
# setuptools and pytest installed (torch and cupy optional: their tests and
# comparisons are skipped without them), the CUDA toolkit's nvcc on PATH or in
# $CUDA_HOME or /usr/local/cuda (without nvcc the build is CPU-only and the
# summary says so), a driver. Nothing is installed: the tree is copied to
# /tmp/dpmini-gpu-src WITHOUT pyproject.toml (so an older setuptools there
# does not trip on the project metadata), built in place (build_ext
# --inplace) and used through PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
SUM=$OUT/summary.txt
PY=${PYTHON:-python3}
: >"$LOG"
say() { echo "$*" | tee -a "$SUM"; }
: >"$SUM"

say "== dpmini gpu_check $(date -u +%FT%TZ) on $(hostname)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >>"$SUM" 2>&1 || say "nvidia-smi: not available"
say "python: $($PY -c 'import sys, numpy; print(sys.version.split()[0], "numpy", numpy.__version__)' 2>&1)"
say "torch: $($PY -c 'import torch; print(torch.__version__, torch.cuda.is_available())' 2>&1 | tail -1)"
say "nvcc: $( (command -v nvcc || ls ${CUDA_HOME:-/usr/local/cuda}/bin/nvcc) 2>/dev/null | head -1)"

SRC=/tmp/dpmini-gpu-src
rm -rf "$SRC" && mkdir -p "$SRC"
cp -r setup.py csrc cuda dpmini tests benchmarks "$SRC"/
# pytest reads its markers from pyproject.toml; give it the two it needs
printf '[pytest]\nmarkers =\n    gpu: needs a CUDA GPU\n    slow: long-running\n' >"$SRC/pytest.ini"
cd "$SRC"
start=$(date +%s)
if timeout 240 $PY setup.py -q build_ext --inplace --build-temp /tmp/dpmini-gpu-build >>"$LOG" 2>&1; then
    say "build: ok ($(( $(date +%s) - start )) s)"
else
    say "build: FAILED (see gpu_check.log)"; tail -20 "$LOG" >>"$SUM"; exit 1
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
say "info: $($PY -c 'import dpmini; print(dpmini._dpmini.cuda_build_info())' 2>&1)"

t0=$(date +%s)
timeout 150 $PY -m pytest -q -m gpu -p no:cacheprovider -rs tests >"$OUT/tests.txt" 2>&1
rc=$?
cat "$OUT/tests.txt" >>"$LOG"
say "gpu tests (rc $rc, $(( $(date +%s) - t0 )) s): $(tail -1 "$OUT/tests.txt")"
grep -E "^(FAILED|ERROR)" "$OUT/tests.txt" | head -30 >>"$SUM"
say "nccl after tests: $($PY -c 'import dpmini; print(dpmini._dpmini.cuda_build_info()["nccl"])' 2>&1)"

t0=$(date +%s)
timeout 150 $PY benchmarks/bench_gpu.py >"$OUT/bench.txt" 2>&1
brc=$?
cat "$OUT/bench.txt" >>"$LOG"
say "benchmark (rc $brc, $(( $(date +%s) - t0 )) s):"
cat "$OUT/bench.txt" >>"$SUM"
say "total: $(( $(date +%s) - start )) s"
exit $(( rc != 0 || brc != 0 ))
