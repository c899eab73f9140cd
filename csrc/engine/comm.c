/* comm.c - the dpmini.comm functions, which mirror torch.cuda.comm
 * (docs/spec.md 8): scatter and gather, and the dpmini.comm method table;
 * broadcast, broadcast_coalesced, reduce_add and reduce_add_coalesced are in
 * comm_broadcast.c, dpmini.asarray in asarray.c. Argument parsing and checks
 * here; the copies run on the copy engine (copy_engine.c, copy_engine.h).
 *
 * Sections: scatter; gather; method table.
 */
#include "dpmini.h"
#include "engine.h"
#include "copy_engine.h"
#include "comm.h"
#include "plan.h"
#include "copy.h"
#include "profile.h"

/* ------------------------------------------------------------------ */
/* Scatter                                                             */
/* ------------------------------------------------------------------ */

/* Chunk sizes from a Python sequence (comm.scatter's chunk_sizes). */
static int parse_chunk_sizes(PyObject *obj, Py_ssize_t ndev, int64_t n, int dim,
                             int64_t *sizes)
{
    PyObject *seq = PySequence_Fast(obj, "");
    if (seq == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Format(PyExc_TypeError, "chunk_sizes: expected a sequence of ints, got %.100s",
                         Py_TYPE(obj)->tp_name);
        }
        return -1;
    }
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    if (len != ndev) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError,
                     "chunk_sizes: Expected devices and chunk_sizes to be of same length, "
                     "but got len(devices) = %zd and len(chunk_sizes) = %zd", ndev, len);
        return -1;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        PyObject *v = PySequence_Fast_GET_ITEM(seq, i);
        char name[48];
        long long x;
        snprintf(name, sizeof name, "chunk_sizes[%zd]", i);
        if (dp_index_from_object(v, name, LLONG_MIN, LLONG_MAX, &x) < 0) {
            Py_DECREF(seq);
            return -1;
        }
        sizes[i] = x;
    }
    Py_DECREF(seq);
    int bad;
    int rc = dp_check_chunk_sizes(n, (int)ndev, sizes, &bad);
    if (rc == DP_ERR_NEGATIVE_SIZE) {
        PyErr_Format(PyExc_ValueError,
                     "chunk_sizes: split_with_sizes expects split_sizes to be non-negative, "
                     "but chunk_sizes[%d] is %lld", bad, (long long)sizes[bad]);
        return -1;
    }
    if (rc != DP_OK) {
        /* The sizes are each >= 0 here but their sum can pass INT64_MAX
         * (reliability.md, bug 1): say so instead of printing a wrapped sum. */
        long long sum = 0;
        int overflow = 0;
        for (Py_ssize_t i = 0; i < ndev && !overflow; i++) {
            overflow = __builtin_add_overflow(sum, (long long)sizes[i], &sum);
        }
        if (overflow) {
            PyErr_Format(PyExc_ValueError,
                         "chunk_sizes: split_with_sizes expects split_sizes to sum exactly to "
                         "%lld (input array's size at dimension %d), but got a sum larger "
                         "than %lld", (long long)n, dim, (long long)INT64_MAX);
            return -1;
        }
        PyErr_Format(PyExc_ValueError,
                     "chunk_sizes: split_with_sizes expects split_sizes to sum exactly to %lld "
                     "(input array's size at dimension %d), but got sum %lld",
                     (long long)n, dim, sum);
        return -1;
    }
    return 0;
}

/* An out= array: an ndarray, a GPU array, or an array of another library
 * (a torch CPU tensor: written in place through the view its DLPack export
 * gives, as comm.broadcast's out= does). 0, or -1 with TypeError naming
 * argname and the object's type by module and qualified name. */
static int check_out_kind(dp_state *st, PyObject *o, const char *argname)
{
    if (PyArray_Check(o) || dp_is_device_object(st, o)) {
        return 0;
    }
    int foreign = dp_is_foreign_array(st, o);
    if (foreign != 0) {
        return foreign < 0 ? -1 : 0;
    }
    dp_refuse_out_array(o, argname);
    return -1;
}

/* out must be a sequence of arrays, not one array (a torch tensor is a
 * sequence too, and so are str and bytes). 0, or -1 with TypeError. */
static int refuse_single_out(dp_state *st, PyObject *out_obj)
{
    int single = PyArray_Check(out_obj) || PyUnicode_Check(out_obj) || PyBytes_Check(out_obj);
    if (!single && (single = dp_is_foreign_array(st, out_obj)) < 0) {
        return -1;
    }
    if (!single) {
        return 0;
    }
    PyObject *tn = dp_type_name(out_obj);
    if (tn != NULL) {
        PyErr_Format(PyExc_TypeError, "out: expected a sequence of arrays, got %U", tn);
        Py_DECREF(tn);
    }
    return -1;
}

/* out[i] (o, as an array) fits src: its rank, its sizes outside dim, its
 * dtype; writeable; not overlapping src. 0, or -1 naming out[i]. */
static int check_scatter_out(PyArrayObject *o, PyArrayObject *src, int dim, Py_ssize_t i,
                             const char *name)
{
    int nd = PyArray_NDIM(src);
    if (PyArray_NDIM(o) != nd) {
        PyErr_Format(PyExc_ValueError,
                     "out[%zd]: Output array has incorrect shape: expected %d dimensions, "
                     "got %d", i, nd, PyArray_NDIM(o));
        return -1;
    }
    for (int d = 0; d < nd; d++) {
        if (d != dim && PyArray_DIM(o, d) != PyArray_DIM(src, d)) {
            PyErr_Format(PyExc_ValueError,
                         "out[%zd]: Output array has incorrect shape: size %zd at "
                         "dimension %d, expected %zd", i, (Py_ssize_t)PyArray_DIM(o, d),
                         d, (Py_ssize_t)PyArray_DIM(src, d));
            return -1;
        }
    }
    if (!PyArray_EquivTypes(PyArray_DESCR(o), PyArray_DESCR(src))) {
        PyErr_Format(PyExc_TypeError, "out[%zd]: expected dtype %S, got %S%s", i,
                     (PyObject *)PyArray_DESCR(src), (PyObject *)PyArray_DESCR(o),
                     dp_byteorder_note(PyArray_DESCR(src), PyArray_DESCR(o)));
        return -1;
    }
    if (!PyArray_ISWRITEABLE(o)) {
        PyErr_Format(PyExc_ValueError, "out[%zd]: output array is read-only", i);
        return -1;
    }
    return check_out_overlap(o, &src, 1, name, "array");
}

/* Each of seq's n items as an array into outs (new references), checked
 * against src; their sizes along dim must add up to src's. 0 or -1. */
static int take_scatter_outs(dp_state *st, PyObject *seq, Py_ssize_t n, PyArrayObject *src,
                             int dim, PyArrayObject **outs)
{
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(seq, i);
        char name[48];
        snprintf(name, sizeof name, "out[%zd]", i);
        if (check_out_kind(st, o, name) < 0) {
            return -1;
        }
        outs[i] = dp_as_array(st, o, name, 0); /* a GPU array: its shadow; torch: a view */
        if (outs[i] == NULL || check_scatter_out(outs[i], src, dim, i, name) < 0) {
            return -1;
        }
        /* A wrapped sum could pass the check below and copy past src. */
        if (__builtin_add_overflow(total, (int64_t)PyArray_DIM(outs[i], dim), &total)) {
            PyErr_Format(PyExc_ValueError,
                         "out: Total size for output arrays along scatter dim %d does not "
                         "match the source array size at dim %d (the sizes up to out[%zd] "
                         "add up to more than %lld)", dim, dim, i, (long long)INT64_MAX);
            return -1;
        }
    }
    if (check_outs_disjoint(outs, n) < 0) {
        return -1;
    }
    if (total != PyArray_DIM(src, dim)) {
        PyErr_Format(PyExc_ValueError,
                     "out: Total size for output arrays along scatter dim %d does not match "
                     "the source array size at dim %d (%lld != %lld)", dim, dim,
                     (long long)total, (long long)PyArray_DIM(src, dim));
        return -1;
    }
    return 0;
}

/* Chunk i of src copied into outs[i], on the device threads. 0 or -1. */
static int copy_scatter_outs(dp_state *st, PyArrayObject *src, int dim, PyArrayObject **outs,
                             Py_ssize_t n)
{
    job_list jobs = {0};
    dp_device home = dp_array_device(st, src);
    int64_t offset = 0;
    int r = 0;
    for (Py_ssize_t i = 0; i < n && r == 0; i++) {
        const char *data = PyArray_BYTES(src) + offset * PyArray_STRIDES(src)[dim];
        offset += PyArray_DIM(outs[i], dim);
        r = jobs_add(&jobs, PyArray_NDIM(src), PyArray_SHAPE(outs[i]),
                     (size_t)PyArray_ITEMSIZE(src), PyArray_BYTES(outs[i]),
                     PyArray_STRIDES(outs[i]), data, PyArray_STRIDES(src),
                     exec_device(home, dp_array_device(st, outs[i])));
    }
    if (r == 0) {
        r = jobs_run(&jobs);
    }
    jobs_free(&jobs);
    return r < 0 ? -1 : 0;
}

/* comm.scatter with out=: copy chunk i of src into out[i] in place. */
static PyObject *scatter_into(dp_state *st, PyArrayObject *src, int dim, PyObject *out_obj)
{
    PyObject *result = NULL;
    PyArrayObject **outs = NULL;
    Py_ssize_t n = 0;

    if (refuse_single_out(st, out_obj) < 0) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(out_obj, "out: expected a sequence of arrays");
    if (seq == NULL) {
        return NULL;
    }
    n = PySequence_Fast_GET_SIZE(seq);
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "out: Expected at least one output array to scatter to");
        goto done;
    }
    outs = PyMem_Calloc((size_t)n, sizeof(PyArrayObject *));
    if (outs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (take_scatter_outs(st, seq, n, src, dim, outs) == 0 &&
        copy_scatter_outs(st, src, dim, outs, n) == 0) {
        result = PySequence_Tuple(seq);   /* seq: a list, or the caller's tuple */
    }
done:
    for (Py_ssize_t i = 0; outs != NULL && i < n; i++) {
        Py_XDECREF(outs[i]);
    }
    PyMem_Free(outs);
    Py_DECREF(seq);
    return result;
}

PyDoc_STRVAR(comm_scatter_doc,
"scatter(array, devices=None, chunk_sizes=None, dim=0, streams=None, *, out=None)\n"
"--\n"
"\n"
"Returns a tuple of arrays, chunk i on devices[i] (or out itself).\n"
"Split `array` along `dim` and copy chunk i to devices[i] (torch.cuda.comm.scatter,\n"
"docs/spec.md 8.5). array: ndarray, dpmini.Array, a torch/JAX/CuPy array (any __dlpack__ or\n"
"__cuda_array_interface__ object: the chunks come back in its library, sharing\n"
"dpmini's memory), buffer-protocol object (bytes read as 1-D uint8) or\n"
"__array_interface__ object, ndim >= 1, any non-object dtype, any strides. Without\n"
"chunk_sizes the rule is torch.chunk: split = ceil(n / k) elements per chunk with a\n"
"shorter last one, so there may be fewer chunks than devices; n == 0 gives k empty\n"
"chunks. chunk_sizes: one int per device (elements along dim, >= 0, summing to n).\n"
"A chunk whose device is the array's own device is a view; others are copies (dense\n"
"chunks keep their strides, others are C-contiguous). out: a sequence of preallocated\n"
"arrays to fill instead of devices and chunk_sizes (keyword-only, as in PyTorch). The\n"
"copies run on the device threads with the GIL released and are finished when scatter\n"
"returns, so streams (PyTorch's per-device copy streams) is accepted for the same\n"
"signature and needs no effect: None, or one entry per device (ValueError otherwise).\n"
"Raises ValueError (no devices, bad chunk_sizes naming chunk_sizes[i], out\n"
"mismatches, an out[i] overlapping array, another out[j] or itself), TypeError (not\n"
"an array, object dtype, MaskedArray/matrix, out not a sequence of arrays),\n"
"IndexError (dim out of range).");

/* streams: None, or one entry per device (PyTorch's per-device copy
 * streams; the copies are finished when scatter returns, so they need no
 * effect). 0, or -1 with ValueError. */
static int check_streams(PyObject *streams_obj, PyObject *devices_obj)
{
    if (streams_obj == Py_None || devices_obj == Py_None) {
        return 0;
    }
    Py_ssize_t ns = PySequence_Check(streams_obj) ? PySequence_Size(streams_obj) : -1;
    Py_ssize_t nd = PySequence_Check(devices_obj) ? PySequence_Size(devices_obj) : -1;
    if (ns < 0 || nd < 0 || ns != nd) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "streams: expected None or one stream per device "
                     "(%zd devices), got %.100s", nd, Py_TYPE(streams_obj)->tp_name);
        return -1;
    }
    return 0;
}

/* comm.scatter without out=: arr split along dim into chunk_sizes (or
 * torch.chunk's sizes), chunk i on devices[i]. A tuple of the chunks, or
 * NULL. */
static PyObject *scatter_to_devices(dp_state *st, PyArrayObject *arr, int dim,
                                    PyObject *devices_obj, PyObject *sizes_obj)
{
    PyObject *result = NULL, **chunks = NULL;
    dp_device *devs = NULL;
    Py_ssize_t ndev = 0;
    int64_t *sizes = NULL;
    int nchunks = 0;

    if (devices_obj == Py_None ||
        (PySequence_Check(devices_obj) && !PyUnicode_Check(devices_obj) &&
         PySequence_Size(devices_obj) == 0)) {
        devices_error("devices");
        return NULL;
    }
    if (dp_device_list_from_object(st, devices_obj, "devices", &devs, &ndev) < 0) {
        return NULL;
    }
    sizes = PyMem_Calloc((size_t)ndev, sizeof(int64_t));
    chunks = PyMem_Calloc((size_t)ndev, sizeof(PyObject *));
    if (sizes == NULL || chunks == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (sizes_obj == Py_None) {
        nchunks = dp_chunk_sizes(PyArray_DIM(arr, dim), (int)ndev, sizes);
    } else if (parse_chunk_sizes(sizes_obj, ndev, PyArray_DIM(arr, dim), dim, sizes) == 0) {
        nchunks = (int)ndev;
    } else {
        goto done;
    }
    dp_scatter_item item = {arr, dim, nchunks, sizes, chunks};
    if (dp_scatter_run(st, &item, 1, devs) < 0) {
        goto done;
    }
    result = PyTuple_New(nchunks);
    for (int j = 0; j < nchunks; j++) {
        if (result != NULL) {
            PyTuple_SET_ITEM(result, j, chunks[j]);
        } else {
            Py_DECREF(chunks[j]);
        }
    }
done:
    PyMem_Free(chunks);
    PyMem_Free(sizes);
    PyMem_Free(devs);
    return result;
}

static PyObject *comm_scatter_steps(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"array", "devices", "chunk_sizes", "dim", "streams", "out", NULL};
    PyObject *obj, *devices_obj = Py_None, *sizes_obj = Py_None, *dim_obj = NULL,
             *streams_obj = Py_None, *out_obj = Py_None, *result = NULL;
    dp_state *st = dp_state_from_module(m);
    int dim = 0;

    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|OOOO$O:scatter", kwlist, &obj, &devices_obj,
                                     &sizes_obj, &dim_obj, &streams_obj, &out_obj) ||
        check_streams(streams_obj, devices_obj) < 0 ||
        (dim_obj != NULL && dp_int_from_object(dim_obj, "dim", &dim) < 0)) {
        return NULL;
    }
    PyArrayObject *arr = dp_as_array(st, obj, "array", 1);
    if (arr == NULL) {
        return NULL;
    }
    if (dp_wrap_dim_or_raise(dim, PyArray_NDIM(arr), "dim", &dim) < 0) {
        goto done;
    }
    if (out_obj == Py_None) {
        result = scatter_to_devices(st, arr, dim, devices_obj, sizes_obj);
        result = dp_comm_back(st, obj, 0, result);   /* torch in, torch out */
    } else if (devices_obj != Py_None || sizes_obj != Py_None) {
        PyErr_SetString(PyExc_ValueError,
                        "out: 'devices' and 'chunk_sizes' must not be given with 'out'");
    } else {
        result = scatter_into(st, arr, dim, out_obj);
    }
done:
    Py_XDECREF(arr);
    return result;
}

/* The call (dp_entry_call): one span under dpmini.profile(); a torch tensor
 * that requires grad goes to dpmini._torch.comm_scatter. */
static PyObject *comm_scatter(PyObject *m, PyObject *args, PyObject *kw)
{
    static const dp_entry e = {comm_scatter_steps, DP_PROF_SCATTER,
                                "comm.scatter", "comm_scatter"};
    return dp_entry_call(m, args, kw, &e);
}

/* ------------------------------------------------------------------ */
/* Gather                                                              */
/* ------------------------------------------------------------------ */

/* Parse a gather/reduce destination: None -> *dflt, "cpu"/-1 -> host (-1
 * warns, docs/spec.md 4.3), else a device. */
int parse_destination(dp_state *st, PyObject *obj, const char *argname,
                      dp_device dflt, dp_device *out)
{
    if (obj == NULL || obj == Py_None) {
        *out = dflt;
        return 0;
    }
    if (dp_device_from_object(st, obj, argname, DP_DEV_ALLOW_HOST, out) < 0) {
        return -1;
    }
    if (dp_is_index_like(obj) && out->kind == DP_HOST) {   /* -1, NumPy integers too */
        if (PyErr_WarnEx(PyExc_FutureWarning,
                         "Using -1 to represent CPU tensor is deprecated. Please use a "
                         "device object or string instead, e.g., \"cpu\".", 1) < 0) {
            return -1;
        }
    }
    return 0;
}


PyDoc_STRVAR(comm_gather_doc,
"gather(arrays, dim=0, destination=None, *, out=None)\n"
"--\n"
"\n"
"Returns the gathered ndarray (out itself when given).\n"
"Concatenate arrays along dim onto one device (torch.cuda.comm.gather, docs/spec.md 4.6-4.8).\n"
"arrays: a non-empty sequence of arrays of equal ndim whose sizes agree except along\n"
"dim; dim may be negative (wrapped against arrays[0]). destination: 'cpu' or None\n"
"(the host; -1 also, with a FutureWarning), 'cpu:N' or a CUDA device. The result is a\n"
"fresh C-contiguous array with arrays[0]'s dtype (other dtypes are cast), from\n"
"dpmini's caching allocator. out: an ndarray of the gathered shape, written in place\n"
"and returned (then destination must be None). Copies run on the device threads with\n"
"the GIL released. Arrays of another library (torch, JAX, CuPy) are read without a\n"
"copy and the result comes back in arrays[0]'s library (out=None only).\n"
"Raises ValueError (empty list, shape or rank mismatch, out mismatch, out with\n"
"destination, read-only out, out overlapping arrays[i] or itself), IndexError (dim),\n"
"TypeError (not arrays, object dtype, MaskedArray/matrix).");

static PyObject *comm_gather_steps(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"arrays", "dim", "destination", "out", NULL};
    PyObject *arrays_obj, *dim_obj = NULL, *dest_obj = Py_None, *out_obj = Py_None;
    dp_state *st = dp_state_from_module(m);
    PyArrayObject **parts = NULL;
    Py_ssize_t n = 0;
    int dim = 0;
    dp_device host = {DP_HOST, -1}, dest;
    PyObject *result = NULL;

    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|OO$O:gather", kwlist, &arrays_obj, &dim_obj,
                                     &dest_obj, &out_obj)) {
        return NULL;
    }
    if (dim_obj != NULL && dp_int_from_object(dim_obj, "dim", &dim) < 0) {
        return NULL;
    }
    if (out_obj != Py_None && dest_obj != Py_None) {
        PyErr_SetString(PyExc_ValueError,
                        "out: 'destination' must not be given together with 'out'");
        return NULL;
    }
    if (out_obj != Py_None && check_out_kind(st, out_obj, "out") < 0) {
        return NULL;
    }
    if (parse_destination(st, dest_obj, "destination", host, &dest) < 0) {
        return NULL;
    }
    if (arrays_from_sequence(st, arrays_obj, "arrays", 0, &parts, &n) < 0) {
        return NULL;
    }
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "arrays: Expected at least one array to gather from");
        goto done;
    }
    if (dp_wrap_dim_or_raise(dim, PyArray_NDIM(parts[0]), "dim", &dim) < 0) {
        goto done;
    }
    if (out_obj == Py_None) {
        result = dp_gather_arrays(st, parts, n, dim, dest, NULL, "arrays");
        result = dp_comm_back(st, arrays_obj, 1, result);
    } else {
        PyArrayObject *out_arr = dp_as_array(st, out_obj, "out", 0);
        if (out_arr != NULL) {
            result = dp_gather_arrays(st, parts, n, dim, dest, out_arr, "arrays");
            Py_DECREF(out_arr);
            if (result != NULL) { /* the caller's own object, written in place */
                Py_SETREF(result, Py_NewRef(out_obj));
            }
        }
    }
done:
    arrays_free(parts, n);
    return result;
}

/* The call (dp_entry_call): one span under dpmini.profile(); a torch tensor
 * that requires grad goes to dpmini._torch.comm_gather. */
static PyObject *comm_gather(PyObject *m, PyObject *args, PyObject *kw)
{
    static const dp_entry e = {comm_gather_steps, DP_PROF_GATHER,
                                "comm.gather", "comm_gather"};
    return dp_entry_call(m, args, kw, &e);
}

/* The functions of dpmini.comm (module.c makes the submodule; self is the
 * dpmini._dpmini module). */
PyMethodDef dp_comm_submodule_methods[] = {
    {"scatter", (PyCFunction)(void (*)(void))comm_scatter, METH_VARARGS | METH_KEYWORDS,
     comm_scatter_doc},
    {"gather", (PyCFunction)(void (*)(void))comm_gather, METH_VARARGS | METH_KEYWORDS,
     comm_gather_doc},
    {"broadcast", (PyCFunction)(void (*)(void))comm_broadcast,
     METH_VARARGS | METH_KEYWORDS, comm_broadcast_doc},
    {"broadcast_coalesced", (PyCFunction)(void (*)(void))comm_broadcast_coalesced,
     METH_VARARGS | METH_KEYWORDS, comm_broadcast_coalesced_doc},
    {"reduce_add", (PyCFunction)(void (*)(void))comm_reduce_add,
     METH_VARARGS | METH_KEYWORDS, comm_reduce_add_doc},
    {"reduce_add_coalesced", (PyCFunction)(void (*)(void))comm_reduce_add_coalesced,
     METH_VARARGS | METH_KEYWORDS, comm_reduce_add_coalesced_doc},
    {NULL},
};
