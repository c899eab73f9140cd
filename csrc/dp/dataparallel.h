/* dataparallel.h - internal: what dataparallel.c, replicate.c and
 * parallel_apply.c share (not part of dpmini.h; include after it).
 *
 * Conventions as in dpmini.h: PyObject* results are new references or NULL
 * with an exception set; int results are 0 or -1 with an exception set.
 * The symbols below are hidden: they do not widen what the extension module
 * exports.
 */
#ifndef DPMINI_DATAPARALLEL_H
#define DPMINI_DATAPARALLEL_H

#include "dpmini.h"

#pragma GCC visibility push(hidden)

/* replicate.c: module replicated onto devs[0..ndev) as a list of ndev
 * replicas (ndev may be 0); used by DataParallel.forward. */
PyObject *replicate_core(dp_state *st, PyObject *module, const dp_device *devs,
                         Py_ssize_t ndev);
/* replicate.c: replicate with `devices` a Python sequence of devices (empty
 * gives []); used by DataParallel.replicate and dpmini.replicate. */
PyObject *replicate_common(dp_state *st, PyObject *module, PyObject *devices);

/* parallel_apply.c: parallel_apply over Python sequences; devices from cdevs
 * (ncdevs entries) when given, else `devices`, else automatic. Used by
 * DataParallel.forward / .parallel_apply and dpmini.parallel_apply. */
PyObject *parallel_apply_run(dp_state *st, PyObject *modules, PyObject *inputs,
                             PyObject *kwargs_tup, PyObject *devices,
                             const dp_device *cdevs, Py_ssize_t ncdevs);
/* parallel_apply.c: one replica's positional arguments as an exact tuple
 * (a list or tuple is unpacked, else (input,)); also dataparallel.c's
 * one-device call. */
PyObject *input_as_args(PyObject *input);
/* parallel_apply.c: one replica's keyword arguments as an exact dict or NULL
 * in *out (None: no keywords); also dataparallel.c's one-device call. */
int kwargs_as_dict(PyObject *kw, const char *what, Py_ssize_t i, PyObject **out);

/* parallel_apply.c: whether a call whose replicas are (of) `module`, with
 * `nvcpu` of its devices virtual CPU devices, may park the caller's OpenMP
 * team (core/omp_team.h): two or more such devices and `module` an
 * instance of the type a library registered (_park_openmp_team). */
int dp_park_candidate(const dp_state *st, PyObject *module, Py_ssize_t nvcpu);
/* parallel_apply.c: run fn(arg), a park candidate's work (GIL held), with
 * the caller's OpenMP team parked unless the last candidate call was short
 * (the library's prepare callable first); records how long this one took. */
void dp_run_park_candidate(const dp_state *st, void (*fn)(void *), void *arg);

#pragma GCC visibility pop

#endif
