/* dist_args.c - the scalar arguments of a collective (root, dim, op), read
 * so that a bad one fails the call on every rank, not on this rank alone.
 *
 * Why not PyArg_ParseTuple's "i" and "s": their errors come before the
 * guard (dist_guard.c), so the bad rank raised at once, unnamed ("'str'
 * object cannot be interpreted as an integer"), its call number was not
 * used, and the other ranks waited into a TimeoutError, or worse, paired
 * their next call with this one. Here the first bad argument's exception is
 * kept in *argerr, the call goes on with the default, and the collective
 * raises it at its guard (dist_arg_error), so the others get a ValueError
 * quoting it.
 */
#include "dist.h"

#include <limits.h>
#include <string.h>

static void keep_error(PyObject **argerr)
{
    PyObject *type, *exc, *tb;
    PyErr_Fetch(&type, &exc, &tb);
    PyErr_NormalizeException(&type, &exc, &tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    if (*argerr == NULL)
        *argerr = exc;
    else
        Py_XDECREF(exc);
}

void dist_int_arg(PyObject *obj, const char *name, int *out, PyObject **argerr)
{
    if (obj == NULL)
        return;
    if (PyBool_Check(obj) || !PyIndex_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: expected an int, got %.100s", name,
                     Py_TYPE(obj)->tp_name);
        keep_error(argerr);
        return;
    }
    PyObject *i = PyNumber_Index(obj);
    if (i == NULL) {   /* an __index__ that raised: name the argument */
        PyObject *type, *exc, *tb;
        PyErr_Fetch(&type, &exc, &tb);
        PyErr_NormalizeException(&type, &exc, &tb);
        PyErr_Format(PyExc_TypeError, "%s: expected an int, got %.100s (its __index__ raised "
                     "%.100s: %S)", name, Py_TYPE(obj)->tp_name,
                     exc ? Py_TYPE(exc)->tp_name : "?", exc ? exc : Py_None);
        Py_XDECREF(type);
        Py_XDECREF(exc);
        Py_XDECREF(tb);
        keep_error(argerr);
        return;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(i, &overflow);
    Py_DECREF(i);
    if (!PyErr_Occurred() && (overflow || v < INT_MIN || v > INT_MAX))
        PyErr_Format(PyExc_ValueError, "%s: %R is out of range", name, obj);
    if (PyErr_Occurred()) {
        keep_error(argerr);
        return;
    }
    *out = (int)v;
}

void dist_op_arg(PyObject *obj, const char **out, PyObject **argerr)
{
    if (obj == NULL)
        return;
    Py_ssize_t len = 0;
    const char *s = PyUnicode_Check(obj) ? PyUnicode_AsUTF8AndSize(obj, &len) : NULL;
    if (s == NULL || strlen(s) != (size_t)len) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "op: expected 'sum', 'mean', 'max' or 'min', got %.100s",
                     PyUnicode_Check(obj) ? "a str with a NUL" : Py_TYPE(obj)->tp_name);
        keep_error(argerr);
        return;
    }
    *out = s;   /* borrowed from obj, which the call's arguments keep alive */
}

uint64_t dist_hash(const void *p, size_t n)
{
    const unsigned char *b = p;
    uint64_t h = 14695981039346656037ULL;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 1099511628211ULL;
    return h;
}

/* repr(obj) hashed into *hash and cut to n - 1 bytes into text. */
static int repr_into(PyObject *obj, uint64_t *hash, char *text, size_t n)
{
    PyObject *r = PyObject_Repr(obj);
    Py_ssize_t len = 0;
    const char *t = r ? PyUnicode_AsUTF8AndSize(r, &len) : NULL;
    if (t == NULL) {
        Py_XDECREF(r);
        return -1;
    }
    *hash = dist_hash(t, (size_t)len) | 1;   /* never 0, which means "none" */
    if ((size_t)len < n)
        snprintf(text, n, "%s", t);
    else   /* cut, marked with "..." */
        snprintf(text, n, "%.*s...", (int)(n - 4), t);
    Py_DECREF(r);
    return 0;
}

void dist_guard_kw_read(const dist_guard_kw *k, dist_meta *m, PyObject **argerr)
{
    if (k->error != NULL && k->error != Py_None) {
        if (PyExceptionInstance_Check(k->error)) {   /* first: it came first */
            Py_XSETREF(*argerr, Py_NewRef(k->error));
        } else {
            PyErr_Format(PyExc_TypeError, "error: expected an exception instance or None, "
                         "got %.100s", Py_TYPE(k->error)->tp_name);
            keep_error(argerr);
        }
    }
    if (k->tag != NULL && k->tag != Py_None) {
        if (PyBool_Check(k->tag) || !(PyLong_Check(k->tag) || PyUnicode_Check(k->tag))) {
            PyErr_Format(PyExc_TypeError, "tag: expected an int, a str or None, got %.100s",
                         Py_TYPE(k->tag)->tp_name);
            keep_error(argerr);
            m->has_tag = -1;   /* not compared: this rank's error is raised instead */
        } else if (repr_into(k->tag, &m->tag_hash, m->tag_text, sizeof m->tag_text) < 0) {
            keep_error(argerr);
            m->has_tag = -1;
        } else {
            m->has_tag = 1;
        }
    }
    if (k->context != NULL && k->context != Py_None) {
        Py_ssize_t len = 0;
        const char *t = PyUnicode_Check(k->context)
                        ? PyUnicode_AsUTF8AndSize(k->context, &len) : NULL;
        if (t == NULL) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "context: expected a str or None, got %.100s",
                         Py_TYPE(k->context)->tp_name);
            keep_error(argerr);
        } else {
            m->ctx_hash = dist_hash(t, (size_t)len) | 1;
            snprintf(m->ctx_text, sizeof m->ctx_text, "%s", t);
        }
    }
}

int dist_arg_error(PyObject **argerr)
{
    if (*argerr == NULL)
        return 0;
    PyErr_SetObject((PyObject *)Py_TYPE(*argerr), *argerr);
    Py_CLEAR(*argerr);
    return 1;
}

int dist_refuse_subclass(PyObject *x, const char *name)
{
    static const struct { const char *module, *cls, *fix; } refused[] = {
        {"numpy.ma", "MaskedArray", "its mask would be lost; pass a.filled(fill_value), or "
                                    "np.asarray(a) to drop the mask knowingly"},
        {"numpy", "matrix", "pass np.asarray(m)"},
    };
    if (!PyArray_Check(x) || PyArray_CheckExact(x))
        return 0;
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        PyObject *modname = PyUnicode_FromString(refused[i].module);
        PyObject *mod = modname ? PyImport_GetModule(modname) : NULL;   /* no import */
        Py_XDECREF(modname);
        PyObject *cls = mod ? PyObject_GetAttrString(mod, refused[i].cls) : NULL;
        Py_XDECREF(mod);
        if (cls == NULL) {
            PyErr_Clear();
            continue;
        }
        int is = PyType_Check(cls) && PyType_IsSubtype(Py_TYPE(x), (PyTypeObject *)cls);
        Py_DECREF(cls);
        if (is) {
            PyErr_Format(PyExc_TypeError, "%s: %s.%s is not supported by dpmini.distributed "
                         "(results are plain arrays): %s", name, refused[i].module,
                         refused[i].cls, refused[i].fix);
            return -1;
        }
    }
    return 0;
}
