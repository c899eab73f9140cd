/* tree_common.c - helpers shared by the tree walkers (scatter_walk.c,
 * scatter_tree.c, gather_tree.c, explain.c): paths for messages, container
 * predicates, in_dims / out_dims spec helpers, and the argument parsing of
 * the Python functions (dim, inputs, in_dims / out_dims, chunk_sizes /
 * weights).
 *
 * Paths in messages are built lazily from a chain of path_seg structs on the
 * C stack, so only array leaves (and errors) pay for formatting them.
 *
 * Sections: paths and helpers; arguments.
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
        int k = PyOS_snprintf(buf + at, cap - at, "[%zd]", seg->index);
        if (k < 0 || (size_t)k >= cap - at)
            return -1;
        *len = at + (size_t)k;
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

/* Make `cause` (stolen; may be NULL) the __cause__ of the pending exception. */
static void attach_cause(PyObject *cause)
{
    if (cause == NULL)
        return;
    if (!PyErr_Occurred()) {
        Py_DECREF(cause);
        return;
    }
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *exc = PyErr_GetRaisedException();
    PyException_SetCause(exc, Py_NewRef(cause));
    PyException_SetContext(exc, cause);
    PyErr_SetRaisedException(exc);
#else
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value != NULL) {
        PyException_SetCause(value, Py_NewRef(cause));
        PyException_SetContext(value, cause);
    }
    else {
        Py_DECREF(cause);
    }
    PyErr_Restore(type, value, tb);
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
    attach_cause(cause);
}

/* A dict subclass rebuilt with other values (scatter, gather; replicate
 * does the same in replicate.c): copy.copy(obj), then copy[key] = value for
 * each (key, value) of pairs (a list of 2-tuples, obj's keys in its order).
 * So the copy keeps obj's type, its keys and their order, and what the
 * class keeps besides its items (a defaultdict's default_factory, instance
 * attributes), and no constructor sees the pairs: type(obj)(pairs) would
 * count them as keys in a Counter and fails for a defaultdict. The copy
 * must come back as a new object of the same type with exactly the keys
 * of pairs, else TypeError naming the path. */
PyObject *rebuild_mapping(dp_state *st, PyObject *obj, PyObject *pairs,
                          const path_seg *seg)
{
    PyTypeObject *tp = Py_TYPE(obj);
    PyObject *copy = PyObject_CallOneArg(st->copy_copy, obj);
    if (copy == NULL)
        goto fail;
    if (copy == obj || Py_TYPE(copy) != tp) {
        PyErr_Format(PyExc_TypeError, "copy.copy() returned %s",
                     copy == obj ? "the same object" : Py_TYPE(copy)->tp_name);
        goto fail;
    }
    Py_ssize_t n = PyList_GET_SIZE(pairs);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PyList_GET_ITEM(pairs, i);
        if (PyObject_SetItem(copy, PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1)) < 0)
            goto fail;
    }
    Py_ssize_t len = PyObject_Length(copy);
    if (len < 0)
        goto fail;
    if (len != n) {
        PyErr_Format(PyExc_TypeError, "the copy has %zd keys, the original %zd", len, n);
        goto fail;
    }
    return copy;
fail:
    Py_XDECREF(copy);
    raise_rebuild_error(seg, tp, "copy.copy(obj) with its values replaced", "");
    return NULL;
}

/* A namedtuple: a tuple subclass with `_fields` and `_asdict` (the test of
 * scatter_gather.py). 1, 0 or -1. */
int is_namedtuple(PyObject *obj)
{
    if (!PyTuple_Check(obj) || PyTuple_CheckExact(obj))
        return 0;
    int r = dp_has_attr(obj, "_asdict");
    if (r <= 0)
        return r;
    return dp_has_attr(obj, "_fields");
}

/* An instance (not a class) of a dataclass. 1, 0 or -1. */
int is_dataclass_instance(PyObject *obj)
{
    if (PyType_Check(obj))
        return 0;
    return dp_has_attr((PyObject *)Py_TYPE(obj), "__dataclass_fields__");
}

/* type(obj)._fields when it is a tuple of n str (for paths like args[0].a),
 * else NULL with no exception set: paths then fall back to [i]. */
PyObject *namedtuple_names(PyObject *obj, Py_ssize_t n)
{
    PyObject *names = PyObject_GetAttrString((PyObject *)Py_TYPE(obj), "_fields");
    if (names == NULL) {
        PyErr_Clear();
        return NULL;
    }
    if (!PyTuple_Check(names) || PyTuple_GET_SIZE(names) != n)
        goto no;
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyUnicode_Check(PyTuple_GET_ITEM(names, i)))
            goto no;
    return names;
no:
    Py_DECREF(names);
    return NULL;
}

/* A snapshot of a tuple's or list's items as a tuple (new reference), so
 * that user code run during a walk cannot resize what is being walked. */
PyObject *seq_snapshot(PyObject *seq)
{
    if (PyList_Check(seq))
        return PyList_AsTuple(seq);
    return Py_NewRef(seq);
}

/* A dict's items as a list of (key, value) 2-tuples; dict subclasses go
 * through their items() (as `obj.items()` in PyTorch), so an OrderedDict
 * keeps its own order. */
PyObject *dict_pairs(PyObject *d)
{
    PyObject *items = PyMapping_Items(d);
    if (items == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *p = PyList_GET_ITEM(items, i);
        if (!PyTuple_Check(p) || PyTuple_GET_SIZE(p) != 2) {
            PyErr_Format(PyExc_TypeError,
                         "%.100s.items() must give (key, value) pairs, got %.100s",
                         Py_TYPE(d)->tp_name, Py_TYPE(p)->tp_name);
            Py_DECREF(items);
            return NULL;
        }
    }
    return items;
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

/* Is spec a container entry of in_dims / out_dims (tuple, list or dict)? */
int spec_is_container(PyObject *spec)
{
    return spec != NULL && (PyTuple_Check(spec) || PyList_Check(spec) || PyDict_Check(spec));
}

/* The entry of a container spec for child i (key: the child's dict key or
 * field name, NULL for positions), borrowed, or NULL when the spec does not
 * list it (the child then uses the default). *sseg becomes its path. A
 * leaf spec (NULL, int, None, "sum") applies to every child: returned as is
 * with *sseg = *up. -1 only on an error from a dict lookup. */
int spec_child(PyObject *spec, const path_seg *up, Py_ssize_t i, PyObject *key,
               PyObject **child, path_seg *sseg)
{
    *child = NULL;
    *sseg = *up;
    if (!spec_is_container(spec)) {
        *child = spec;
        return 0;
    }
    if (PyDict_Check(spec)) {
        if (key == NULL)
            return 0;
        *sseg = seg_child(up, SEG_KEY, 0, key);
        *child = PyDict_GetItemWithError(spec, key);
        return *child == NULL && PyErr_Occurred() ? -1 : 0;
    }
    *sseg = seg_child(up, SEG_INDEX, i, NULL);
    Py_ssize_t len = PySequence_Fast_GET_SIZE(spec);
    if (i < len)
        *child = PySequence_Fast_GET_ITEM(spec, i);
    return 0;
}

/* A short description of a spec container: "a tuple of 3 entries". */
static PyObject *spec_what(PyObject *spec)
{
    return PyUnicode_FromFormat("a %.50s of %zd entr%s", Py_TYPE(spec)->tp_name,
                                PyObject_Length(spec),
                                PyObject_Length(spec) == 1 ? "y" : "ies");
}

/* A container spec at a position that is not a container of the matching
 * kind: TypeError naming both paths. what: how the value is described. */
int spec_mismatch(const path_seg *sseg, PyObject *spec, const path_seg *seg,
                  const char *what)
{
    PyObject *vp = path_str(seg), *sw = vp != NULL ? spec_what(spec) : NULL;
    if (sw != NULL)
        raise_at(PyExc_TypeError, sseg,
                 "%U mirrors the children of %U, but %U is %s; give an int or None "
                 "for it instead", sw, vp, vp, what);
    Py_XDECREF(vp);
    Py_XDECREF(sw);
    return -1;
}

/* Check that a container spec addresses only children that exist: a
 * tuple/list (a PySequence_Fast) at most n entries, a dict only keys of
 * `keys_of` (a dict; NULL: names in `names`, a tuple of str, e.g. dataclass
 * fields). ValueError naming the first entry that addresses nothing. */
int spec_check_children(PyObject *spec, const path_seg *sseg, const path_seg *seg,
                        Py_ssize_t n, PyObject *keys_of, PyObject *names)
{
    if (!PyDict_Check(spec)) {
        Py_ssize_t len = PySequence_Fast_GET_SIZE(spec);
        if (len <= n)
            return 0;
        PyObject *vp = path_str(seg);
        if (vp != NULL)
            raise_at(PyExc_ValueError, sseg,
                     "has %zd entries, but %U has only %zd (entries past the end "
                     "address nothing)", len, vp, n);
        Py_XDECREF(vp);
        return -1;
    }
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(spec, &pos, &key, &value)) {
        int has;
        if (keys_of != NULL) {
            has = PyDict_Contains(keys_of, key);
        }
        else {
            has = 0;
            for (Py_ssize_t i = 0; names != NULL && i < PyTuple_GET_SIZE(names) && !has; i++) {
                has = PyObject_RichCompareBool(PyTuple_GET_ITEM(names, i), key, Py_EQ);
                if (has < 0)
                    return -1;
            }
        }
        if (has < 0)
            return -1;
        if (has)
            continue;
        path_seg kseg = seg_child(sseg, SEG_KEY, 0, key);
        PyObject *vp = path_str(seg);
        if (vp != NULL)
            raise_at(PyExc_ValueError, &kseg, "%U has no key %R (a dict in in_dims or "
                     "out_dims may name only keys that exist)", vp, key);
        Py_XDECREF(vp);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ */
/* Arguments: dim, inputs, in_dims / out_dims, sizes                   */
/* ------------------------------------------------------------------ */

/* dim argument: 0 when absent. */
int parse_dim(PyObject *obj, int *dim)
{
    *dim = 0;
    return obj == NULL ? 0 : dp_int_from_object(obj, "dim", dim);
}

/* scatter_kwargs' inputs: None -> empty, a tuple as is, a list as the tuple
 * of its items, anything else one positional argument (inputs,). That is
 * what torch's scatter_kwargs gives once parallel_apply has called the
 * module (spec 3.1, 6.3): scatter([x]) makes [x_i] per replica, which
 * parallel_apply unpacks, and scatter(x) makes x_i, which it wraps as
 * (x_i,). New reference. */
PyObject *normalize_inputs(PyObject *inputs)
{
    if (inputs == Py_None)
        return PyTuple_New(0);
    if (PyTuple_Check(inputs))
        return Py_NewRef(inputs);
    if (PyList_Check(inputs))
        return PyList_AsTuple(inputs);
    return PyTuple_Pack(1, inputs);
}

/* kwargs: None -> NULL (no kwargs); a dict as is (borrowed). */
int normalize_kwargs(PyObject *kwargs, PyObject **out)
{
    *out = NULL;
    if (kwargs == Py_None)
        return 0;
    if (!PyDict_Check(kwargs)) {
        PyErr_Format(PyExc_TypeError, "kwargs: expected a dict or None, got %.100s",
                     Py_TYPE(kwargs)->tp_name);
        return -1;
    }
    *out = kwargs;
    return 0;
}

/* Check one in_dims / out_dims entry (recursively). */
static int check_spec(PyObject *spec, const path_seg *sseg, int is_out)
{
    if (spec == Py_None)
        return 0;
    if (dp_is_index_like(spec)) {
        /* the one int conversion (convert.c), with the entry's path as name */
        PyObject *sp = path_str(sseg);
        const char *csp = sp != NULL ? PyUnicode_AsUTF8(sp) : NULL;
        int dim;
        int r = csp != NULL ? dp_int_from_object(spec, csp, &dim) : -1;
        Py_XDECREF(sp);
        return r;
    }
    if (is_out && PyUnicode_Check(spec)) {
        if (PyUnicode_CompareWithASCIIString(spec, "sum") == 0)
            return 0;
        return raise_at(PyExc_ValueError, sseg,
                        "unknown reduction %R (out_dims takes an int dim, None or "
                        "\"sum\")", spec);
    }
    if (PyTuple_Check(spec) || PyList_Check(spec) || PyDict_Check(spec)) {
        int rc = -1;
        if (check_depth(sseg, is_out ? "out_dims" : "in_dims") < 0 ||
            Py_EnterRecursiveCall(" while checking in_dims / out_dims"))
            return -1;
        if (PyDict_Check(spec)) {
            Py_ssize_t pos = 0;
            PyObject *key, *value;
            while (PyDict_Next(spec, &pos, &key, &value)) {
                path_seg cseg = seg_child(sseg, SEG_KEY, 0, key);
                if (check_spec(value, &cseg, is_out) < 0)
                    goto done;
            }
        }
        else {
            PyObject *fast = PySequence_Fast(spec, "spec");
            if (fast == NULL)
                goto done;
            for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); i++) {
                path_seg cseg = seg_child(sseg, SEG_INDEX, i, NULL);
                if (check_spec(PySequence_Fast_GET_ITEM(fast, i), &cseg, is_out) < 0) {
                    Py_DECREF(fast);
                    goto done;
                }
            }
            Py_DECREF(fast);
        }
        rc = 0;
    done:
        Py_LeaveRecursiveCall();
        return rc;
    }
    return raise_at(PyExc_TypeError, sseg,
                    "expected an int (a dim), None (%s)%s or a tuple, list or dict of "
                    "them, got %.100s %.80R",
                    is_out ? "every replica returns the same value" : "broadcast the whole "
                    "array to every replica", is_out ? ", \"sum\"" : "",
                    Py_TYPE(spec)->tp_name, spec);
}

int dp_check_dims_spec(PyObject *spec, const char *argname, int is_out)
{
    if (spec == NULL)
        return 0;
    path_seg root = seg_root(argname);
    return check_spec(spec, &root, is_out);
}

/* A copy of one in_dims / out_dims entry in containers nobody else can
 * reach: lists stay lists and tuples tuples (plain ones), dicts (subclasses
 * included) become plain dicts; leaves (ints, None, "sum") are shared, being
 * immutable. Only C-level reads of the user's containers (no items(),
 * __iter__ or other user code), so nothing can change them half-way. */
static PyObject *spec_copy(PyObject *spec, const char *argname, int depth)
{
    if (!PyTuple_Check(spec) && !PyList_Check(spec) && !PyDict_Check(spec)) {
        /* NumPy integers (and other __index__ objects) become Python ints, so
         * the walkers see one kind of dim; one whose __index__ fails is kept
         * for check_spec to refuse with its path. */
        if (PyLong_CheckExact(spec) || !dp_is_index_like(spec))
            return Py_NewRef(spec);
        PyObject *idx = PyNumber_Index(spec);
        if (idx == NULL && PyErr_ExceptionMatches(PyExc_Exception)) {
            PyErr_Clear();
            return Py_NewRef(spec);
        }
        return idx;
    }
    if (depth > DP_MAX_NESTING) {
        /* The copy has no paths; dp_check_dims_spec on it would name one. */
        PyErr_Format(PyExc_RecursionError,
                     "%s: nested deeper than %d levels (dpmini walks at most %d levels "
                     "of tuples, lists and dicts; is a container inside itself?)",
                     argname, DP_MAX_NESTING, DP_MAX_NESTING);
        return NULL;
    }
    if (Py_EnterRecursiveCall(" while copying in_dims / out_dims"))
        return NULL;
    PyObject *items = NULL, *res = NULL;
    if (PyDict_Check(spec)) {
        /* PyDict_Items reads the dict's own storage (strong references),
         * also for subclasses; hashing the keys into the copy may run user
         * code, which can then change only the user's dict, not items. */
        items = PyDict_Items(spec);
        res = items != NULL ? PyDict_New() : NULL;
        for (Py_ssize_t i = 0; res != NULL && i < PyList_GET_SIZE(items); i++) {
            PyObject *pair = PyList_GET_ITEM(items, i);
            PyObject *v = spec_copy(PyTuple_GET_ITEM(pair, 1), argname, depth + 1);
            if (v == NULL || PyDict_SetItem(res, PyTuple_GET_ITEM(pair, 0), v) < 0)
                Py_CLEAR(res);
            Py_XDECREF(v);
        }
    }
    else {
        int is_list = PyList_Check(spec);
        items = is_list ? PyList_AsTuple(spec) : Py_NewRef(spec);
        Py_ssize_t n = items != NULL ? PyTuple_GET_SIZE(items) : 0;
        res = items == NULL ? NULL : is_list ? PyList_New(n) : PyTuple_New(n);
        for (Py_ssize_t i = 0; res != NULL && i < n; i++) {
            PyObject *v = spec_copy(PyTuple_GET_ITEM(items, i), argname, depth + 1);
            if (v == NULL)
                Py_CLEAR(res);
            else if (is_list)
                PyList_SET_ITEM(res, i, v);
            else
                PyTuple_SET_ITEM(res, i, v);
        }
    }
    Py_XDECREF(items);
    Py_LeaveRecursiveCall();
    return res;
}

int dims_take(PyObject *spec, const char *argname, int is_out, PyObject **out)
{
    *out = NULL;
    if (spec == NULL || spec == Py_None)
        return 0;
    PyObject *copy = spec_copy(spec, argname, 0);
    if (copy == NULL || dp_check_dims_spec(copy, argname, is_out) < 0) {
        Py_XDECREF(copy);
        return -1;
    }
    *out = copy;
    return 0;
}

/* One sequence argument of ndev entries (chunk_sizes or weights). */
static PyObject *per_device_seq(PyObject *obj, const char *argname, const char *what,
                                Py_ssize_t ndev)
{
    if (PyUnicode_Check(obj) || PyBytes_Check(obj) || PyDict_Check(obj) ||
        !PySequence_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a sequence of %s (one per device), "
                     "got %.100s", argname, what, Py_TYPE(obj)->tp_name);
        return NULL;
    }
    /* A tuple of its own (not PySequence_Fast, which returns a list itself):
     * __index__ / __float__ of an entry may change the caller's list. */
    PyObject *fast = PySequence_Tuple(obj);
    if (fast == NULL)
        return NULL;
    if (PySequence_Fast_GET_SIZE(fast) != ndev) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd entries (one per device in "
                     "device_ids), got %zd", argname, ndev, PySequence_Fast_GET_SIZE(fast));
        Py_DECREF(fast);
        return NULL;
    }
    return fast;
}

int dp_parse_split_sizes(PyObject *chunk_sizes, PyObject *weights, Py_ssize_t ndev,
                         int64_t *sizes_buf, double *weights_buf, dp_split_opts *opts)
{
    opts->chunk_sizes = NULL;
    opts->weights = NULL;
    if (chunk_sizes == Py_None)
        chunk_sizes = NULL;
    if (weights == Py_None)
        weights = NULL;
    if (chunk_sizes != NULL && weights != NULL) {
        PyErr_SetString(PyExc_ValueError,
                        "chunk_sizes and weights: give at most one (chunk_sizes fixes each "
                        "device's rows, weights makes them proportional)");
        return -1;
    }
    if (ndev < 1 || ndev > DP_MAX_DEVICES) {
        PyErr_Format(PyExc_ValueError, "expected 1 to %d devices, got %zd", DP_MAX_DEVICES,
                     ndev);
        return -1;
    }
    if (chunk_sizes != NULL) {
        PyObject *fast = per_device_seq(chunk_sizes, "chunk_sizes", "ints", ndev);
        if (fast == NULL)
            return -1;
        for (Py_ssize_t i = 0; i < ndev; i++) {
            PyObject *v = PySequence_Fast_GET_ITEM(fast, i);
            char name[48];
            long long x;
            snprintf(name, sizeof name, "chunk_sizes[%zd]", i);
            if (dp_index_from_object(v, name, LLONG_MIN, LLONG_MAX, &x) < 0) {
                Py_DECREF(fast);
                return -1;
            }
            if (x < 0) {
                PyErr_Format(PyExc_ValueError, "chunk_sizes[%zd]: must be >= 0 (rows for "
                             "device %zd), got %lld", i, i, x);
                Py_DECREF(fast);
                return -1;
            }
            sizes_buf[i] = (int64_t)x;
        }
        Py_DECREF(fast);
        opts->chunk_sizes = sizes_buf;
    }
    if (weights != NULL) {
        PyObject *fast = per_device_seq(weights, "weights", "numbers", ndev);
        if (fast == NULL)
            return -1;
        for (Py_ssize_t i = 0; i < ndev; i++) {
            PyObject *v = PySequence_Fast_GET_ITEM(fast, i);
            char name[48];
            double x;
            snprintf(name, sizeof name, "weights[%zd]", i);
            if (dp_real_from_object(v, name, &x) < 0) {
                Py_DECREF(fast);
                return -1;
            }
            if (!(x > 0.0) || !isfinite(x)) {
                PyErr_Format(PyExc_ValueError, "weights[%zd]: must be a finite number > 0, "
                             "got %R", i, v);
                Py_DECREF(fast);
                return -1;
            }
            weights_buf[i] = x;
        }
        Py_DECREF(fast);
        opts->weights = weights_buf;
    }
    return 0;
}

