/* interop_dtype.c - the dtypes of other libraries that NumPy has no
 * counterpart for (bfloat16, the float8/float6/float4 kinds, complex32).
 *
 * ml_dtypes (the package of NumPy dtypes that JAX uses) gives NumPy most of
 * them. Its dtypes are registered at run time: their kind is 'V' (or 'f',
 * 'c' for some) and their type number is whatever NumPy handed out, so they
 * are recognised here by their scalar type's module and name, never by kind
 * or number. This file maps them to and from DLPack type codes (kDLBfloat,
 * the float8 codes of DLPack 1.1, kDLComplex 32), says which dtype their
 * sums accumulate in, and names a DLPack dtype that no NumPy dtype (NumPy's
 * own or ml_dtypes') matches, for the TypeError of interop.c's host import
 * (docs/libraries.md, "Dtypes NumPy lacks"). ml_dtypes is imported only when a DLPack
 * dtype needs it; without it those dtypes are refused as before.
 */
#include "dpmini.h"
#include "dlpack.h"
#include "interop.h"

#include <stdio.h>
#include <string.h>

/* ------------------------------------------------------------------ */
/* ml_dtypes                                                           */
/* ------------------------------------------------------------------ */

/* The ml_dtypes dtypes that have a DLPack type code (one element per byte
 * or two; the float6/float4 kinds are one byte each in ml_dtypes but
 * packed in DLPack producers such as JAX, so they have none), and the
 * dtype their sums accumulate in. */
typedef struct {
    const char *name;
    uint8_t code, bits;
    int sum_type;   /* NPY_FLOAT32 or NPY_COMPLEX64 */
} ml_kind;

static const ml_kind ml_kinds[] = {
    {"bfloat16", kDLBfloat, 16, NPY_FLOAT32},
    {"float8_e3m4", kDLFloat8_e3m4, 8, NPY_FLOAT32},
    {"float8_e4m3", kDLFloat8_e4m3, 8, NPY_FLOAT32},
    {"float8_e4m3b11fnuz", kDLFloat8_e4m3b11fnuz, 8, NPY_FLOAT32},
    {"float8_e4m3fn", kDLFloat8_e4m3fn, 8, NPY_FLOAT32},
    {"float8_e4m3fnuz", kDLFloat8_e4m3fnuz, 8, NPY_FLOAT32},
    {"float8_e5m2", kDLFloat8_e5m2, 8, NPY_FLOAT32},
    {"float8_e5m2fnuz", kDLFloat8_e5m2fnuz, 8, NPY_FLOAT32},
    {"float8_e8m0fnu", kDLFloat8_e8m0fnu, 8, NPY_FLOAT32},
    {"complex32", kDLComplex, 32, NPY_COMPLEX64},
};

/* ml_dtypes' floating kinds without a DLPack code: their sums accumulate
 * in float32 too. */
static const char *const ml_floats_only[] = {
    "float8_e5m3fnu", "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn", "bcomplex32",
};

/* The name of d's scalar type when it is one of ml_dtypes' ("bfloat16"),
 * else NULL. The module is the type's __module__ (its C tp_name has none),
 * read from the type's dict: no lookup that could run Python code. */
static const char *ml_name(PyArray_Descr *d)
{
    static const char prefix[] = "ml_dtypes.";
    PyTypeObject *tp = d->typeobj;
    if (tp == NULL || tp->tp_name == NULL)
        return NULL;
    if (strncmp(tp->tp_name, prefix, sizeof prefix - 1) == 0)
        return tp->tp_name + sizeof prefix - 1;
    if (strchr(tp->tp_name, '.') != NULL || tp->tp_dict == NULL)
        return NULL;
    PyObject *mod = PyDict_GetItemString(tp->tp_dict, "__module__");   /* borrowed */
    if (mod == NULL || !PyUnicode_Check(mod) ||
        PyUnicode_CompareWithASCIIString(mod, "ml_dtypes") != 0)
        return NULL;
    return tp->tp_name;
}

static const ml_kind *ml_kind_of(PyArray_Descr *d)
{
    const char *name = ml_name(d);
    for (size_t i = 0; name != NULL && i < sizeof ml_kinds / sizeof ml_kinds[0]; i++) {
        if (strcmp(name, ml_kinds[i].name) == 0 &&
            PyDataType_ELSIZE(d) * 8 == ml_kinds[i].bits)
            return &ml_kinds[i];
    }
    return NULL;
}

int dp_dtype_is_ml(PyArray_Descr *d)
{
    return ml_name(d) != NULL;
}

PyArray_Descr *dp_sum_descr(PyArray_Descr *d)
{
    const char *name = ml_name(d);
    if (name == NULL)
        return NULL;
    const ml_kind *k = ml_kind_of(d);
    if (k != NULL)
        return PyArray_DescrFromType(k->sum_type);
    for (size_t i = 0; i < sizeof ml_floats_only / sizeof ml_floats_only[0]; i++) {
        if (strcmp(name, ml_floats_only[i]) == 0)
            return PyArray_DescrFromType(strcmp(name, "bcomplex32") == 0 ? NPY_COMPLEX64
                                                                        : NPY_FLOAT32);
    }
    return NULL;   /* ml_dtypes' small integers: no sum */
}

/* ml_dtypes' dtype for a DLPack dtype (new reference), or NULL with no
 * exception when there is none or ml_dtypes is not installed (a pending
 * KeyboardInterrupt from the import is kept). */
static PyArray_Descr *ml_descr_from_dl(DLDataType t)
{
    const ml_kind *k = NULL;
    for (size_t i = 0; t.lanes == 1 && i < sizeof ml_kinds / sizeof ml_kinds[0]; i++) {
        if (ml_kinds[i].code == t.code && ml_kinds[i].bits == t.bits)
            k = &ml_kinds[i];
    }
    if (k == NULL)
        return NULL;
    PyObject *mod = PyImport_ImportModule("ml_dtypes");
    PyObject *type = mod != NULL ? PyObject_GetAttrString(mod, k->name) : NULL;
    Py_XDECREF(mod);
    PyArray_Descr *d = NULL;
    if (type != NULL && !PyArray_DescrConverter2(type, &d))
        d = NULL;
    Py_XDECREF(type);
    if (d == NULL && PyErr_Occurred() && PyErr_ExceptionMatches(PyExc_Exception))
        PyErr_Clear();
    if (d != NULL && ml_kind_of(d) != k)
        Py_CLEAR(d);   /* an ml_dtypes whose dtype is not what the table says */
    return d;
}

PyArray_Descr *dp_descr_from_dl(DLDataType t)
{
    int num = -1;
    if (t.lanes != 1)
        return NULL;
    switch (t.code) {
    case kDLInt:
        num = t.bits == 8 ? NPY_INT8 : t.bits == 16 ? NPY_INT16 : t.bits == 32 ? NPY_INT32
            : t.bits == 64 ? NPY_INT64 : -1;
        break;
    case kDLUInt:
        num = t.bits == 8 ? NPY_UINT8 : t.bits == 16 ? NPY_UINT16 : t.bits == 32 ? NPY_UINT32
            : t.bits == 64 ? NPY_UINT64 : -1;
        break;
    case kDLFloat:
        num = t.bits == 16 ? NPY_HALF : t.bits == 32 ? NPY_FLOAT32 : t.bits == 64 ? NPY_FLOAT64
            : -1;
        break;
    case kDLComplex:
        num = t.bits == 64 ? NPY_COMPLEX64 : t.bits == 128 ? NPY_COMPLEX128 : -1;
        break;
    case kDLBool:
        num = t.bits == 8 ? NPY_BOOL : -1;
        break;
    default:
        break;
    }
    return num >= 0 ? PyArray_DescrFromType(num) : ml_descr_from_dl(t);
}

int dp_dl_from_descr(PyArray_Descr *d, DLDataType *t)
{
    t->lanes = 1;
    t->bits = (uint8_t)(PyDataType_ELSIZE(d) * 8);
    if (!PyDataType_ISNOTSWAPPED(d))
        return -1;
    const ml_kind *k = ml_kind_of(d);   /* before the kind: ml_dtypes' 'f' and 'c' */
    if (k != NULL) {
        t->code = k->code;
        return 0;
    }
    if (dp_dtype_is_ml(d))
        return -1;   /* float6/float4, small ints: no DLPack code (see ml_kinds) */
    switch (d->kind) {
    case 'i': t->code = kDLInt; return 0;
    case 'u': t->code = kDLUInt; return 0;
    case 'f': t->code = kDLFloat; return 0;
    case 'c': t->code = kDLComplex; return 0;
    case 'b': t->code = kDLBool; return 0;
    default: return -1;
    }
}

/* ------------------------------------------------------------------ */
/* DLPack dtypes with no NumPy dtype                                   */
/* ------------------------------------------------------------------ */

/* The name of a DLPack dtype NumPy has no counterpart for ("bfloat16",
 * "complex32", "float8_e4m3fn"), or NULL for one NumPy has. */
static const char *missing_in_numpy(DLDataType t, char *buf, size_t n)
{
    static const char *const small_floats[] = {
        "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn",
        "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
        "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn"};   /* in code order */
    int bits = t.bits;
    if (t.lanes != 1) {
        snprintf(buf, n, "a vector dtype (DLPack type code %d, %d bits, %d lanes)", t.code,
                 bits, t.lanes);
        return buf;
    }
    switch (t.code) {
    case kDLInt:
    case kDLUInt:
        if (bits == 8 || bits == 16 || bits == 32 || bits == 64)
            return NULL;
        snprintf(buf, n, "%sint%d", t.code == kDLUInt ? "u" : "", bits);
        return buf;
    case kDLFloat:
        if (bits == 16 || bits == 32 || bits == 64)
            return NULL;
        snprintf(buf, n, "float%d", bits);
        return buf;
    case kDLBfloat:
        snprintf(buf, n, "bfloat%d", bits);
        return buf;
    case kDLComplex:
        if (bits == 64 || bits == 128)
            return NULL;
        snprintf(buf, n, "complex%d", bits);
        return buf;
    case kDLBool:
        if (bits == 8)
            return NULL;
        break;
    default:
        if (t.code >= kDLFloat8_e3m4 && t.code <= kDLFloat4_e2m1fn) {
            snprintf(buf, n, "%s", small_floats[t.code - kDLFloat8_e3m4]);
            return buf;
        }
        break;
    }
    snprintf(buf, n, "DLPack type code %d with %d bits", t.code, bits);
    return buf;
}

/* obj.__dlpack__()'s dtype, read from the capsule without consuming it
 * (the producer's capsule destructor frees an unconsumed tensor): 1 with
 * *out set, 0 when it cannot be read (no exception left). */
static int dlpack_dtype(PyObject *obj, DLDataType *out)
{
    PyObject *cap = PyObject_CallMethod(obj, "__dlpack__", NULL);
    int ok = 0;
    if (cap != NULL && PyCapsule_IsValid(cap, "dltensor_versioned")) {
        DLManagedTensorVersioned *m = PyCapsule_GetPointer(cap, "dltensor_versioned");
        *out = m->dl_tensor.dtype;
        ok = 1;
    }
    else if (cap != NULL && PyCapsule_IsValid(cap, "dltensor")) {
        DLManagedTensor *m = PyCapsule_GetPointer(cap, "dltensor");
        *out = m->dl_tensor.dtype;
        ok = 1;
    }
    Py_XDECREF(cap);
    PyErr_Clear();
    return ok;
}

const char *dp_dlpack_dtype_missing(PyObject *obj, char *buf, size_t n)
{
    DLDataType t;
    return dlpack_dtype(obj, &t) ? missing_in_numpy(t, buf, n) : NULL;
}

const char *dp_byteorder_note(PyArray_Descr *want, PyArray_Descr *got)
{
    static const char note[] =
        " (the same type in the other byte order; x.astype(x.dtype.newbyteorder('=')) "
        "makes it native)";
    if (PyArray_EquivTypes(want, got))
        return "";
    PyArray_Descr *w = PyArray_DescrNewByteorder(want, NPY_NATIVE);
    PyArray_Descr *g = w ? PyArray_DescrNewByteorder(got, NPY_NATIVE) : NULL;
    int same = g != NULL && PyArray_EquivTypes(w, g);
    Py_XDECREF(w);
    Py_XDECREF(g);
    PyErr_Clear();   /* only a note: a failure to build it means "no note" */
    return same ? note : "";
}
