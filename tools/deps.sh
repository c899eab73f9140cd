#!/usr/bin/env bash
# tools/deps.sh - make sure the tool a reliability target needs is installed.
#
#   tools/deps.sh asan      gcc's AddressSanitizer/UBSan runtime (libasan.so)
#   tools/deps.sh fuzz      clang with libFuzzer (libclang_rt.fuzzer)
#   tools/deps.sh valgrind  valgrind
#   tools/deps.sh mpi       Open MPI (mpirun, mpicc, mpi.h) for dpmini.distributed
#
# Each check looks for the tool first and only when it is missing installs
# the Debian/Ubuntu package that provides it (apt-get, as root or via sudo).
# Used by the Makefile targets test-asan, fuzz, test-valgrind and
# test-distributed / demo-distributed / bench-distributed, and so by
# .ci/run. Never assumes the CI image already has them.
set -euo pipefail

apt_install() {
    local sudo=""
    if [ "$(id -u)" != 0 ]; then
        command -v sudo >/dev/null || { echo "deps.sh: need root or sudo to install $*" >&2; exit 1; }
        sudo="sudo"
    fi
    command -v apt-get >/dev/null || { echo "deps.sh: no apt-get; install $* by hand" >&2; exit 1; }
    echo "deps.sh: installing $*" >&2
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

have_asan() {
    command -v gcc >/dev/null || return 1
    local lib; lib=$(gcc -print-file-name=libasan.so)
    [ "${lib#/}" != "$lib" ] && [ -e "$lib" ]
}

have_fuzzer() {
    command -v clang >/dev/null || return 1
    local lib; lib=$(clang -print-file-name=libclang_rt.fuzzer-x86_64.a 2>/dev/null)
    [ "${lib#/}" != "$lib" ] && [ -e "$lib" ] && return 0
    # other architectures / layouts: ask clang to link a fuzzer
    printf 'int LLVMFuzzerTestOneInput(const char*d,unsigned long n){return 0;}\n' |
        clang -x c -fsanitize=fuzzer - -o /dev/null 2>/dev/null
}

case "${1:-}" in
asan)
    have_asan || apt_install gcc libc6-dev
    have_asan || { echo "deps.sh: libasan still missing after install" >&2; exit 1; }
    ;;
fuzz)
    if ! have_fuzzer; then
        command -v clang >/dev/null || apt_install clang
        if ! have_fuzzer; then
            v=$(clang --version | sed -n 's/.*clang version \([0-9]*\).*/\1/p' | head -1)
            apt_install "libclang-rt-$v-dev" || apt_install "libclang-common-$v-dev"
        fi
    fi
    have_fuzzer || { echo "deps.sh: libFuzzer still missing after install" >&2; exit 1; }
    ;;
valgrind)
    command -v valgrind >/dev/null || apt_install valgrind
    ;;
mpi)
    if ! { command -v mpirun >/dev/null && command -v mpicc >/dev/null; }; then
        apt_install openmpi-bin libopenmpi-dev
    fi
    command -v mpirun >/dev/null || { echo "deps.sh: mpirun still missing after install" >&2; exit 1; }
    ;;
*)
    echo "usage: tools/deps.sh asan|fuzz|valgrind|mpi" >&2
    exit 2
    ;;
esac
