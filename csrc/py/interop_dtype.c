/* interop_dtype.c - the dtypes of other libraries that NumPy has no
 * counterpart for (bfloat16, the float8/float6/float4 kinds, complex32):
 * named from the object's DLPack export, for the TypeError of interop.c's
 * host import (README, "Dtypes NumPy lacks").
 */
#include "dpmini.h"
#include "dlpack.h"

#include <stdio.h>

/* The name of a DLPack dtype NumPy has no counterpart for ("bfloat16",
 * "complex32", "float8_e4m3fn"), or NULL for one NumPy has. */
static const char *missing_in_numpy(DLDataType t, char *buf, size_t n)
{
    static const char *const small_floats[] = {
        "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn",
        "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
        "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn"};   /* codes 7..17 */
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
        if (t.code >= 7 && t.code <= 17) {
            snprintf(buf, n, "%s", small_floats[t.code - 7]);
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
