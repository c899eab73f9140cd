/* dist_test_api.h - the hooks that the test-only extension dpmini._testing
 * (csrc/testing/testing.c, built when DPMINI_TESTING=1) reaches inside
 * dpmini._dist: one table of C function pointers, filled in dist_module.c
 * and exported as the capsule dpmini._dist._test_api, as _dpmini does with
 * py/test_api.h. The shipped _dist has no Python function for any of them.
 *
 * Plain C on purpose: dpmini._testing is built without MPI's flags (and also
 * where _dist is not built at all), so this header names neither mpi.h nor
 * dist.h; _testing imports the capsule at the first call of a dist_* hook.
 *
 * Adding a hook: a field below, its value in dist_module.c's test_api, the
 * Python function in testing.c's method table. Every entry is called with
 * the GIL held and sets a Python exception when it returns -1. Bump
 * DIST_TEST_API_VERSION when a field changes type or place. */
#ifndef DPMINI_DIST_TEST_API_H
#define DPMINI_DIST_TEST_API_H

#define DIST_TEST_API_CAPSULE "dpmini._dist._test_api"
#define DIST_TEST_API_VERSION 1

typedef struct dist_test_api {
    int version;   /* DIST_TEST_API_VERSION */
    /* The ABI guard that _dist runs at import, on another library version
     * string: 0 when an MPI library with this version has the handle ABI of
     * the mpi.h _dist was built with and is the library _dist is linked to,
     * else -1 with ImportError saying which is which. */
    int (*check_abi)(const char *library_version);
    /* Before the first GPU collective: NCCL emulated over MPI on host memory
     * (1) or the real libnccl (0), instead of asking dpmini.distributed;
     * -1 with RuntimeError once the other one is in use. */
    int (*nccl_set_emulated)(int on);
} dist_test_api;

#endif
