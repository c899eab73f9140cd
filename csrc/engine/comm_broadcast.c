/* comm_broadcast.c - the dpmini.comm functions of the broadcast and reduce
 * families, which mirror torch.cuda.comm (docs/spec.md 8): broadcast,
 * broadcast_coalesced, reduce_add, reduce_add_coalesced. Argument parsing
 * and checks here; the copies run on the copy engine (copy_engine.h), the
 * sums in reduce.c. comm.c holds scatter, gather and the method table.
 *
 * Sections: broadcast; reduce.
 */
#include "dpmini.h"
#include "copy_engine.h"
#include "comm.h"
#include "engine.h"
#include "profile.h"

/* Default bucket size of broadcast_coalesced (docs/spec.md 5.3). */
#define DP_BUCKET_BYTES 10485760

/* ------------------------------------------------------------------ */
/* Broadcast                                                           */
/* ------------------------------------------------------------------ */

DP_COMM_DOC(comm_broadcast_doc,
"broadcast(array, devices=None, *, out=None)\n"
"--\n"
"\n"
"Returns a tuple with one array per device (or out's arrays).\n"
"Copy array to every device (torch.cuda.comm.broadcast, docs/spec.md 8.1). Exactly one of\n"
"devices / out. The entry for the array's own device is the array itself; the others\n"
"are copies (dense layouts keep their strides). out: arrays of the same shape and dtype\n"
"to fill in place.\n"
"Raises ValueError (both or neither of devices/out, shape mismatch, read-only out,\n"
"out[i] overlapping array, another out[j] or itself), TypeError (not an array, object\n"
"dtype, MaskedArray/matrix).");

/* out[i] (o) can take a copy of arr: its shape and dtype, writeable, not
 * overlapping arr. 0, or -1 naming out[i]. */
static int check_broadcast_out(PyArrayObject *o, PyArrayObject *arr, Py_ssize_t i)
{
    if (!PyArray_SAMESHAPE(o, arr) ||
        !PyArray_EquivTypes(PyArray_DESCR(o), PyArray_DESCR(arr))) {
        PyErr_Format(PyExc_ValueError,
                     "out[%zd]: expected an array of the source's shape and dtype", i);
        return -1;
    }
    if (!PyArray_ISWRITEABLE(o)) {
        PyErr_Format(PyExc_ValueError, "out[%zd]: output array is read-only", i);
        return -1;
    }
    char name[48];
    PyOS_snprintf(name, sizeof name, "out[%zd]", i);
    return check_out_overlap(o, &arr, 1, name, "array");
}

/* comm.broadcast with out=: arr copied into every array of out_obj, in
 * place. The tuple of out's items, or NULL. */
static PyObject *broadcast_into(dp_state *st, PyArrayObject *arr, PyObject *out_obj)
{
    PyArrayObject **outs = NULL;
    Py_ssize_t nout = 0;
    job_list jobs = {0};
    PyObject *result = NULL;
    int r = arrays_from_sequence(st, out_obj, "out", 0, &outs, &nout) < 0 ||
                    check_outs_disjoint(outs, nout) < 0 ? -1 : 0;
    for (Py_ssize_t i = 0; i < nout && r == 0; i++) {
        r = check_broadcast_out(outs[i], arr, i) < 0 ||
            jobs_add_array(&jobs, outs[i], arr,
                           exec_device(dp_array_device(st, arr),
                                       dp_array_device(st, outs[i]))) < 0 ? -1 : 0;
    }
    if (r == 0 && jobs_run(&jobs) == 0) {
        result = PySequence_Tuple(out_obj);
    }
    jobs_free(&jobs);
    arrays_free(outs, nout);
    return result;
}

/* comm.broadcast with devices: arr on every device of devices_obj (itself
 * on its own device). A tuple with one array per device, or NULL. */
static PyObject *broadcast_to_devices(dp_state *st, PyArrayObject *arr, PyObject *devices_obj)
{
    dp_device *devs = NULL;
    Py_ssize_t ndev = 0;
    PyObject *one = NULL, *rows = NULL, *result = NULL;
    if (dp_device_list_from_object(st, devices_obj, "devices", &devs, &ndev) < 0 ||
        (one = PyList_New(1)) == NULL) {
        goto done;
    }
    PyList_SET_ITEM(one, 0, Py_NewRef((PyObject *)arr));
    rows = dp_broadcast_coalesced(st, one, devs, ndev, DP_BUCKET_BYTES);
    if (rows == NULL || (result = PyTuple_New(ndev)) == NULL) {
        goto done;
    }
    for (Py_ssize_t d = 0; d < ndev; d++) {
        PyTuple_SET_ITEM(result, d, Py_NewRef(PyList_GET_ITEM(PyList_GET_ITEM(rows, d), 0)));
    }
done:
    Py_XDECREF(rows);
    Py_XDECREF(one);
    PyMem_Free(devs);
    return result;
}

static PyObject *comm_broadcast_steps(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"array", "devices", "out", NULL};
    PyObject *obj, *devices_obj = Py_None, *out_obj = Py_None, *result;
    dp_state *st = dp_state_from_module(m);

    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O$O:broadcast", kwlist, &obj, &devices_obj,
                                     &out_obj)) {
        return NULL;
    }
    if ((devices_obj == Py_None) == (out_obj == Py_None)) {
        PyErr_SetString(PyExc_ValueError,
                        "devices, out: Exactly one of 'devices' and 'out' must be specified");
        return NULL;
    }
    PyArrayObject *arr = dp_as_array(st, obj, "array", 0);
    if (arr == NULL) {
        return NULL;
    }
    if (out_obj != Py_None) {
        result = broadcast_into(st, arr, out_obj);
    } else {
        result = dp_comm_back(st, obj, 0, broadcast_to_devices(st, arr, devices_obj));
    }
    Py_DECREF(arr);
    return result;
}

/* The call (dp_entry_call): one span under dpmini.profile(); a torch tensor
 * that requires grad goes to dpmini._torch.comm_broadcast. */
PyObject *comm_broadcast(PyObject *m, PyObject *args, PyObject *kw)
{
    static const dp_entry e = {comm_broadcast_steps, DP_PROF_BROADCAST,
                                "comm.broadcast", "comm_broadcast"};
    return dp_entry_call(m, args, kw, &e);
}

static int parse_buffer_size(PyObject *obj, size_t *out)
{
    if (obj == NULL) {
        *out = DP_BUCKET_BYTES;
        return 0;
    }
    int v;
    if (dp_int_from_object(obj, "buffer_size", &v) < 0) {
        return -1;
    }
    if (v <= 0) {
        PyErr_Format(PyExc_ValueError, "buffer_size: expected a positive number of bytes, got %d",
                     v);
        return -1;
    }
    *out = (size_t)v;
    return 0;
}

DP_COMM_DOC(comm_broadcast_coalesced_doc,
"broadcast_coalesced(arrays, devices, buffer_size=10485760)\n"
"--\n"
"\n"
"Returns a list of lists: entry d holds every array's copy on devices[d].\n"
"Copy every array to every device (torch.cuda.comm.broadcast_coalesced, docs/spec.md 5.3), in\n"
"the order of arrays. Entries for an array's own device are the array itself (PyTorch\n"
"requires all arrays on devices[0]; dpmini accepts them anywhere and copies to\n"
"devices[0] too when needed). buffer_size (bytes, > 0) is validated for\n"
"compatibility: on CPU devices all copies already run in one batched pass, so no flat\n"
"staging buffer is used.\n"
"Raises ValueError (no devices, bad buffer_size), TypeError (not arrays, object\n"
"dtype).");

static PyObject *comm_broadcast_coalesced_steps(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"arrays", "devices", "buffer_size", NULL};
    PyObject *arrays_obj, *devices_obj, *bs_obj = NULL, *result;
    dp_state *st = dp_state_from_module(m);
    dp_device *devs = NULL;
    Py_ssize_t ndev = 0;
    size_t bs;

    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|O:broadcast_coalesced", kwlist,
                                     &arrays_obj, &devices_obj, &bs_obj)) {
        return NULL;
    }
    if (parse_buffer_size(bs_obj, &bs) < 0 ||
        dp_device_list_from_object(st, devices_obj, "devices", &devs, &ndev) < 0) {
        return NULL;
    }
    result = dp_broadcast_coalesced(st, arrays_obj, devs, ndev, bs);
    result = dp_comm_back_rows(st, arrays_obj, result);
    PyMem_Free(devs);
    return result;
}

/* The call (dp_entry_call): one span under dpmini.profile(); a torch tensor
 * that requires grad goes to dpmini._torch.comm_broadcast_coalesced. */
PyObject *comm_broadcast_coalesced(PyObject *m, PyObject *args, PyObject *kw)
{
    static const dp_entry e = {comm_broadcast_coalesced_steps, DP_PROF_BROADCAST,
                                "comm.broadcast_coalesced", "comm_broadcast_coalesced"};
    return dp_entry_call(m, args, kw, &e);
}

/* ------------------------------------------------------------------ */
/* Reduce                                                              */
/* ------------------------------------------------------------------ */

DP_COMM_DOC(comm_reduce_add_doc,
"reduce_add(arrays, destination=None)\n"
"--\n"
"\n"
"Returns the sum as an ndarray on destination.\n"
"Sum arrays of one shape and one dtype onto destination (torch.cuda.comm.reduce_add,\n"
"docs/spec.md 8.3): the sum is (a0 + a1) + a2 ..., in index order. destination None: the\n"
"device of arrays[0]; 'cpu' the host. A single input already on destination is\n"
"returned as is. Arrays of another library (torch, JAX, CuPy) are read without a\n"
"copy; the sum comes back in arrays[0]'s library. Sums of ml_dtypes' floating\n"
"dtypes (bfloat16, float8_*, float6/float4; torch.bfloat16 and float8 tensors\n"
"are read as them) accumulate in float32 (complex32 in complex64) on the host and\n"
"are rounded to the dtype once (docs/libraries.md, \"Dtypes NumPy lacks\").\n"
"Raises ValueError (empty, size mismatch: 'input i has invalid size'), TypeError (not\n"
"arrays, object dtype, arrays[i] with another dtype than arrays[0], structured\n"
"dtypes, ml_dtypes' small integers such as int4).");

static PyObject *comm_reduce_add_steps(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"arrays", "destination", NULL};
    PyObject *arrays_obj, *dest_obj = Py_None;
    dp_state *st = dp_state_from_module(m);
    dp_device dest, dflt = {DP_HOST, -1};

    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O:reduce_add", kwlist, &arrays_obj,
                                     &dest_obj)) {
        return NULL;
    }
    if (dest_obj == Py_None && PySequence_Check(arrays_obj) && PySequence_Size(arrays_obj) > 0) {
        PyObject *first = PySequence_GetItem(arrays_obj, 0);
        if (first == NULL) {
            return NULL;
        }
        if (PyArray_Check(first)) {
            dflt = dp_array_device(st, (PyArrayObject *)first);
        }
        Py_DECREF(first);
    }
    PyErr_Clear();
    if (parse_destination(st, dest_obj, "destination", dflt, &dest) < 0) {
        return NULL;
    }
    return dp_comm_back(st, arrays_obj, 1, dp_reduce_add(st, arrays_obj, dest, "arrays"));
}

/* The call (dp_entry_call): one span under dpmini.profile(); a torch tensor
 * that requires grad goes to dpmini._torch.comm_reduce_add. */
PyObject *comm_reduce_add(PyObject *m, PyObject *args, PyObject *kw)
{
    static const dp_entry e = {comm_reduce_add_steps, DP_PROF_REDUCE,
                                "comm.reduce_add", "comm_reduce_add"};
    return dp_entry_call(m, args, kw, &e);
}

DP_COMM_DOC(comm_reduce_add_coalesced_doc,
"reduce_add_coalesced(per_device, destination=None, buffer_size=10485760)\n"
"--\n"
"\n"
"Returns a tuple whose entry t is the sum over d of per_device[d][t].\n"
"per_device[d][t] is array t on device d (torch.cuda.comm.reduce_add_coalesced, spec\n"
"8.4; the rule of reduce_add for each t). All inner sequences must have the same\n"
"length. buffer_size (bytes, > 0) is validated for compatibility.\n"
"Raises ValueError (empty, lengths or sizes that differ, bad buffer_size), TypeError\n"
"(as reduce_add).");

/* per_device (seq, ndev >= 1 entries): every entry a sequence of arrays,
 * all of per_device[0]'s length. That length, or -1. */
static Py_ssize_t per_device_length(PyObject *seq, Py_ssize_t ndev)
{
    Py_ssize_t ntensors = -1;
    for (Py_ssize_t d = 0; d < ndev; d++) {
        PyObject *row = PySequence_Fast_GET_ITEM(seq, d);
        Py_ssize_t len = PyArray_Check(row) ? -1 : PySequence_Size(row);
        if (len < 0) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "per_device[%zd]: expected a sequence of arrays", d);
            return -1;
        }
        if (ntensors >= 0 && len != ntensors) {
            PyErr_Format(PyExc_ValueError,
                         "per_device[%zd]: has %zd arrays, but per_device[0] has %zd", d, len,
                         ntensors);
            return -1;
        }
        ntensors = len;
    }
    return ntensors;
}

/* The sum over d of per_device[d][t] (seq: per_device's ndev entries) on
 * the destination (default: the device of per_device[0][t]), in the
 * library of the column's arrays. New reference or NULL. */
static PyObject *reduce_column(dp_state *st, PyObject *seq, Py_ssize_t ndev, Py_ssize_t t,
                               PyObject *dest_obj)
{
    PyObject *column = PyList_New(ndev);
    if (column == NULL) {
        return NULL;
    }
    for (Py_ssize_t d = 0; d < ndev; d++) {
        PyObject *item = PySequence_GetItem(PySequence_Fast_GET_ITEM(seq, d), t);
        if (item == NULL) {
            Py_DECREF(column);
            return NULL;
        }
        PyList_SET_ITEM(column, d, item);
    }
    dp_device dest, dflt = {DP_HOST, -1};
    PyObject *first = PyList_GET_ITEM(column, 0), *sum = NULL;
    if (PyArray_Check(first)) {
        dflt = dp_array_device(st, (PyArrayObject *)first);
    }
    char name[64];
    snprintf(name, sizeof name, "per_device[:][%zd]", t);
    if (parse_destination(st, dest_obj, "destination", dflt, &dest) == 0) {
        sum = dp_comm_back(st, column, 1, dp_reduce_add(st, column, dest, name));
    }
    Py_DECREF(column);
    return sum;
}

static PyObject *comm_reduce_add_coalesced_steps(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"per_device", "destination", "buffer_size", NULL};
    PyObject *pd_obj, *dest_obj = Py_None, *bs_obj = NULL, *result = NULL;
    dp_state *st = dp_state_from_module(m);
    size_t bs;

    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|OO:reduce_add_coalesced", kwlist, &pd_obj,
                                     &dest_obj, &bs_obj) ||
        parse_buffer_size(bs_obj, &bs) < 0) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(pd_obj,
                                    "per_device: expected a sequence of per-device sequences");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t ndev = PySequence_Fast_GET_SIZE(seq), ntensors;
    if (ndev == 0) {
        PyErr_SetString(PyExc_ValueError, "per_device: expected at least one device's arrays");
    } else if ((ntensors = per_device_length(seq, ndev)) >= 0 &&
               (result = PyTuple_New(ntensors)) != NULL) {
        for (Py_ssize_t t = 0; t < ntensors; t++) {
            PyObject *sum = reduce_column(st, seq, ndev, t, dest_obj);
            if (sum == NULL) {
                Py_CLEAR(result);
                break;
            }
            PyTuple_SET_ITEM(result, t, sum);
        }
    }
    Py_DECREF(seq);
    return result;
}

/* The call (dp_entry_call): one span under dpmini.profile(); a torch tensor
 * that requires grad goes to dpmini._torch.comm_reduce_add_coalesced. */
PyObject *comm_reduce_add_coalesced(PyObject *m, PyObject *args, PyObject *kw)
{
    static const dp_entry e = {comm_reduce_add_coalesced_steps, DP_PROF_REDUCE,
                                "comm.reduce_add_coalesced", "comm_reduce_add_coalesced"};
    return dp_entry_call(m, args, kw, &e);
}
