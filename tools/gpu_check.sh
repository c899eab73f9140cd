#!/usr/bin/env bash
# gpu_check.sh - the GPU check for a lent machine with ONE GPU (H200, 16
# cores, Python 3.12 at /opt/torch/.venv with torch, JAX, CuPy, pytest):
# about 6 minutes in all, so that a rerun fits a 15-minute allowance.
#
# Stages (each with its own time limit; later ones only while time is left
# of $GPU_CHECK_BUDGET, 360 s by default):
#   0. preflight      driver, GPU, MIG mode, library versions, tools   ~10 s
#   1. build          a prebuilt extension carried in ($DPMINI_PREBUILT: a
#                     folder holding _dpmini*.so [and _dist*.so] for this
#                     Python), else build_ext -j 16 for sm_90 only    <=150 s
#   2. gpu tests      pytest -m gpu, one GPU's files, 60 s a test     <=120 s
#   3. interop        tests/interop on the real torch / JAX / CuPy    <=100 s
#   4. probes         tools/gpu_probes.py (C1, W2, W3, #8, #13, H3)    <=120 s
#   5. sanitizer      compute-sanitizer memcheck on the kernel tests   <=90 s
#   6. distributed    mpirun -np 1 on the real NCCL (when mpirun and
#                     dpmini._dist exist)                              <=60 s
#   7. benchmark      bench_gpu.py, BENCH_REPS=1, only with time left
# Results under $OUT: summary.txt (what to read first), findings.txt (per
# finding: ran / passed / skipped / failed), one log per stage.
#
# Without a GPU (a dry run): the preflight says so and every GPU stage is
# reported SKIPPED; GPU_CHECK_DRY_BUILD=1 still builds (to time the build),
# and GPU_CHECK_FORCE=1 with it runs every stage, whose tests and probes
# then skip themselves. $PYTHON picks the interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu_check_out}
mkdir -p "$OUT"
SUM=$OUT/summary.txt
FIND=$OUT/findings.txt
BUDGET=${GPU_CHECK_BUDGET:-360}
T0=$(date +%s)
: >"$SUM"
: >"$FIND"

say() { echo "$*" | tee -a "$SUM" >&2; }
elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(elapsed) )); }
# finding STATUS detail: one line per finding and stage
finding() { printf '%-6s %-8s %s\n' "$1" "$2" "$3" | tee -a "$FIND" | tee -a "$SUM" >&2; }
# stage_limit WANT: the smaller of WANT and the time left (0: no time)
stage_limit() { local l; l=$(left); [ "$l" -lt "$1" ] && echo $(( l > 0 ? l : 0 )) || echo "$1"; }

say "== dpmini gpu_check $(date -u +%FT%TZ) on $(hostname), budget ${BUDGET} s"

# ---------------------------------------------------------------- 0. preflight
pick_python() {
    [ -n "${PYTHON:-}" ] && { echo "$PYTHON"; return; }
    for p in python3 /opt/torch/.venv/bin/python3 /usr/bin/python3; do
        if command -v "$p" >/dev/null 2>&1 && "$p" -c "import torch" >/dev/null 2>&1; then
            echo "$p"; return
        fi
    done
    command -v python3 || echo /usr/bin/python3
}
PY=$(pick_python)
GPU=0
if command -v nvidia-smi >/dev/null 2>&1 &&
   smi=$(nvidia-smi --query-gpu=name,driver_version,memory.total,mig.mode.current \
         --format=csv,noheader 2>&1); then
    say "gpu: $smi"
    GPU=1
else
    say "gpu: none (nvidia-smi missing or failed): a dry run, GPU stages are skipped"
fi
say "python: $PY $("$PY" -c 'import sys; print(sys.version.split()[0])' 2>&1)"
say "versions: $("$PY" - <<'PYEOF' 2>&1
import importlib
out = []
for name in ("numpy", "pytest", "pytest_timeout", "torch", "jax", "cupy", "mpi4py", "setuptools"):
    try:
        m = importlib.import_module(name)
        out.append(f"{name} {getattr(m, '__version__', '?')}")
    except Exception as exc:
        out.append(f"{name} missing")
try:
    import torch
    out.append(f"torch.cuda {torch.version.cuda} available={torch.cuda.is_available()}")
except Exception:
    pass
print(", ".join(out))
PYEOF
)"
NVCC=""
for c in "${CUDA_HOME:-}/bin/nvcc" "$(command -v nvcc 2>/dev/null)" /usr/local/cuda/bin/nvcc; do
    if [ -n "$c" ] && [ -x "$c" ]; then NVCC=$c; break; fi
done
say "nvcc: ${NVCC:-none} $([ -n "$NVCC" ] && "$NVCC" --version | tail -1)"
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
MPIRUN=$(command -v mpirun || command -v mpiexec || true)
say "tools: compute-sanitizer ${SANITIZER:-none}; mpirun ${MPIRUN:-none}"
HAVE_TIMEOUT=0
"$PY" -c "import pytest_timeout" >/dev/null 2>&1 && HAVE_TIMEOUT=1

# ---------------------------------------------------------------- 1. build
SRC=/tmp/dpmini-gpu-src
rm -rf "$SRC" && mkdir -p "$SRC"
cp -r setup.py csrc cuda dpmini tests benchmarks tools "$SRC"/
# pytest reads its markers from pyproject.toml (not copied: an older
# setuptools may trip on its metadata)
printf '[pytest]\nmarkers =\n    gpu: needs a CUDA GPU\n    slow: long-running\n' >"$SRC/pytest.ini"
cd "$SRC"
export PYTHONPATH=$SRC${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
BUILT=0
if [ "$GPU" = 0 ] && [ "${GPU_CHECK_DRY_BUILD:-0}" != 1 ]; then
    say "build: SKIPPED (no GPU; GPU_CHECK_DRY_BUILD=1 builds anyway)"
elif [ -n "${DPMINI_PREBUILT:-}" ] && ls "$DPMINI_PREBUILT"/_dpmini*.so >/dev/null 2>&1; then
    cp "$DPMINI_PREBUILT"/_*.so dpmini/
    say "build: prebuilt $(ls "$DPMINI_PREBUILT"/_*.so | xargs -n1 basename | tr '\n' ' ')"
    BUILT=1
else
    t=$(date +%s)
    lim=$(stage_limit 150)
    if ! "$PY" -c 'import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then
        say "build: FAILED - no Python.h for $PY (carry a prebuilt extension: DPMINI_PREBUILT)"
    elif DPMINI_TESTING=1 DPMINI_CUDA_ARCHS=${DPMINI_CUDA_ARCHS:-90} timeout "$lim" "$PY" setup.py -q build_ext \
            --inplace --force -j 16 --build-temp /tmp/dpmini-gpu-build >"$OUT/build.log" 2>&1; then
        BUILT=1
        say "build: ok ($(( $(date +%s) - t )) s, sm_${DPMINI_CUDA_ARCHS:-90}, 16 jobs)"
    else
        say "build: FAILED or timed out after $(( $(date +%s) - t )) s (build.log)"
        tail -15 "$OUT/build.log" >>"$SUM"
    fi
fi
BACKEND=none
if [ "$BUILT" = 1 ]; then
    info=$("$PY" -c 'import dpmini; i = dpmini._dpmini.cuda_build_info(); print(i["backend"], i["device_count"]); print(i)' 2>&1)
    BACKEND=$(echo "$info" | head -1 | cut -d' ' -f1)
    NDEV=$(echo "$info" | head -1 | cut -d' ' -f2)
    say "dpmini: $(echo "$info" | tail -1)"
fi
RUN_GPU=0
if [ "$GPU" = 1 ] && [ "$BACKEND" = cuda ] && [ "${NDEV:-0}" -ge 1 ] 2>/dev/null; then RUN_GPU=1; fi
# GPU_CHECK_FORCE=1 (a dry run of the stages on a build without a GPU: the
# tests and probes then skip themselves, and the stages are timed)
if [ "${GPU_CHECK_FORCE:-0}" = 1 ] && [ "$BUILT" = 1 ]; then RUN_GPU=1; fi

# stage NAME WANT_SECONDS LOGFILE command...: runs with the smaller of the
# limit and the time left; prints the rc (124: timed out, 200: skipped)
stage() {
    local name=$1 want=$2 log=$3; shift 3
    local lim; lim=$(stage_limit "$want")
    if [ "$RUN_GPU" = 0 ]; then say "$name: SKIPPED (no GPU or no CUDA build)"; echo 200; return; fi
    if [ "$lim" -lt 15 ]; then say "$name: SKIPPED (time budget spent)"; echo 200; return; fi
    local t; t=$(date +%s)
    timeout -k 5 "$lim" "$@" >"$OUT/$log" 2>&1
    local rc=$?
    say "$name: rc $rc in $(( $(date +%s) - t )) s (limit $lim s): $(grep -E 'passed|failed|error' "$OUT/$log" | tail -1)"
    echo $rc
}
PT_TIMEOUT=()
[ "$HAVE_TIMEOUT" = 1 ] && PT_TIMEOUT=(-p timeout --timeout 60)

# ---------------------------------------------------------------- 2. gpu tests
GPU_FILES="tests/test_gpu_array.py tests/test_gpu_comm.py tests/test_gpu_dataparallel.py
tests/test_gpu_export_release.py tests/test_gpu_foreign_leaves.py tests/test_gpu_extension_options.py
tests/test_gpu_emulated_hardware.py tests/test_gpu_fork_exit.py tests/test_gpu_free_without_gil.py
tests/test_gpu_nvml_count.py tests/test_gpu_dist_stream_args.py tests/test_capi_capsule.py"
trc=$(stage "gpu tests" 120 tests.txt "$PY" -m pytest -q -m "gpu or not gpu" -p no:cacheprovider \
      -rs "${PT_TIMEOUT[@]}" $GPU_FILES | tail -1)

# ---------------------------------------------------------------- 3. interop
irc=$(stage "interop (torch/JAX/CuPy)" 100 interop.txt "$PY" -m pytest -q -p no:cacheprovider -rs \
      "${PT_TIMEOUT[@]}" tests/interop | tail -1)

# ---------------------------------------------------------------- 4. probes
prc=$(stage "probes" 120 probes.txt "$PY" tools/gpu_probes.py | tail -1)

# ---------------------------------------------------------------- 5. sanitizer
if [ -z "$SANITIZER" ] && [ "$RUN_GPU" = 1 ]; then
    say "sanitizer: SKIPPED (no compute-sanitizer)"; src=200
else
    src=$(stage "sanitizer memcheck" 90 sanitizer.txt "$SANITIZER" --tool memcheck \
          --error-exitcode 9 --launch-timeout 30 "$PY" -m pytest -q -p no:cacheprovider -m gpu \
          tests/test_gpu_comm.py -k "strided or reduce or kernel" | tail -1)
    grep -E "ERROR SUMMARY|Device not supported" "$OUT/sanitizer.txt" 2>/dev/null | tail -2 >>"$SUM"
fi

# ---------------------------------------------------------------- 6. distributed (-np 1)
if [ "$RUN_GPU" = 1 ] && { [ -z "$MPIRUN" ] || ! "$PY" -c "import dpmini._dist" >/dev/null 2>&1; }; then
    say "distributed nccl (-np 1): SKIPPED (no mpirun or no dpmini._dist)"; drc=200
else
    drc=$(OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 stage "distributed nccl (-np 1)" \
          60 nccl.txt "${MPIRUN:-mpirun}" -np 1 "$PY" tests/distributed/worker.py gpu_real | tail -1)
fi

# ---------------------------------------------------------------- 7. benchmark
if [ "$(left)" -gt 100 ]; then
    brc=$(BENCH_REPS=1 stage "benchmark" $(( $(left) - 20 )) bench.txt "$PY" benchmarks/bench_gpu.py \
          | tail -1)
    [ -s "$OUT/bench.txt" ] && cat "$OUT/bench.txt" >>"$SUM"
else
    say "benchmark: SKIPPED ($(left) s left)"; brc=200
fi

# ---------------------------------------------------------------- findings
probe_status() {   # FINDING NAME: from probes.txt
    local line; line=$(grep -E "^PROBE $1 $2:" "$OUT/probes.txt" 2>/dev/null | head -1)
    case "$line" in
        *": OK"*) finding "$1" passed "$2 (${line#*: OK })" ;;
        *": FAIL"*) finding "$1" FAILED "$2 (${line#*: FAIL })" ;;
        *": SKIP"*) finding "$1" skipped "$2 (${line#*: SKIP })" ;;
        *) finding "$1" skipped "$2 (probe did not run)" ;;
    esac
}
test_status() {    # FINDING TESTNAME-PATTERN: from tests.txt
    local f=$OUT/tests.txt
    if [ ! -s "$f" ]; then finding "$1" skipped "$2 (tests did not run)"; return; fi
    if grep -qE "(FAILED|ERROR).*$2" "$f"; then finding "$1" FAILED "$2"
    elif grep -qE "SKIPPED.*$2" "$f"; then finding "$1" skipped "$2 (skipped on this machine)"
    else finding "$1" passed "$2 (or not collected)"; fi
}
rc_status() {      # FINDING RC what
    case "$2" in
        0) finding "$1" passed "$3" ;;
        200) finding "$1" skipped "$3" ;;
        124|137) finding "$1" FAILED "$3 (timed out)" ;;
        *) finding "$1" FAILED "$3 (rc $2)" ;;
    esac
}
say "== findings (ran: passed / FAILED; skipped: why)"
probe_status C1 device_count_matches_cuda
finding C2 skipped "PCI bus id compare: needs two ranks (emulated test: test_distributed_gpu_devices.py)"
test_status C3 test_cupy_stream_is_the_current_stream
rc_status W1 "$drc" "-np 1 NCCL collectives (the wrong-device poll needs 2 GPUs: emulated test only)"
probe_status W2 cuda_autocast_reaches_replicas
probe_status W2 callers_stream_orders_replicas
probe_status W3 destroyed_consumer_stream_is_not_synchronised
finding H1 skipped "launch lock: needs 2 GPUs for an NCCL group (emulated test: test_gpu_nccl_launch_lock.py)"
probe_status H3 max_pitch_of_this_gpu
test_status P1 test_cache_eviction_frees_device_memory_without_the_gil
probe_status 8 consumer_write_after_export
probe_status 13 strided_copy_over_2_pow_32_elements
probe_status torch torch_module_replicates_on_the_gpu
rc_status tests "$trc" "GPU tests (one GPU)"
rc_status interop "$irc" "tests/interop"
rc_status memcheck "$src" "compute-sanitizer memcheck"
rc_status bench "$brc" "bench_gpu.py"
say "total: $(elapsed) s"
bad=0
for r in "$trc" "$irc" "$prc" "$src" "$drc"; do
    case "$r" in 0|200) ;; *) bad=1 ;; esac
done
if [ "$GPU" = 0 ]; then say "RESULT: dry run (no GPU): nothing on the GPU ran"; exit 0; fi
[ "$bad" = 0 ] && say "RESULT: ok" || say "RESULT: FAILED (see findings.txt and the stage logs)"
exit "$bad"
