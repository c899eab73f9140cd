/* comm.h - internal: what the dpmini.comm files share: comm.c (scatter,
 * gather and the dpmini.comm method table) and comm_broadcast.c (broadcast,
 * broadcast_coalesced, reduce_add, reduce_add_coalesced). Not part of
 * dpmini.h; include after it.
 *
 * Conventions as in dpmini.h: int results are 0 or -1 with an exception set;
 * PyObject* results are new references or NULL with an exception set. The
 * symbols below are hidden: they do not widen what the extension module
 * exports.
 */
#ifndef DPMINI_COMM_H
#define DPMINI_COMM_H

#include "dpmini.h"

#pragma GCC visibility push(hidden)

/* A docstring that another file's method table names (PyDoc_STRVAR, but
 * visible to the other files of the extension). */
#define DP_COMM_DOC(name, str) const char name[] = PyDoc_STR(str)

/* comm.c: a gather/reduce destination: None -> dflt, "cpu"/-1 -> host (-1
 * warns, docs/spec.md 4.3), else a device (*out); errors name argname. */
int parse_destination(dp_state *st, PyObject *obj, const char *argname,
                      dp_device dflt, dp_device *out);

/* comm_broadcast.c: the dpmini.comm functions of the broadcast and reduce
 * families and their docstrings, for comm.c's method table. */
extern const char comm_broadcast_doc[];
extern const char comm_broadcast_coalesced_doc[];
extern const char comm_reduce_add_doc[];
extern const char comm_reduce_add_coalesced_doc[];
PyObject *comm_broadcast(PyObject *m, PyObject *args, PyObject *kw);
PyObject *comm_broadcast_coalesced(PyObject *m, PyObject *args, PyObject *kw);
PyObject *comm_reduce_add(PyObject *m, PyObject *args, PyObject *kw);
PyObject *comm_reduce_add_coalesced(PyObject *m, PyObject *args, PyObject *kw);

#pragma GCC visibility pop

#endif
