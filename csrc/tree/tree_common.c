/* tree_common.c - paths in messages, for every tree walker (scatter.c,
 * gather.c, explain.c): the path_seg chain and its text,
 * the nesting bound, and the helpers that raise or build messages naming a
 * path.
 *
 * Paths in messages are built lazily from a chain of path_seg structs on the
 * C stack, so only array leaves (and errors) pay for formatting them.
 *
 * The walkers' other shared parts: tree_containers.c (container tests and
 * snapshots), tree_dims.c (in_dims / out_dims), tree_args.c (the arguments
 * of the Python functions); all declared in tree.h.
 */
#include "dpmini.h"
#include "tree.h"
#include "walk.h"
#include "plan.h"

#include <math.h>
#include <stdarg.h>

/* ------------------------------------------------------------------ */
/* Paths and helpers                                                   */
/* ------------------------------------------------------------------ */

path_seg seg_root(const char *root)
{
    path_seg s = {NULL, SEG_ROOT, root, 0, NULL, 0};
    return s;
}

path_seg seg_child(const path_seg *up, seg_kind kind, Py_ssize_t index,
                   PyObject *name)
{
    path_seg s = {up, kind, NULL, index, name, up->depth + 1};
    return s;
}

/* Paths longer than PATH_LONG steps show their first PATH_HEAD steps. */
#define PATH_LONG 40
#define PATH_HEAD 32

/* repr of a dict key for a path. str and int keys (the usual ones) go
 * through their own tp_repr, which needs no recursion guard, so a path can
 * be written even at the recursion limit; other keys through repr(), and
 * when that fails, their type name. */
PyObject *path_key_repr(PyObject *key)
{
    if (PyUnicode_CheckExact(key) || PyLong_CheckExact(key))
        return Py_TYPE(key)->tp_repr(key);
    PyObject *r = PyObject_Repr(key);
    if (r == NULL && PyErr_ExceptionMatches(PyExc_Exception)) {
        /* A failing repr (or RecursionError at the limit) does not hide
         * the error being reported; KeyboardInterrupt and the like pass. */
        PyErr_Clear();
        r = PyUnicode_FromFormat("<%.100s key>", Py_TYPE(key)->tp_name);
    }
    return r;
}

/* One step of a path as a new str: "[3]", "['img']" or ".logits". */
static PyObject *seg_text(const path_seg *seg)
{
    switch (seg->kind) {
    case SEG_ROOT:
        return PyUnicode_FromString(seg->root);
    case SEG_INDEX:
        return PyUnicode_FromFormat("[%zd]", seg->index);
    case SEG_KEY: {
        PyObject *k = path_key_repr(seg->name);
        if (k == NULL)
            return NULL;
        PyObject *r = PyUnicode_FromFormat("[%U]", k);
        Py_DECREF(k);
        return r;
    }
    default: /* SEG_ATTR */
        return PyUnicode_Check(seg->name) ? PyUnicode_FromFormat(".%U", seg->name)
                                          : PyUnicode_FromFormat(".%S", seg->name);
    }
}

/* The path as a new str, built without recursion (paths can be
 * DP_MAX_NESTING steps long). */
/* Append the text of one step to buf[*len..cap) when it is plain ASCII that
 * needs no repr machinery: the root, an index, a str key or attribute name
 * of printable ASCII without quotes or backslashes (its repr is then the
 * text in single quotes). Returns 0, or -1 when the step is anything else
 * or does not fit (the caller then takes the general route). */
static int seg_text_ascii(const path_seg *seg, char *buf, size_t *len, size_t cap)
{
    size_t at = *len;
    if (seg->kind == SEG_ROOT) {
        size_t k = strlen(seg->root);
        if (k >= cap - at)
            return -1;
        memcpy(buf + at, seg->root, k);
        *len = at + k;
        return 0;
    }
    if (seg->kind == SEG_INDEX) {
        /* "[%zd]" by hand: printf costs more than the rest of the path */
        char digits[24];
        int k = 0;
        Py_ssize_t v = seg->index;
        if (v < 0)
            return -1;   /* never: an index into a tuple or list */
        do {
            digits[k++] = (char)('0' + v % 10);
            v /= 10;
        } while (v > 0);
        if ((size_t)k + 2 >= cap - at)
            return -1;
        buf[at++] = '[';
        while (k > 0)
            buf[at++] = digits[--k];
        buf[at++] = ']';
        *len = at;
        return 0;
    }
    if (!PyUnicode_CheckExact(seg->name) || !PyUnicode_IS_ASCII(seg->name))
        return -1;
    Py_ssize_t k = PyUnicode_GET_LENGTH(seg->name);
    const char *t = (const char *)PyUnicode_DATA(seg->name);
    size_t need = (size_t)k + (seg->kind == SEG_KEY ? 4 : 1);
    if (need >= cap - at)
        return -1;
    for (Py_ssize_t i = 0; i < k; i++)
        if (t[i] < 0x20 || t[i] > 0x7e || t[i] == '\'' || t[i] == '\\')
            return -1;
    if (seg->kind == SEG_KEY) {
        buf[at++] = '[';
        buf[at++] = '\'';
        memcpy(buf + at, t, (size_t)k);
        at += (size_t)k;
        buf[at++] = '\'';
        buf[at++] = ']';
    } else {
        buf[at++] = '.';
        memcpy(buf + at, t, (size_t)k);
        at += (size_t)k;
    }
    *len = at;
    return 0;
}

/* The path in one pass into a stack buffer, for the usual paths (a few
 * ASCII steps; scatter and gather name every leaf this way); NULL with no
 * exception when the path needs the general route. */
static PyObject *path_str_ascii(const path_seg *seg)
{
    const path_seg *chain[16];
    char buf[512];
    size_t len = 0;
    int n = 0;
    for (const path_seg *s = seg; s != NULL; s = s->up) {
        if (n == (int)(sizeof chain / sizeof chain[0]))
            return NULL;
        chain[n++] = s;
    }
    for (int i = n - 1; i >= 0; i--)
        if (seg_text_ascii(chain[i], buf, &len, sizeof buf) < 0)
            return NULL;
    return PyUnicode_FromStringAndSize(buf, (Py_ssize_t)len);
}

const char *path_text(const path_seg *seg, char *buf, size_t cap, PyObject **owned)
{
    *owned = NULL;
    if (seg->depth < PATH_LONG) {
        const path_seg *chain[16];
        size_t len = 0;
        int n = 0, ok = 1;
        for (const path_seg *s = seg; s != NULL && ok; s = s->up) {
            ok = n < (int)(sizeof chain / sizeof chain[0]);
            if (ok)
                chain[n++] = s;
        }
        for (int i = n - 1; ok && i >= 0; i--)
            ok = seg_text_ascii(chain[i], buf, &len, cap) == 0;
        if (ok && len < cap) {
            buf[len] = '\0';
            return buf;
        }
    }
    *owned = path_str(seg);
    return *owned != NULL ? PyUnicode_AsUTF8(*owned) : NULL;
}

PyObject *path_str(const path_seg *seg)
{
    if (seg->depth < PATH_LONG) {
        PyObject *fast = path_str_ascii(seg);
        if (fast != NULL || PyErr_Occurred())
            return fast;
    }
    Py_ssize_t n = (Py_ssize_t)seg->depth + 1, shown = n > PATH_LONG ? PATH_HEAD : n;
    const path_seg **chain = PyMem_Malloc((size_t)n * sizeof *chain);
    PyObject *parts = NULL, *res = NULL;
    if (chain == NULL)
        return PyErr_NoMemory();
    Py_ssize_t i = n;
    for (const path_seg *s = seg; s != NULL && i > 0; s = s->up)
        chain[--i] = s;
    parts = PyList_New(0);
    if (parts == NULL)
        goto done;
    for (i = 0; i < shown; i++)
        if (append_steal(parts, seg_text(chain[i])) < 0)
            goto done;
    if (shown < n &&
        append_steal(parts, PyUnicode_FromFormat("...(%zd more levels)", n - shown)) < 0)
        goto done;
    res = join_str("", parts);
done:
    Py_XDECREF(parts);
    PyMem_Free(chain);
    return res;
}

int check_depth(const path_seg *seg, const char *what)
{
    if (seg->depth <= DP_MAX_NESTING)
        return 0;
    PyObject *path = path_str(seg);
    if (path != NULL)
        PyErr_Format(PyExc_RecursionError,
                     "%U: %s nested deeper than %d levels (dpmini walks at most %d "
                     "levels of tuples, lists, dicts and other containers; is a "
                     "container inside itself?)", path, what, DP_MAX_NESTING,
                     DP_MAX_NESTING);
    Py_XDECREF(path);
    return -1;
}

/* Take the pending exception (normalized instance, new reference; NULL when
 * none is set) and clear it. */
PyObject *take_exception(void)
{
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (type == NULL)
        return NULL;
    PyErr_NormalizeException(&type, &value, &tb);
    if (value != NULL && tb != NULL)
        PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
#endif
}

/* Turn the pending exception of a failed constructor call into a TypeError
 * "<path>: cannot rebuild <type> as <how> (<Error>: <message>)<hint>",
 * chained to the original. */
void raise_rebuild_error(const path_seg *seg, PyTypeObject *tp,
                         const char *how, const char *hint)
{
    PyObject *cause = take_exception();
    PyObject *path = path_str(seg);
    if (path != NULL) {
        if (cause != NULL)
            PyErr_Format(PyExc_TypeError,
                         "%U: cannot rebuild %s as %s for each replica (%s: %S)%s",
                         path, tp->tp_name, how, Py_TYPE(cause)->tp_name, cause,
                         hint);
        else
            PyErr_Format(PyExc_TypeError,
                         "%U: cannot rebuild %s as %s for each replica%s",
                         path, tp->tp_name, how, hint);
        Py_DECREF(path);
    }
    dp_attach_cause(cause);
}

/* sep.join(list); the list holds str. */
PyObject *join_str(const char *sep, PyObject *list)
{
    PyObject *s = PyUnicode_FromString(sep);
    if (s == NULL)
        return NULL;
    PyObject *res = PyUnicode_Join(s, list);
    Py_DECREF(s);
    return res;
}

/* Append a new str to list, stealing it (NULL: an error is already set). */
int append_steal(PyObject *list, PyObject *item)
{
    if (item == NULL)
        return -1;
    int r = PyList_Append(list, item);
    Py_DECREF(item);
    return r;
}

/* "(5, 3)" for an array's shape. */
PyObject *shape_repr(PyArrayObject *a)
{
    PyObject *t = PyArray_IntTupleFromIntp(PyArray_NDIM(a), PyArray_DIMS(a));
    if (t == NULL)
        return NULL;
    PyObject *r = PyObject_Repr(t);
    Py_DECREF(t);
    return r;
}

/* Is the pending exception a caller mistake that _plan reports as text? */
int is_caller_error(void)
{
    return PyErr_ExceptionMatches(PyExc_ValueError) ||
           PyErr_ExceptionMatches(PyExc_IndexError) ||
           PyErr_ExceptionMatches(PyExc_TypeError) ||
           PyErr_ExceptionMatches(PyExc_BufferError);
}

/* Raise exc with "<path of seg>: <fmt...>" (the path is usually that of an
 * in_dims / out_dims entry). Always returns -1. */
int raise_at(PyObject *exc, const path_seg *seg, const char *fmt, ...)
{
    va_list va;
    va_start(va, fmt);
    PyObject *msg = PyUnicode_FromFormatV(fmt, va);
    va_end(va);
    PyObject *path = msg != NULL ? path_str(seg) : NULL;
    if (path != NULL)
        PyErr_Format(exc, "%U: %U", path, msg);
    Py_XDECREF(path);
    Py_XDECREF(msg);
    return -1;
}
