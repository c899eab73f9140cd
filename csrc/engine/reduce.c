/* reduce.c - reduce_add: the elementwise sum of arrays from several devices
 * onto one (docs/spec.md 8; dp_reduce_add), through NCCL or the GPU add kernel when
 * the arrays are on GPUs, else on the host. Used by dpmini.comm.reduce_add
 * and reduce_add_coalesced (comm_broadcast.c) and out_dims="sum". The small
 * floats of ml_dtypes (bfloat16, float8, ...) are summed on the host in
 * float32 (complex32 in complex64) and rounded to their dtype once.
 */
#include "dpmini.h"
#include "engine.h"
#include "gpu.h"
#include "copy_engine.h"
#include "plan.h"

/* ------------------------------------------------------------------ */
/* Reduce                                                              */
/* ------------------------------------------------------------------ */

/* The reduce kernel's element type for a dtype (complex as pairs of floats:
 * *scale 2); DPC_T_NONE when the kernel cannot add it (bool, ...). */
static int add_type(PyArray_Descr *d, int *scale)
{
    *scale = 1;
    if (!PyDataType_ISNOTSWAPPED(d)) {
        return DPC_T_NONE;
    }
    switch (d->type_num) {
    case NPY_INT8: return DPC_T_I8;
    case NPY_UINT8: return DPC_T_U8;
    case NPY_INT16: return DPC_T_I16;
    case NPY_UINT16: return DPC_T_U16;
    case NPY_INT32: return DPC_T_I32;
    case NPY_UINT32: return DPC_T_U32;
    case NPY_INT64: case NPY_LONGLONG: return PyDataType_ELSIZE(d) == 8 ? DPC_T_I64 : DPC_T_NONE;
    case NPY_UINT64: case NPY_ULONGLONG: return PyDataType_ELSIZE(d) == 8 ? DPC_T_U64 : DPC_T_NONE;
    case NPY_FLOAT32: return DPC_T_F32;
    case NPY_FLOAT64: return DPC_T_F64;
    case NPY_HALF: return DPC_T_F16;
    case NPY_COMPLEX64: *scale = 2; return DPC_T_F32;
    case NPY_COMPLEX128: *scale = 2; return DPC_T_F64;
    default: return DPC_T_NONE;
    }
}

/* A C-contiguous copy of src on dev, synchronously (new shadow/ndarray). */
static PyArrayObject *dense_copy(dp_state *st, PyArrayObject *src, dp_device dev)
{
    job_list jobs = {0};
    PyArray_Descr *descr = PyArray_DESCR(src);
    Py_INCREF(descr);
    PyArrayObject *dst = dp_empty(st, dev, descr, PyArray_NDIM(src), PyArray_SHAPE(src), NULL);
    if (dst == NULL) {
        return NULL;
    }
    if (jobs_add(&jobs, PyArray_NDIM(src), PyArray_SHAPE(src), (size_t)PyArray_ITEMSIZE(src),
                 PyArray_BYTES(dst), PyArray_STRIDES(dst), PyArray_BYTES(src),
                 PyArray_STRIDES(src), exec_device(dp_array_device(st, src), dev)) < 0 ||
        jobs_run(&jobs) < 0) {
        Py_CLEAR(dst);
    }
    jobs_free(&jobs);
    return dst;
}

/* reduce_add with a GPU among the inputs or as the destination (shapes
 * already checked, n >= 1). NCCL reduce when every input is a contiguous
 * array on a distinct GPU, dest is one of them, NCCL has the dtype (not
 * int16/uint16) and NCCL loads; else the
 * fallback: copies onto dest and the add kernel; dtypes the kernel cannot
 * add (or mixed dtypes) are summed on the host by NumPy and copied. */
static PyObject *gpu_reduce_add(dp_state *st, PyArrayObject **parts, Py_ssize_t n,
                                dp_device dest)
{
    dp_device host = {DP_HOST, -1};
    PyArray_Descr *d0 = PyArray_DESCR(parts[0]);
    int scale, type = add_type(d0, &scale), same = 1, distinct = 1, root = -1;
    int ids[DP_MAX_DEVICES];
    const void *send[DP_MAX_DEVICES];
    for (Py_ssize_t i = 0; i < n; i++) {
        dp_device di = dp_array_device(st, parts[i]);
        same = same && PyArray_EquivTypes(PyArray_DESCR(parts[i]), d0);
        distinct = distinct && di.kind == DP_CUDA && PyArray_IS_C_CONTIGUOUS(parts[i]) &&
                   n <= DP_MAX_DEVICES;
        for (Py_ssize_t k = 0; distinct && k < i; k++) {
            distinct = ids[k] != di.index;
        }
        if (distinct) {
            ids[i] = di.index;
            send[i] = PyArray_DATA(parts[i]);
            if (dp_device_eq(di, dest)) {
                root = (int)i;
            }
        }
    }
    if (dest.kind != DP_CUDA || !same || type == DPC_T_NONE) {
        /* host sum: inputs copied to the host, NumPy adds, result to dest */
        PyObject *acc = dp_copy_to_device(st, parts[0], host);
        for (Py_ssize_t i = 1; acc != NULL && i < n; i++) {
            PyObject *hp = dp_array_device(st, parts[i]).kind == DP_CUDA
                         ? dp_copy_to_device(st, parts[i], host) : Py_NewRef(parts[i]);
            PyObject *sum = hp ? PyNumber_InPlaceAdd(acc, hp) : NULL;
            Py_XDECREF(hp);
            if (sum == NULL) {
                Py_CLEAR(acc);
                break;
            }
            Py_DECREF(sum);
        }
        if (acc == NULL || dest.kind == DP_HOST) {
            return acc;
        }
        PyObject *r = dp_copy_to_device(st, (PyArrayObject *)acc, dest);
        Py_DECREF(acc);
        return r;
    }
    int64_t numel = (int64_t)PyArray_SIZE(parts[0]) * scale;
    if (distinct && root >= 0 && n > 1 && dp_nccl_supports(type) && dp_nccl_available()) {
        Py_INCREF(d0);
        PyArrayObject *out = dp_empty(st, dest, d0, PyArray_NDIM(parts[0]),
                                      PyArray_SHAPE(parts[0]), NULL);
        if (out == NULL) {
            return NULL;
        }
        dpc_status s;
        Py_BEGIN_ALLOW_THREADS
        s = dp_nccl_reduce((int)n, ids, send, PyArray_DATA(out), numel, type, root);
        Py_END_ALLOW_THREADS
        if (s.code != 0) {
            Py_DECREF(out);
            dp_gpu_raise(st, s, "reduce_add (ncclReduce)");
            return NULL;
        }
        return (PyObject *)out;
    }
    PyArrayObject *acc = dense_copy(st, parts[0], dest);
    for (Py_ssize_t i = 1; acc != NULL && i < n; i++) {
        PyArrayObject *x = dense_copy(st, parts[i], dest);
        if (x == NULL) {
            Py_CLEAR(acc);
            break;
        }
        dpc_status s;
        Py_BEGIN_ALLOW_THREADS
        s = dp_gpu_add(dest.index, type, PyArray_DATA(acc), PyArray_DATA(x), numel);
        Py_END_ALLOW_THREADS
        Py_DECREF(x);
        if (s.code != 0) {
            Py_CLEAR(acc);
            dp_gpu_raise(st, s, "reduce_add (add kernel)");
        }
    }
    return (PyObject *)acc;
}

/* The sum of parts (one ml_dtypes dtype, same shapes) accumulated in accd
 * (stolen; float32 for bfloat16 and float8) on the host, in index order,
 * rounded to the parts' dtype once, then copied to dest. */
static PyObject *widened_sum(dp_state *st, PyArrayObject **parts, Py_ssize_t n,
                             dp_device dest, PyArray_Descr *accd)
{
    dp_device host = {DP_HOST, -1};
    PyObject *acc = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        int on_gpu = dp_array_device(st, parts[i]).kind == DP_CUDA;
        PyObject *hp = on_gpu ? dp_copy_to_device(st, parts[i], host) : Py_NewRef(parts[i]);
        Py_INCREF(accd);
        PyObject *wide = hp != NULL ? PyArray_CastToType((PyArrayObject *)hp, accd, 0) : NULL;
        if (hp == NULL)
            Py_DECREF(accd);
        Py_XDECREF(hp);
        PyObject *sum = wide == NULL ? NULL : acc == NULL ? Py_NewRef(wide)
                      : PyNumber_InPlaceAdd(acc, wide);
        Py_XDECREF(wide);
        Py_XDECREF(acc);
        if ((acc = sum) == NULL)
            break;
    }
    Py_DECREF(accd);
    if (acc == NULL)
        return NULL;
    PyArray_Descr *d0 = PyArray_DESCR(parts[0]);
    Py_INCREF(d0);
    PyObject *res = PyArray_CastToType((PyArrayObject *)acc, d0, 0);
    Py_DECREF(acc);
    if (res == NULL || dest.kind == DP_HOST)
        return res;
    PyObject *r = dp_copy_to_device(st, (PyArrayObject *)res, dest);
    Py_DECREF(res);
    return r;
}

PyObject *dp_reduce_add(dp_state *st, PyObject *arrays, dp_device dest, const char *argname)
{
    PyArrayObject **parts = NULL;
    Py_ssize_t n = 0;
    PyObject *acc = NULL;
    PyArray_Descr *accd = NULL;   /* the dtype sums accumulate in, when not their own */
    job_list jobs = {0};

    if (arrays_from_sequence(st, arrays, argname, 0, &parts, &n) < 0) {
        return NULL;
    }
    if (n == 0) {
        PyErr_Format(PyExc_ValueError, "%s: expected at least one array to reduce", argname);
        goto done;
    }
    {
        /* Sums need a numeric dtype: structured, string and datetime arrays
         * have no addition. */
        PyArray_Descr *d0 = PyArray_DESCR(parts[0]);
        char k = d0->kind;
        if (dp_dtype_is_ml(d0) && (accd = dp_sum_descr(d0)) == NULL) {
            PyErr_Format(PyExc_TypeError,
                         "%s: arrays of dtype %S cannot be summed (dpmini sums ml_dtypes' "
                         "floating dtypes, in float32; its small integer dtypes have no "
                         "sum): convert them to a NumPy integer dtype first", argname,
                         (PyObject *)d0);
            goto done;
        }
        if (accd == NULL &&
            (PyDataType_HASFIELDS(d0) || k == 'V' || k == 'S' || k == 'U' || k == 'M')) {
            PyErr_Format(PyExc_TypeError,
                         "%s: arrays of dtype %S cannot be summed (structured, void, string "
                         "and datetime dtypes have no addition); sum numeric fields one by "
                         "one", argname, (PyObject *)d0);
            goto done;
        }
    }
    for (Py_ssize_t i = 1; i < n; i++) {
        if (!PyArray_EquivTypes(PyArray_DESCR(parts[i]), PyArray_DESCR(parts[0]))) {
            /* PyTorch's reduce_add needs one dtype; no silent casting. */
            PyErr_Format(PyExc_TypeError,
                         "%s[%zd]: expected dtype %S (the dtype of %s[0]), got %S%s; "
                         "convert the arrays to one dtype first", argname, i,
                         (PyObject *)PyArray_DESCR(parts[0]), argname,
                         (PyObject *)PyArray_DESCR(parts[i]),
                         dp_byteorder_note(PyArray_DESCR(parts[0]), PyArray_DESCR(parts[i])));
            goto done;
        }
    }
    for (Py_ssize_t i = 1; i < n; i++) {
        if (!PyArray_SAMESHAPE(parts[i], parts[0])) {
            PyObject *got = shape_str(PyArray_NDIM(parts[i]), PyArray_SHAPE(parts[i]));
            PyObject *exp = got ? shape_str(PyArray_NDIM(parts[0]), PyArray_SHAPE(parts[0]))
                                : NULL;
            if (exp != NULL) {
                PyErr_Format(PyExc_ValueError,
                             "%s: input %zd has invalid size: got %U, but expected %U",
                             argname, i, got, exp);
            }
            Py_XDECREF(got);
            Py_XDECREF(exp);
            goto done;
        }
    }
    if (n == 1 && dp_device_eq(dp_array_device(st, parts[0]), dest)) {
        Py_INCREF(parts[0]);
        acc = (PyObject *)parts[0]; /* a single input is returned as is (docs/spec.md 8.3) */
        goto done;
    }
    if (accd != NULL) {
        acc = widened_sum(st, parts, n, dest, accd);
        accd = NULL;   /* stolen */
        goto done;
    }
    int on_gpu = dest.kind == DP_CUDA;
    for (Py_ssize_t i = 0; i < n; i++) {
        on_gpu = on_gpu || dp_array_device(st, parts[i]).kind == DP_CUDA;
    }
    if (on_gpu) {
        acc = gpu_reduce_add(st, parts, n, dest);
        goto done;
    }
    /* The sum starts as a copy of arrays[0] on dest; the others are added in
     * index order with NumPy's add (same_kind casting into arrays[0]'s dtype). */
    PyArray_Descr *descr = PyArray_DESCR(parts[0]);
    Py_INCREF(descr);
    acc = (PyObject *)dp_empty(st, dest, descr, PyArray_NDIM(parts[0]),
                               PyArray_SHAPE(parts[0]), NULL);
    if (acc == NULL) {
        goto done;
    }
    if (jobs_add(&jobs, PyArray_NDIM(parts[0]), PyArray_SHAPE(parts[0]),
                 (size_t)PyArray_ITEMSIZE(parts[0]), PyArray_BYTES((PyArrayObject *)acc),
                 PyArray_STRIDES((PyArrayObject *)acc), PyArray_BYTES(parts[0]),
                 PyArray_STRIDES(parts[0]), exec_device(dp_array_device(st, parts[0]), dest)) < 0 ||
        jobs_run(&jobs) < 0) {
        Py_CLEAR(acc);
        goto done;
    }
    dp_prof_ctx prof = dp_prof_current();
    uint64_t t_sum = prof.s != NULL ? dp_prof_now() : 0;
    for (Py_ssize_t i = 1; i < n; i++) {
        PyObject *sum = PyNumber_InPlaceAdd(acc, (PyObject *)parts[i]);
        if (sum == NULL) {
            Py_CLEAR(acc);
            goto done;
        }
        Py_DECREF(sum); /* the same object as acc */
    }
    dp_prof_record_since(&prof, DP_PROF_SUM, dest.kind, dest.index, t_sum, NULL);
done:
    Py_XDECREF(accd);
    jobs_free(&jobs);
    arrays_free(parts, n);
    return dp_export(st, acc);
}
