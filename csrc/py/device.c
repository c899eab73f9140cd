/* device.c - the device model: dpmini.Device and device parsing ("cpu",
 * "cpu:N", "cuda:N", ints, Device objects, torch.device objects, lists of
 * them). Host memory and
 * dpmini._Buffer are in host_memory.c; device counts and the module
 * functions in device_module.c.
 *
 * Devices: the host (ordinary process memory, what NumPy uses), virtual CPU
 * devices "cpu:N" (their own allocations, accounted per device, and their
 * own worker thread in pool.c), and CUDA devices (none until the CUDA
 * backend is built; parsing them gives a clear error meanwhile).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1 /* the same spelling as pyconfig.h, which may define it too */
#endif
#include "dpmini.h"
#include "gpu.h"
#include "env.h"
#include "plan.h"
#include "pool.h"

#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

/* ------------------------------------------------------------------ */
/* Parsing                                                             */
/* ------------------------------------------------------------------ */

void dp_device_format(dp_device d, char *buf, size_t size)
{
    if (d.kind == DP_HOST) {
        snprintf(buf, size, "cpu");
    } else {
        snprintf(buf, size, "%s:%d", d.kind == DP_VCPU ? "cpu" : "cuda", d.index);
    }
}

static const char DEVICE_FORMS[] =
    "'cpu' (the host), 'cpu:N' (virtual CPU device, 0 <= N < 256), 'cuda:N', "
    "an int (CUDA device; -1 is the host), a dpmini.Device or a torch.device; strings "
    "exactly as str(Device) prints them (no spaces, signs or leading zeros)";

static int check_cuda_index(long index, const char *argname)
{
    int count = dp_cuda_device_count();
    if (index >= count) {
        char why[512];
        if (count == 0 && dp_cuda_unusable(why, sizeof why)) {
            PyErr_Format(PyExc_ValueError, "%s: CUDA device %ld requested, but CUDA is "
                         "unusable: %s", argname, index, why);
        } else if (count == 0) {
            PyErr_Format(PyExc_ValueError,
                         "%s: CUDA device %ld requested, but dpmini sees no CUDA device "
                         "(built without CUDA, or no GPU or driver); use virtual CPU "
                         "devices such as 'cpu:0', 'cpu:1'", argname, index);
        } else {
            PyErr_Format(PyExc_ValueError,
                         "%s: CUDA device %ld requested, but only %d CUDA device(s) exist "
                         "(valid: 0..%d)", argname, index, count, count - 1);
        }
        return -1;
    }
    return 0;
}

/* UTF-8 text of a device string (NULL with an exception set on failure). A
 * string with an embedded NUL becomes "?", which no device matches, instead
 * of being read up to the NUL ("cpu:1\0junk" was cpu:1; reliability.md, bug 6). */
static const char *device_utf8(PyObject *obj)
{
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(obj, &n);
    if (s == NULL && PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) {
        PyErr_Clear();   /* lone surrogates ('cpu:\ud800'): no device has them */
        return "?";
    }
    return (s != NULL && (size_t)n != strlen(s)) ? "?" : s;
}

/* Parse "cpu", "cpu:N", "cuda", "cuda:N"; -1 when the text is none of them.
 * Only the canonical spelling, the one str(Device) prints: N is written in
 * decimal digits without a sign, spaces or leading zeros ("cpu:00",
 * " cpu:0", "cpu:+1" are refused), so a string names a device exactly when
 * it equals that device's str(), and equal devices hash alike. */
static int parse_device_text(const char *s, dp_device *out)
{
    const char *rest;
    int kind;
    if (strncmp(s, "cpu", 3) == 0) {
        kind = DP_VCPU;
        rest = s + 3;
    } else if (strncmp(s, "cuda", 4) == 0) {
        kind = DP_CUDA;
        rest = s + 4;
    } else {
        return -1;
    }
    if (*rest == '\0') {
        out->kind = kind == DP_VCPU ? DP_HOST : DP_CUDA;
        out->index = kind == DP_VCPU ? -1 : 0;
        return 0;
    }
    if (*rest != ':' || rest[1] < '0' || rest[1] > '9' || (rest[1] == '0' && rest[2] != '\0')) {
        return -1;
    }
    char *end;
    long v = strtol(rest + 1, &end, 10);
    if (*end != '\0' || v < 0 || v >= DP_POOL_MAX_INDEX) {
        return -1;
    }
    out->kind = kind;
    out->index = (int)v;
    return 0;
}

static int device_from_object(dp_state *st, PyObject *obj, const char *argname,
                              int flags, dp_device *out);

/* Is obj a torch.device? Told by its type's name and module ("device" in
 * "torch"), so that dpmini never imports torch. */
static int is_torch_device(PyObject *obj)
{
    PyTypeObject *tp = Py_TYPE(obj);
    if (strcmp(tp->tp_name, "torch.device") == 0)
        return 1;
    if (strcmp(tp->tp_name, "device") != 0 || tp->tp_dict == NULL)
        return 0;
    PyObject *mod = PyDict_GetItemString(tp->tp_dict, "__module__");   /* borrowed */
    return mod != NULL && PyUnicode_Check(mod) &&
           PyUnicode_CompareWithASCIIString(mod, "torch") == 0;
}

/* A torch.device read through its `type` and `index` attributes as the
 * device string it prints: torch.device("cpu") is the host (PyTorch's "cpu"
 * in gather), torch.device("cpu", 1) virtual CPU device cpu:1,
 * torch.device("cuda", 1) cuda:1, torch.device("cuda") cuda:0. Other
 * device types (mps, meta, xpu) are a ValueError naming argname. */
static int torch_device(PyObject *obj, const char *argname, dp_device *out)
{
    PyObject *type = PyObject_GetAttrString(obj, "type");
    PyObject *index = type != NULL ? PyObject_GetAttrString(obj, "index") : NULL;
    int r = -1;
    if (index == NULL)
        goto done;
    long idx = index == Py_None ? -1 : PyLong_AsLong(index);
    if (idx == -1 && PyErr_Occurred())
        goto done;
    const char *t = PyUnicode_Check(type) ? PyUnicode_AsUTF8(type) : NULL;
    char text[64];
    if (t != NULL && strlen(t) < 16 && idx >= -1) {
        if (idx < 0)
            snprintf(text, sizeof text, "%s", t);
        else
            snprintf(text, sizeof text, "%s:%ld", t, idx);
        r = parse_device_text(text, out);
    }
    PyErr_Clear();
    if (r < 0)
        PyErr_Format(PyExc_ValueError, "%s: unsupported torch.device %R: dpmini takes "
                     "torch.device('cpu') (the host), torch.device('cpu', N) (virtual CPU "
                     "device, 0 <= N < 256) and torch.device('cuda', N)", argname, obj);
done:
    Py_XDECREF(type);
    Py_XDECREF(index);
    return r;
}

int dp_device_from_object(dp_state *st, PyObject *obj, const char *argname,
                          int flags, dp_device *out)
{
    if (PyLong_Check(obj) || !dp_is_index_like(obj)) {
        return device_from_object(st, obj, argname, flags, out);
    }
    /* NumPy integers name CUDA devices as ints do (convert.c's rule) */
    PyObject *idx = PyNumber_Index(obj);
    if (idx == NULL) {
        return -1;
    }
    int r = device_from_object(st, idx, argname, flags, out);
    Py_DECREF(idx);
    return r;
}

static int device_from_object(dp_state *st, PyObject *obj, const char *argname,
                              int flags, dp_device *out)
{
    dp_device d;
    if (PyObject_TypeCheck(obj, st->DeviceType)) {
        d = ((dp_DeviceObject *)obj)->dev;
        if (d.kind == DP_CUDA && check_cuda_index(d.index, argname) < 0) {
            return -1;
        }
    } else if (PyLong_Check(obj) && !PyBool_Check(obj)) {
        int overflow;
        long v = PyLong_AsLongAndOverflow(obj, &overflow);
        if (v == -1 && PyErr_Occurred()) {
            return -1;
        }
        if (overflow || v < -1) {
            PyErr_Format(PyExc_ValueError,
                         "%s: expected a non-negative CUDA device index or -1 (the host), got %R",
                         argname, obj);
            return -1;
        }
        d.kind = v == -1 ? DP_HOST : DP_CUDA;
        d.index = (int)(v == -1 ? -1 : (v > INT32_MAX ? INT32_MAX : v));
        if (d.kind == DP_CUDA && check_cuda_index(v, argname) < 0) {
            return -1;
        }
    } else if (is_torch_device(obj)) {
        if (torch_device(obj, argname, &d) < 0) {
            return -1;
        }
        if (d.kind == DP_CUDA && check_cuda_index(d.index, argname) < 0) {
            return -1;
        }
    } else if (PyUnicode_Check(obj)) {
        const char *s = device_utf8(obj);
        if (s == NULL) {
            return -1;
        }
        if (parse_device_text(s, &d) < 0) {
            PyErr_Format(PyExc_ValueError, "%s: unknown device %R; expected %s",
                         argname, obj, DEVICE_FORMS);
            return -1;
        }
        if (d.kind == DP_CUDA && check_cuda_index(d.index, argname) < 0) {
            return -1;
        }
    } else {
        PyErr_Format(PyExc_TypeError, "%s: expected a device (%s), got %.100s",
                     argname, DEVICE_FORMS, Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (d.kind == DP_HOST && !(flags & DP_DEV_ALLOW_HOST)) {
        PyErr_Format(PyExc_ValueError,
                     "%s: expected a non-host device ('cpu:N' or 'cuda:N'), got %R; the "
                     "host ('cpu' or -1) can only be an output_device or destination "
                     "(PyTorch: 'Expected a non cpu device')", argname, obj);
        return -1;
    }
    *out = d;
    return 0;
}

int dp_refuse_bytes_as_devices(PyObject *obj, const char *argname)
{
    if (!PyBytes_Check(obj) && !PyByteArray_Check(obj) && !PyMemoryView_Check(obj)) {
        return 0;
    }
    /* a sequence of ints, which would read as CUDA device numbers */
    PyErr_Format(PyExc_TypeError, "%s: expected a list of devices, got %.100s (device names "
                 "are str, e.g. ['cpu:0', 'cpu:1'])", argname, Py_TYPE(obj)->tp_name);
    return -1;
}

int dp_device_list_from_object(dp_state *st, PyObject *obj, const char *argname,
                               dp_device **out, Py_ssize_t *n)
{
    if (PyUnicode_Check(obj) || PyLong_Check(obj) || PyObject_TypeCheck(obj, st->DeviceType) ||
        is_torch_device(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a list of devices, got a single %.100s",
                     argname, Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (dp_refuse_bytes_as_devices(obj, argname) < 0) {
        return -1;
    }
    PyObject *seq = PySequence_Fast(obj, "");
    if (seq == NULL) {
        PyErr_Format(PyExc_TypeError, "%s: expected a list of devices, got %.100s",
                     argname, Py_TYPE(obj)->tp_name);
        return -1;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    if (count == 0) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "%s: expected at least one device, got an empty list",
                     argname);
        return -1;
    }
    if (count > DP_MAX_DEVICES) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "%s: at most %d devices, got %zd", argname,
                     DP_MAX_DEVICES, count);
        return -1;
    }
    dp_device *devs = PyMem_Malloc(sizeof(dp_device) * (size_t)count);
    if (devs == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        char name[128];
        snprintf(name, sizeof name, "%s[%zd]", argname, i);
        if (dp_device_from_object(st, PySequence_Fast_GET_ITEM(seq, i), name, 0, &devs[i]) < 0) {
            PyMem_Free(devs);
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    *out = devs;
    *n = count;
    return 0;
}

/* ------------------------------------------------------------------ */
/* dpmini.Device                                                       */
/* ------------------------------------------------------------------ */

PyObject *dp_device_to_object(dp_state *st, dp_device d)
{
    dp_DeviceObject *self = PyObject_New(dp_DeviceObject, st->DeviceType);
    if (self != NULL) {
        self->dev = d;
    }
    return (PyObject *)self;
}

static PyObject *device_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"spec", NULL};
    PyObject *spec;
    dp_device d;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:Device", kwlist, &spec)) {
        return NULL;
    }
    dp_state *st = dp_state_from_type(type);
    if (st == NULL) {
        return NULL;
    }
    /* A Device may name a CUDA device that is absent (as torch.device does);
     * using it is what fails. */
    if (PyUnicode_Check(spec)) {
        const char *s = device_utf8(spec);
        if (s == NULL) {
            return NULL;
        }
        if (parse_device_text(s, &d) < 0) {
            PyErr_Format(PyExc_ValueError, "spec: unknown device %R; expected %s", spec,
                         DEVICE_FORMS);
            return NULL;
        }
    } else if (dp_is_index_like(spec)) {   /* ints, NumPy integers (convert.c) */
        long long v;
        if (dp_index_from_object(spec, "spec", LLONG_MIN, LLONG_MAX, &v) < 0) {
            return NULL;
        }
        if (v < -1 || v >= DP_POOL_MAX_INDEX) {
            PyErr_Format(PyExc_ValueError, "spec: device index out of range: %lld", v);
            return NULL;
        }
        d.kind = v == -1 ? DP_HOST : DP_CUDA;
        d.index = (int)v;
    } else if (is_torch_device(spec)) {
        if (torch_device(spec, "spec", &d) < 0) {
            return NULL;
        }
    } else if (dp_device_from_object(st, spec, "spec", DP_DEV_ALLOW_HOST, &d) < 0) {
        return NULL;
    }
    dp_DeviceObject *self = (dp_DeviceObject *)type->tp_alloc(type, 0);
    if (self != NULL) {
        self->dev = d;
    }
    return (PyObject *)self;
}

static void device_dealloc(PyObject *op)
{
    PyTypeObject *tp = Py_TYPE(op);
    tp->tp_free(op);
    Py_DECREF(tp);
}

static PyObject *device_str(PyObject *op)
{
    char name[32];
    dp_device_format(((dp_DeviceObject *)op)->dev, name, sizeof name);
    return PyUnicode_FromString(name);
}

static PyObject *device_repr(PyObject *op)
{
    char name[32];
    dp_device_format(((dp_DeviceObject *)op)->dev, name, sizeof name);
    return PyUnicode_FromFormat("dpmini.Device('%s')", name);
}

/* hash(d) == hash(str(d)), since d == str(d): a dict or set keyed by
 * devices finds them by their spelling too. */
static Py_hash_t device_hash(PyObject *op)
{
    PyObject *s = device_str(op);
    if (s == NULL) {
        return -1;
    }
    Py_hash_t h = PyObject_Hash(s);
    Py_DECREF(s);
    return h;
}

static PyObject *device_richcompare(PyObject *a, PyObject *b, int op)
{
    if (op != Py_EQ && op != Py_NE) {
        Py_RETURN_NOTIMPLEMENTED;
    }
    dp_device da = ((dp_DeviceObject *)a)->dev, db;
    if (Py_TYPE(b) == Py_TYPE(a) || PyObject_TypeCheck(b, Py_TYPE(a))) {
        db = ((dp_DeviceObject *)b)->dev;
    } else if (PyUnicode_Check(b)) {
        /* Only the canonical spelling str(a) is equal, so that equal objects
         * hash equal ("cuda" names cuda:0 but is not == Device('cuda:0')). */
        PyObject *s = device_str(a);
        if (s == NULL) {
            return NULL;
        }
        int eq = PyUnicode_Compare(s, b) == 0;
        Py_DECREF(s);
        if (PyErr_Occurred()) {
            return NULL;
        }
        return PyBool_FromLong(op == Py_EQ ? eq : !eq);
    } else {
        Py_RETURN_NOTIMPLEMENTED;
    }
    int eq = dp_device_eq(da, db);
    return PyBool_FromLong(op == Py_EQ ? eq : !eq);
}

static PyObject *device_get_type(PyObject *op, void *closure)
{
    return PyUnicode_FromString(((dp_DeviceObject *)op)->dev.kind == DP_CUDA ? "cuda" : "cpu");
}

static PyObject *device_get_index(PyObject *op, void *closure)
{
    dp_device d = ((dp_DeviceObject *)op)->dev;
    if (d.kind == DP_HOST) {
        Py_RETURN_NONE;
    }
    return PyLong_FromLong(d.index);
}

static PyObject *device_reduce(PyObject *op, PyObject *unused)
{
    PyObject *s = device_str(op);
    if (s == NULL) {
        return NULL;
    }
    return Py_BuildValue("O(N)", (PyObject *)Py_TYPE(op), s);
}

static PyGetSetDef device_getset[] = {
    {"type", device_get_type, NULL, "'cpu' (host or virtual CPU device) or 'cuda'.", NULL},
    {"index", device_get_index, NULL, "Device index; None for the host.", NULL},
    {NULL},
};

static PyMethodDef device_methods_tbl[] = {
    {"__reduce__", device_reduce, METH_NOARGS,
     "__reduce__()\n--\n\nSupport for copy.copy, copy.deepcopy and pickle: a Device is rebuilt\n"
     "from its canonical spelling, Device(str(self)) ('cpu', 'cpu:1', 'cuda:0'), so a\n"
     "copy compares equal to the original. Unpickling a CUDA device where that GPU does not\n"
     "exist raises ValueError, as Device('cuda:N') does."},
    {NULL},
};

PyDoc_STRVAR(device_doc,
"Device(spec)\n--\n\n"
"A place where arrays live and replicas run.\n\n"
"spec: 'cpu' or -1 (the host: ordinary NumPy memory); 'cpu:N' (virtual CPU\n"
"device N, 0 <= N < 256: its own allocations and its own worker thread);\n"
"'cuda', 'cuda:N' or an int N >= 0 (CUDA device N); a torch.device, read as\n"
"the string it prints (torch.device('cpu') the host, torch.device('cpu', 1)\n"
"'cpu:1', torch.device('cuda', 1) 'cuda:1'; told by its type's name and module,\n"
"torch is never imported). A Device may name a CUDA device that does not\n"
"exist; using it raises ValueError.\n\n"
"Attributes: type ('cpu' or 'cuda'), index (int, None for the host).\n"
"Compares equal to another Device or to its spec string ('cpu:1'), and\n"
"hashes as that string. Strings are accepted only in that canonical\n"
"spelling (plus 'cuda' for cuda:0): 'cpu:00', ' cpu:0', 'cpu:+1' raise\n"
"ValueError, so a string names a device exactly when it equals it. NumPy\n"
"integers are accepted where ints are.\n"
"Raises ValueError for an unknown spec (a torch.device of another type:\n"
"meta, mps), TypeError for a wrong type.\n"
"Rule source: torch.device strings; 'cpu:N' is dpmini's virtual device.");

static PyType_Slot device_slots[] = {
    {Py_tp_new, device_new},
    {Py_tp_dealloc, device_dealloc},
    {Py_tp_str, device_str},
    {Py_tp_repr, device_repr},
    {Py_tp_hash, device_hash},
    {Py_tp_richcompare, device_richcompare},
    {Py_tp_getset, device_getset},
    {Py_tp_methods, device_methods_tbl},
    {Py_tp_doc, (void *)device_doc},
    {0, NULL},
};

PyType_Spec dp_device_spec = {
    .name = "dpmini.Device",
    .basicsize = sizeof(dp_DeviceObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = device_slots,
};
