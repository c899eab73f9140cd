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
    if (jobs_add_array(&jobs, dst, src, exec_device(dp_array_device(st, src), dev)) < 0 ||
        jobs_run(&jobs) < 0) {
        Py_CLEAR(dst);
    }
    jobs_free(&jobs);
    return dst;
}

/* a as an ndarray of the base class (a view when a is a subclass): the sums
 * below then run NumPy's own add, never a subclass's __array_ufunc__ (which
 * may ignore out= or return something that is not an array). New reference. */
static PyObject *base_ndarray(PyObject *a)
{
    if (a == NULL || PyArray_CheckExact(a)) {
        return Py_XNewRef(a);
    }
    return PyArray_View((PyArrayObject *)a, NULL, &PyArray_Type);
}

/* The host sum of parts onto dest: the inputs copied to the host, NumPy
 * adds them in index order into a copy of parts[0], the result copied to
 * dest. */
static PyObject *host_sum(dp_state *st, PyArrayObject **parts, Py_ssize_t n, dp_device dest)
{
    dp_device host = {DP_HOST, -1};
    PyObject *acc = dp_copy_to_device(st, parts[0], host);
    for (Py_ssize_t i = 1; acc != NULL && i < n; i++) {
        PyObject *hp = dp_array_device(st, parts[i]).kind == DP_CUDA
                     ? dp_copy_to_device(st, parts[i], host) : base_ndarray((PyObject *)parts[i]);
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

/* What ncclReduce needs, and whether it can run where the parts are: every
 * part a C-contiguous array on a GPU of its own (distinct), its device and
 * data, and which part is on dest (root; -1: none). */
typedef struct {
    int distinct, root;
    int ids[DP_MAX_DEVICES];
    const void *send[DP_MAX_DEVICES];
} nccl_inputs;

static void find_nccl_inputs(dp_state *st, PyArrayObject **parts, Py_ssize_t n, dp_device dest,
                             nccl_inputs *in)
{
    in->distinct = n <= DP_MAX_DEVICES;
    in->root = -1;
    for (Py_ssize_t i = 0; in->distinct && i < n; i++) {
        dp_device di = dp_array_device(st, parts[i]);
        in->distinct = di.kind == DP_CUDA && PyArray_IS_C_CONTIGUOUS(parts[i]);
        for (Py_ssize_t k = 0; in->distinct && k < i; k++) {
            in->distinct = in->ids[k] != di.index;
        }
        if (in->distinct) {
            in->ids[i] = di.index;
            in->send[i] = PyArray_DATA(parts[i]);
            if (dp_device_eq(di, dest)) {
                in->root = (int)i;
            }
        }
    }
}

/* ncclReduce of in's parts into a new array on dest (numel elements of the
 * kernel's type; d0 the parts' dtype). */
static PyObject *nccl_sum(dp_state *st, PyArrayObject **parts, Py_ssize_t n, dp_device dest,
                          const nccl_inputs *in, int type, int64_t numel)
{
    PyArray_Descr *d0 = PyArray_DESCR(parts[0]);
    Py_INCREF(d0);
    PyArrayObject *out = dp_empty(st, dest, d0, PyArray_NDIM(parts[0]),
                                  PyArray_SHAPE(parts[0]), NULL);
    if (out == NULL) {
        return NULL;
    }
    dpc_status s;
    Py_BEGIN_ALLOW_THREADS
    s = dp_nccl_reduce((int)n, in->ids, in->send, PyArray_DATA(out), numel, type, in->root);
    Py_END_ALLOW_THREADS
    if (s.code != 0) {
        Py_DECREF(out);
        dp_gpu_raise(st, s, "reduce_add (ncclReduce)");
        return NULL;
    }
    return (PyObject *)out;
}

/* The parts copied onto dest (a GPU) and added there by the add kernel in
 * index order. */
static PyObject *kernel_sum(dp_state *st, PyArrayObject **parts, Py_ssize_t n, dp_device dest,
                            int type, int64_t numel)
{
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

/* reduce_add with a GPU among the inputs or as the destination (shapes
 * already checked, n >= 1). NCCL reduce when every input is a contiguous
 * array on a distinct GPU, dest is one of them, NCCL has the dtype (not
 * int16/uint16) and NCCL loads; else the
 * fallback: copies onto dest and the add kernel; dtypes the kernel cannot
 * add (or mixed dtypes) are summed on the host by NumPy and copied. */
static PyObject *gpu_reduce_add(dp_state *st, PyArrayObject **parts, Py_ssize_t n,
                                dp_device dest)
{
    PyArray_Descr *d0 = PyArray_DESCR(parts[0]);
    int scale, type = add_type(d0, &scale), same = 1;
    for (Py_ssize_t i = 1; i < n; i++) {
        same = same && PyArray_EquivTypes(PyArray_DESCR(parts[i]), d0);
    }
    if (dest.kind != DP_CUDA || !same || type == DPC_T_NONE) {
        return host_sum(st, parts, n, dest);
    }
    int64_t numel = (int64_t)PyArray_SIZE(parts[0]) * scale;
    nccl_inputs in;
    find_nccl_inputs(st, parts, n, dest, &in);
    if (in.distinct && in.root >= 0 && n > 1 && dp_nccl_supports(type) &&
        dp_nccl_available()) {
        return nccl_sum(st, parts, n, dest, &in, type, numel);
    }
    return kernel_sum(st, parts, n, dest, type, numel);
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
        PyObject *hp = on_gpu ? dp_copy_to_device(st, parts[i], host)
                              : base_ndarray((PyObject *)parts[i]);
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

/* Sums need a numeric dtype: structured, string and datetime arrays have
 * no addition, nor have ml_dtypes' small integers. 0 with *accd set to the
 * dtype the sums accumulate in when not d0 itself (new reference: float32
 * for ml_dtypes' floats; else NULL), or -1 with TypeError. */
static int check_summable(PyArray_Descr *d0, const char *argname, PyArray_Descr **accd)
{
    char k = d0->kind;
    *accd = NULL;
    if (dp_dtype_is_ml(d0) && (*accd = dp_sum_descr(d0)) == NULL) {
        PyErr_Format(PyExc_TypeError,
                     "%s: arrays of dtype %S cannot be summed (dpmini sums ml_dtypes' "
                     "floating dtypes, in float32; its small integer dtypes have no "
                     "sum): convert them to a NumPy integer dtype first", argname,
                     (PyObject *)d0);
        return -1;
    }
    if (*accd == NULL &&
        (PyDataType_HASFIELDS(d0) || k == 'V' || k == 'S' || k == 'U' || k == 'M')) {
        PyErr_Format(PyExc_TypeError,
                     "%s: arrays of dtype %S cannot be summed (structured, void, string "
                     "and datetime dtypes have no addition); sum numeric fields one by "
                     "one", argname, (PyObject *)d0);
        return -1;
    }
    return 0;
}

/* Every part has parts[0]'s dtype (PyTorch's reduce_add needs one dtype; no
 * silent casting), then its shape. 0, or -1 naming the first that differs. */
static int check_parts_alike(PyArrayObject **parts, Py_ssize_t n, const char *argname)
{
    for (Py_ssize_t i = 1; i < n; i++) {
        if (!PyArray_EquivTypes(PyArray_DESCR(parts[i]), PyArray_DESCR(parts[0]))) {
            PyErr_Format(PyExc_TypeError,
                         "%s[%zd]: expected dtype %S (the dtype of %s[0]), got %S%s; "
                         "convert the arrays to one dtype first", argname, i,
                         (PyObject *)PyArray_DESCR(parts[0]), argname,
                         (PyObject *)PyArray_DESCR(parts[i]),
                         dp_byteorder_note(PyArray_DESCR(parts[0]), PyArray_DESCR(parts[i])));
            return -1;
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
            return -1;
        }
    }
    return 0;
}

/* reduce_add with every input and dest in host memory: the sum starts as a
 * copy of parts[0] on dest; the others are added in index order with
 * NumPy's add (same_kind casting into parts[0]'s dtype). */
static PyObject *host_reduce_add(dp_state *st, PyArrayObject **parts, Py_ssize_t n,
                                 dp_device dest)
{
    job_list jobs = {0};
    PyArray_Descr *descr = PyArray_DESCR(parts[0]);
    Py_INCREF(descr);
    PyObject *acc = (PyObject *)dp_empty(st, dest, descr, PyArray_NDIM(parts[0]),
                                         PyArray_SHAPE(parts[0]), NULL);
    if (acc == NULL) {
        return NULL;
    }
    int r = jobs_add_array(&jobs, (PyArrayObject *)acc, parts[0],
                           exec_device(dp_array_device(st, parts[0]), dest)) < 0 ||
            jobs_run(&jobs) < 0;
    jobs_free(&jobs);
    if (r) {
        Py_DECREF(acc);
        return NULL;
    }
    dp_prof_ctx prof = dp_prof_current();
    uint64_t t_sum = prof.s != NULL ? dp_prof_now() : 0;
    for (Py_ssize_t i = 1; i < n; i++) {
        PyObject *part = base_ndarray((PyObject *)parts[i]);
        PyObject *sum = part != NULL ? PyNumber_InPlaceAdd(acc, part) : NULL;
        Py_XDECREF(part);
        if (sum == NULL) {
            Py_DECREF(acc);
            return NULL;
        }
        Py_DECREF(sum); /* acc itself: both are base-class ndarrays */
    }
    dp_prof_record_since(&prof, DP_PROF_SUM, dest.kind, dest.index, t_sum, NULL);
    return acc;
}

/* The sum of parts (checked alike) onto dest, by where they are. */
static PyObject *reduce_parts(dp_state *st, PyArrayObject **parts, Py_ssize_t n,
                              dp_device dest, PyArray_Descr *accd)
{
    if (n == 1 && dp_device_eq(dp_array_device(st, parts[0]), dest)) {
        Py_XDECREF(accd);
        /* a single input is returned as is (docs/spec.md 8.3) */
        return Py_NewRef((PyObject *)parts[0]);
    }
    if (accd != NULL) {
        return widened_sum(st, parts, n, dest, accd);
    }
    int on_gpu = dest.kind == DP_CUDA;
    for (Py_ssize_t i = 0; i < n; i++) {
        on_gpu = on_gpu || dp_array_device(st, parts[i]).kind == DP_CUDA;
    }
    return on_gpu ? gpu_reduce_add(st, parts, n, dest) : host_reduce_add(st, parts, n, dest);
}

PyObject *dp_reduce_add(dp_state *st, PyObject *arrays, dp_device dest, const char *argname)
{
    PyArrayObject **parts = NULL;
    Py_ssize_t n = 0;
    PyObject *acc = NULL;
    PyArray_Descr *accd = NULL;   /* the dtype sums accumulate in, when not their own */

    if (arrays_from_sequence(st, arrays, argname, 0, &parts, &n) < 0) {
        return NULL;
    }
    if (n == 0) {
        PyErr_Format(PyExc_ValueError, "%s: expected at least one array to reduce", argname);
    } else if (check_summable(PyArray_DESCR(parts[0]), argname, &accd) == 0) {
        if (check_parts_alike(parts, n, argname) == 0) {
            acc = reduce_parts(st, parts, n, dest, accd);   /* takes accd */
        } else {
            Py_XDECREF(accd);
        }
    }
    arrays_free(parts, n);
    return dp_export(st, acc);
}
