/* scatter_count.c - pass (b) of scatter (see scatter_tree.c): decide the
 * replica count k from the leaves pass (a) recorded (scatter_walk.c), and
 * when the leaves disagree warn SplitWarning or, under strict=True, raise
 * ValueError, with messages that list every array leaf.
 */
#include "dpmini.h"
#include "tree.h"

/* ------------------------------------------------------------------ */
/* Pass (b): count and check                                           */
/* ------------------------------------------------------------------ */

/* The one condition behind both SplitWarning and strict=True's ValueError:
 * does leaf lf lose rows when only the first c->k chunks are used, i.e. has
 * it more chunks than k and rows in them? An array with 0 rows along its
 * dim has more chunks than k (torch.chunk gives it one empty chunk per
 * device) but loses nothing, so it neither warns nor raises. *kept: the
 * rows the first k chunks hold (may be NULL). */
static int leaf_drops_rows(const scatter_ctx *c, const scatter_leaf *lf, int64_t *kept)
{
    if (lf->bcast || lf->count <= c->k)
        return 0;
    int64_t n = (int64_t)PyArray_DIM(lf->arr, lf->dim), got = 0;
    for (int j = 0; j < c->k; j++)
        got += lf->sizes[j];
    if (kept != NULL)
        *kept = got;
    return got < n;
}

/* Pass (b): the replica count, and c->mismatch: whether any leaf loses rows
 * (leaf_drops_rows), the condition for SplitWarning and for strict=True. */
void scatter_count(scatter_ctx *c)
{
    c->k = c->ndev;
    c->mismatch = 0;
    int k = c->ndev + 1;
    /* Broadcast leaves (in_dims None) never limit the count. */
    for (Py_ssize_t i = 0; i < c->nleaves; i++)
        if (!c->leaves[i].bcast && c->leaves[i].count < k)
            k = c->leaves[i].count;
    if (k > c->ndev)
        return;  /* no split leaf: every device runs a replica */
    c->k = k;
    for (Py_ssize_t i = 0; i < c->nleaves; i++)
        if (leaf_drops_rows(c, &c->leaves[i], NULL))
            c->mismatch = 1;
}

/* The strict=True error text (modelled on JAX pmap's, R29): every array
 * path, its shape, the dim and the size along it. */
PyObject *strict_message(scatter_ctx *c)
{
    PyObject *lines = PyList_New(0), *res = NULL;
    if (lines == NULL)
        return NULL;
    if (append_steal(lines, PyUnicode_FromFormat(
            "scatter got arrays that split into different numbers of chunks "
            "over %d devices (strict=True):", c->ndev)) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < c->nleaves; i++) {
        scatter_leaf *lf = &c->leaves[i];
        if (lf->bcast)
            continue;
        PyObject *path = leaf_path(c, lf);
        PyObject *shape = path != NULL ? shape_repr(lf->arr) : NULL;
        if (shape == NULL)
            goto done;
        PyObject *line = PyUnicode_FromFormat(
            "  %U: shape %U, size %lld along dim %d -> %d chunk%s", path, shape,
            (long long)PyArray_DIM(lf->arr, lf->dim), lf->dim, lf->count,
            lf->count == 1 ? "" : "s");
        Py_DECREF(shape);
        if (append_steal(lines, line) < 0)
            goto done;
    }
    if (append_steal(lines, PyUnicode_FromString(
            "Give every array the same size along dim, or pass strict=False to "
            "use the smallest count as PyTorch does (the rows after it are "
            "then dropped).")) < 0)
        goto done;
    res = join_str("\n", lines);
done:
    Py_DECREF(lines);
    return res;
}

/* "args[0]: 2 chunks, args[1]: 1 chunk": every array path with its count. */
static PyObject *chunk_counts(scatter_ctx *c)
{
    PyObject *parts = PyList_New(0), *res = NULL;
    if (parts == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < c->nleaves; i++) {
        scatter_leaf *lf = &c->leaves[i];
        if (lf->bcast)
            continue;
        PyObject *path = leaf_path(c, lf);
        if (path == NULL)
            goto done;
        if (append_steal(parts, PyUnicode_FromFormat("%U: %d chunk%s", path,
                                                     lf->count,
                                                     lf->count == 1 ? "" : "s")) < 0)
            goto done;
    }
    res = join_str(", ", parts);
done:
    Py_DECREF(parts);
    return res;
}

/* The SplitWarning text (R06): every leaf that loses rows. *out = NULL when
 * none does (then c->mismatch is 0 too: the same leaf_drops_rows). */
int truncation_message(scatter_ctx *c, PyObject **out)
{
    PyObject *parts = PyList_New(0), *body = NULL, *counts = NULL;
    int rc = -1;
    *out = NULL;
    if (parts == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < c->nleaves; i++) {
        scatter_leaf *lf = &c->leaves[i];
        int64_t n = lf->bcast ? 0 : (int64_t)PyArray_DIM(lf->arr, lf->dim), kept = 0;
        if (!leaf_drops_rows(c, lf, &kept))
            continue;
        /* "rows" only along dim 0; "indices" along any other dim. */
        const char *one = lf->dim == 0 ? "row" : "index";
        const char *many = lf->dim == 0 ? "rows" : "indices";
        PyObject *path = leaf_path(c, lf);
        if (path == NULL)
            goto done;
        PyObject *part = kept == n - 1
            ? PyUnicode_FromFormat("%U: %s %lld of %lld along dim %d is dropped",
                                   path, one, (long long)kept, (long long)n, lf->dim)
            : PyUnicode_FromFormat("%U: %s %lld..%lld of %lld along dim %d are dropped",
                                   path, many, (long long)kept, (long long)(n - 1),
                                   (long long)n, lf->dim);
        if (append_steal(parts, part) < 0)
            goto done;
    }
    if (PyList_GET_SIZE(parts) > 0) {
        body = join_str("; ", parts);
        counts = chunk_counts(c);
        if (body == NULL || counts == NULL)
            goto done;
        *out = PyUnicode_FromFormat(
            "scatter got arrays that split into different numbers of chunks over "
            "%d devices (%U), so only %d replica%s (the smallest count, as in "
            "PyTorch): %U. Give every array the same size along dim, or pass "
            "strict=True to raise instead.",
            c->ndev, counts, c->k, c->k == 1 ? " runs" : "s run", body);
        if (*out == NULL)
            goto done;
    }
    rc = 0;
done:
    Py_XDECREF(body);
    Py_XDECREF(counts);
    Py_DECREF(parts);
    return rc;
}

/* Pass (b), checks: when some array loses rows (c->mismatch), strict ->
 * ValueError, else SplitWarning; otherwise neither. */
int scatter_check(scatter_ctx *c, int strict)
{
    if (!c->mismatch)
        return 0;
    if (strict) {
        PyObject *msg = strict_message(c);
        if (msg == NULL)
            return -1;
        PyErr_SetObject(PyExc_ValueError, msg);
        Py_DECREF(msg);
        return -1;
    }
    PyObject *msg;
    if (truncation_message(c, &msg) < 0)
        return -1;
    if (msg == NULL)
        return 0;
    const char *text = PyUnicode_AsUTF8(msg);
    int r = text == NULL ? -1 : PyErr_WarnEx(c->st->SplitWarning, text, 1);
    Py_DECREF(msg);
    return r;
}
