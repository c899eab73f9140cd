/* dist_split.c - the split arguments of dpmini.distributed.scatter and
 * split_sizes: chunk_sizes / weights read from Python, hashed for the guard
 * (they are collective arguments: the same on every rank), and turned into
 * rows per rank by plan.c (never a second copy of the rule).
 */
#include "dist.h"
#include "plan.h" /* csrc/core/ */

#include <string.h>

/* ------------------------------------------------------------------ */
/* Split arguments (collective: the same on every rank, checked)       */
/* ------------------------------------------------------------------ */

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 1099511628211ULL;
    return h;
}

int dist_read_split(PyObject *cs, PyObject *w, int P, split_args *s, dist_meta *m)
{
    s->mode = 0;
    if (cs != Py_None && w != Py_None) {
        PyErr_SetString(PyExc_ValueError, "chunk_sizes and weights: give at most one of them");
        return -1;
    }
    PyObject *obj = cs != Py_None ? cs : w;
    if (obj == Py_None)
        return 0;
    const char *name = cs != Py_None ? "chunk_sizes" : "weights";
    PyObject *seq = PySequence_Fast(obj, "");
    if (seq == NULL) {
        PyErr_Format(PyExc_TypeError, "%s: expected a sequence of %d numbers (one per rank), "
                     "got %.80s", name, P, Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (PySequence_Fast_GET_SIZE(seq) != P) {
        PyErr_Format(PyExc_ValueError, "%s: %zd entries for %d ranks (one per rank)", name,
                     PySequence_Fast_GET_SIZE(seq), P);
        Py_DECREF(seq);
        return -1;
    }
    s->mode = cs != Py_None ? 1 : 2;
    uint64_t h = fnv(14695981039346656037ULL, &s->mode, sizeof s->mode);
    for (int i = 0; i < P; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (s->mode == 1) {
            int64_t v = PyNumber_Check(item) && !PyFloat_Check(item) && !PyBool_Check(item)
                        ? PyLong_AsLongLong(item) : (PyErr_SetString(PyExc_TypeError, ""), -1);
            if (v == -1 && PyErr_Occurred()) {
                PyErr_Format(PyExc_TypeError, "%s[%d]: expected an int, got %.80s", name, i,
                             Py_TYPE(item)->tp_name);
                Py_DECREF(seq);
                return -1;
            }
            s->sizes[i] = v;
            h = fnv(h, &v, sizeof v);
        } else {
            double v = PyBool_Check(item) ? -1.0 : PyFloat_AsDouble(item);
            if (v == -1.0 && (PyErr_Occurred() || PyBool_Check(item))) {
                PyErr_Clear();
                PyErr_Format(PyExc_TypeError, "%s[%d]: expected a real number, got %.80s",
                             name, i, Py_TYPE(item)->tp_name);
                Py_DECREF(seq);
                return -1;
            }
            s->weights[i] = v;
            h = fnv(h, &v, sizeof v);
        }
    }
    m->split_hash = h | 1;
    PyObject *r = PyObject_Repr(obj);
    const char *t = r ? PyUnicode_AsUTF8(r) : NULL;
    if (t == NULL)
        PyErr_Clear();
    snprintf(m->split_text, sizeof m->split_text, "%s=%.40s%s", name, t ? t : "?",
             t && strlen(t) > 40 ? "..." : "");
    Py_XDECREF(r);
    Py_DECREF(seq);
    return 0;
}

/* The rows of every rank for n rows: plan.c's rules. */
int dist_plan_rows(const split_args *s, int64_t n, int P, int64_t *sizes)
{
    int bad = -1, rc;
    if (s->mode == 0) {
        rc = dp_chunk_sizes(n, P, sizes);
        return rc < 0 ? (PyErr_SetString(PyExc_ValueError, "chunk rule: bad arguments"), -1) : 0;
    }
    if (s->mode == 1) {
        rc = dp_check_chunk_sizes(n, P, s->sizes, &bad);
        if (rc == DP_ERR_NEGATIVE_SIZE)
            PyErr_Format(PyExc_ValueError, "chunk_sizes[%d]: %lld rows is negative", bad,
                         (long long)s->sizes[bad]);
        else if (rc != DP_OK)
            PyErr_Format(PyExc_ValueError, "chunk_sizes: the sizes must add up to the %lld "
                         "rows of x along dim (torch.split_with_sizes' rule)", (long long)n);
        else
            memcpy(sizes, s->sizes, sizeof(int64_t) * (size_t)P);
        return rc == DP_OK ? 0 : -1;
    }
    if (P > DP_MAX_DEVICES) {
        PyErr_Format(PyExc_ValueError, "weights: at most %d ranks (the weighted rule's limit); "
                     "give chunk_sizes instead", DP_MAX_DEVICES);
        return -1;
    }
    rc = dp_weighted_sizes(n, P, s->weights, sizes, &bad);
    char v[32];
    snprintf(v, sizeof v, "%g", rc == DP_ERR_WEIGHT ? s->weights[bad] : 0.0);
    if (rc == DP_ERR_WEIGHT)
        PyErr_Format(PyExc_ValueError, "weights[%d]: %s is not a finite number > 0", bad, v);
    else if (rc < 0)
        PyErr_SetString(PyExc_ValueError, "weights: bad arguments");
    return rc < 0 ? -1 : 0;
}


/* split_sizes(n, size, chunk_sizes=None, weights=None) -> list of rows. */
PyObject *dist_split_sizes(PyObject *Py_UNUSED(m), PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"n", "size", "chunk_sizes", "weights", NULL};
    long long n;
    int P;
    PyObject *cs = Py_None, *w = Py_None, *res = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Li|OO:split_sizes", kwlist, &n, &P, &cs, &w))
        return NULL;
    if (n < 0 || P < 1) {
        PyErr_Format(PyExc_ValueError, "split_sizes: expected n >= 0 and size >= 1, got n=%lld "
                     "size=%d", n, P);
        return NULL;
    }
    int64_t *sizes = PyMem_Calloc((size_t)P * 2, sizeof(int64_t));
    double *wts = PyMem_Calloc((size_t)P, sizeof(double));
    dist_meta m;
    memset(&m, 0, sizeof m);
    if (sizes == NULL || wts == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    split_args s = {0, sizes + P, wts};
    if (dist_read_split(cs, w, P, &s, &m) < 0 || dist_plan_rows(&s, n, P, sizes) < 0)
        goto out;
    res = PyList_New(P);
    for (int i = 0; res != NULL && i < P; i++) {
        PyObject *v = PyLong_FromLongLong(sizes[i]);
        if (v == NULL)
            Py_CLEAR(res);
        else
            PyList_SET_ITEM(res, i, v);
    }
out:
    PyMem_Free(sizes);
    PyMem_Free(wts);
    return res;
}
