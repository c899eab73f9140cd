/* dist_gpu_move.c - scatter, gather and all_gather of GPU arrays through
 * NCCL point-to-point messages (ncclSend / ncclRecv in one group), after
 * the guard agreed (dist_guard.c) and with the communicator, waiting and
 * abort of dist_gpu.c.
 *
 * An array of shape (outer..., n, inner...) is `outer` blocks of n rows of
 * `inner` bytes (as in dist_move.c); the messages are bytes (ncclUint8).
 * Along the first dimension (outer == 1) every piece is contiguous and
 * moves straight from / to the arrays. Otherwise the pieces are packed into
 * (scatter, on root) or unpacked from (gather) one staging buffer on the
 * GPU, every rank's piece contiguous in rank order, with one
 * cudaMemcpy2DAsync per rank on the same stream, so the copies order
 * before the sends and after the receives without a host round trip. The
 * whole array's rows are that copy's pitch: a pitch over the smallest
 * cudaDevAttrMaxPitch of the ranks is refused on every rank before any
 * rank queues anything. The queueing (group, sends, receives, copies) runs
 * with the GIL released (ncclGroupEnd may block while NCCL connects) and
 * under the launch lock shared with dpmini._dpmini (dist_launch_begin).
 */
#include "dist.h"
#include "dist_nccl.h"

#include <string.h>

typedef struct {
    size_t outer, inner;     /* blocks; bytes of one row */
} layout;

static layout layout_of(const dist_meta *m, int dim)
{
    layout l = {1, (size_t)m->itemsize};
    for (int i = 0; i < dim; i++)
        l.outer *= (size_t)m->shape[i];
    for (int64_t i = dim + 1; i < m->ndim; i++)
        l.inner *= (size_t)m->shape[i];
    return l;
}

/* A uint8 staging buffer of `bytes` on this rank's device, in `lib`. */
static PyObject *new_stage(dist_comm *c, const char *lib, size_t bytes, uintptr_t *ptr)
{
    dist_meta m;
    memset(&m, 0, sizeof m);
    m.ndim = 1;
    m.shape[0] = (int64_t)bytes;
    m.itemsize = 1;
    snprintf(m.dtype, sizeof m.dtype, "|u1");
    return dist_gpu_alloc(lib, &m, c->nccl_dev, ptr);
}

/* Between the whole array (outer blocks of `total` rows) and the staging
 * buffer (rank r's rows[r] rows of every block, contiguous), one 2D copy a
 * rank. 0, or the CUDA error. */
static int restage(const dist_nccl_api *api, uintptr_t whole, uintptr_t stage, const layout *l,
                   const int64_t *rows, int P, int to_stage, dist_stream_t s)
{
    size_t total = 0, off = 0;
    for (int r = 0; r < P; r++)
        total += (size_t)rows[r];
    for (int r = 0; r < P; r++) {
        size_t w = (size_t)rows[r] * l->inner;
        char *a = (char *)whole + off * l->inner, *b = (char *)stage + l->outer * off * l->inner;
        off += (size_t)rows[r];
        if (w == 0)
            continue;
        int rc = to_stage ? api->Memcpy2DAsync(b, w, a, total * l->inner, w, l->outer,
                                               CUDA_MEMCPY_DEFAULT, s)
                          : api->Memcpy2DAsync(a, total * l->inner, b, w, w, l->outer,
                                               CUDA_MEMCPY_DEFAULT, s);
        if (rc != CUDA_OK)
            return rc;
    }
    return 0;
}

/* The restage copy's pitch (the whole array's row of `total` rows) fits
 * every rank's 2D copy; else a ValueError, raised alike on every rank (each
 * knows the shapes and the smallest limit). */
static int check_pitch(const dist_comm *c, const layout *l, int64_t total, int dim,
                       const char *what)
{
    unsigned long long pitch = (unsigned long long)total * l->inner;
    if (l->outer <= 1 || pitch <= (unsigned long long)c->nccl_max_pitch)
        return 0;
    PyErr_Format(PyExc_ValueError, "dpmini.distributed.%s: GPU arrays along dim %d move as 2D "
                 "copies whose rows are %llu bytes (%lld rows of %zu bytes), more than the "
                 "largest 2D copy pitch of the ranks' GPUs, %lld bytes (cudaDevAttrMaxPitch; "
                 "every rank raises this, nothing was sent): move the dimension first "
                 "(x.movedim(%d, 0) and a contiguous copy) and %s along dim 0", what, dim,
                 pitch, (long long)total, l->inner, c->nccl_max_pitch, dim, what);
    return -1;
}

/* Where rank r's piece starts: in the whole array when outer == 1, else in
 * the staging buffer. */
static uintptr_t piece_at(uintptr_t whole, uintptr_t stage, const layout *l, size_t off)
{
    return l->outer == 1 ? whole + off * l->inner : stage + l->outer * off * l->inner;
}

/* Root's sends of every piece and this rank's receive, in one group;
 * the NCCL result, or NCCL_UNHANDLED_CUDA when root's restage failed. */
static int queue_scatter(dist_comm *c, const dist_nccl_api *api, const dist_gpu_arg *g,
                         const layout *l, const int64_t *sizes, int root, uintptr_t out_ptr,
                         uintptr_t stage_ptr, dist_stream_t s)
{
    int P = c->size, me = c->rank, rc = NCCL_OK;
    if (stage_ptr != 0 && restage(api, g->ptr, stage_ptr, l, sizes, P, 1, s) != CUDA_OK)
        return NCCL_UNHANDLED_CUDA;
    size_t off = 0;
    api->GroupStart();
    if (sizes[me] > 0)
        rc = api->Recv((void *)out_ptr, l->outer * (size_t)sizes[me] * l->inner, NCCL_T_UINT8,
                       root, (dist_ncclComm_t)c->nccl, s);
    for (int r = 0; me == root && r < P && rc == NCCL_OK; r++) {
        if (sizes[r] > 0)
            rc = api->Send((void *)piece_at(g->ptr, stage_ptr, l, off),
                           l->outer * (size_t)sizes[r] * l->inner, NCCL_T_UINT8, r,
                           (dist_ncclComm_t)c->nccl, s);
        off += (size_t)sizes[r];
    }
    int end = api->GroupEnd();
    return rc != NCCL_OK ? rc : end;
}

static PyObject *scatter_on_device(dist_comm *c, const dist_meta *rm, dist_gpu_arg *g,
                                   const int64_t *sizes, int dim, int root, double deadline)
{
    int me = c->rank, rc = NCCL_OK;
    const dist_nccl_api *api = dist_nccl_get();
    layout l = layout_of(rm, dim);
    if (check_pitch(c, &l, rm->shape[dim], dim, "scatter") < 0)
        return NULL;
    dist_stream_t s = (dist_stream_t)g->stream;
    dist_meta om = *rm;
    om.shape[dim] = sizes[me];
    uintptr_t out_ptr = 0, stage_ptr = 0;
    PyObject *out = dist_gpu_alloc(rm->lib, &om, c->nccl_dev, &out_ptr), *stage = NULL;
    if (out == NULL)
        return NULL;   /* the others wait for this rank until their timeout */
    if (me == root && l.outer > 1) {
        stage = new_stage(c, rm->lib, l.outer * (size_t)rm->shape[dim] * l.inner, &stage_ptr);
        if (stage == NULL)
            goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    dist_launch_begin();
    rc = queue_scatter(c, api, g, &l, sizes, root, out_ptr, stage_ptr, s);
    dist_launch_end();
    Py_END_ALLOW_THREADS
    if (dist_gpu_finish(c, rc, s, deadline, "scatter", rm->call, g->obj, out, stage) < 0)
        goto fail;
    Py_XDECREF(stage);
    return out;
fail:
    Py_XDECREF(stage);
    Py_DECREF(out);
    return NULL;
}

/* Every rank's sends to the receivers and the receives of this rank, in
 * one group, then the restage out of the staging buffer; the NCCL result,
 * or NCCL_UNHANDLED_CUDA when the restage failed. */
static int queue_gather(dist_comm *c, const dist_nccl_api *api, const dist_gpu_arg *g,
                        const layout *l, const int64_t *rows, int root, uintptr_t out_ptr,
                        uintptr_t stage_ptr, dist_stream_t s)
{
    int P = c->size, me = c->rank, all = root < 0, rc = NCCL_OK;
    int receives = all || me == root;
    size_t off = 0, mine_bytes = l->outer * (size_t)rows[me] * l->inner;
    api->GroupStart();
    for (int r = 0; r < P && rc == NCCL_OK; r++) {
        if (receives && rows[r] > 0)
            rc = api->Recv((void *)piece_at(out_ptr, stage_ptr, l, off),
                           l->outer * (size_t)rows[r] * l->inner, NCCL_T_UINT8, r,
                           (dist_ncclComm_t)c->nccl, s);
        off += (size_t)rows[r];
        if (rc == NCCL_OK && mine_bytes > 0 && (all || r == root))
            rc = api->Send((void *)g->ptr, mine_bytes, NCCL_T_UINT8, r, (dist_ncclComm_t)c->nccl, s);
    }
    int end = api->GroupEnd();
    rc = rc != NCCL_OK ? rc : end;
    if (rc == NCCL_OK && stage_ptr != 0 && restage(api, out_ptr, stage_ptr, l, rows, P, 0, s) != CUDA_OK)
        rc = NCCL_UNHANDLED_CUDA;
    return rc;
}

static PyObject *gather_on_device(dist_comm *c, const dist_meta *mine, dist_gpu_arg *g, int dim,
                                  int root, double deadline)
{
    int P = c->size, me = c->rank, all = root < 0, rc = NCCL_OK;
    int receives = all || me == root;
    const char *what = all ? "all_gather" : "gather";
    const dist_nccl_api *api = dist_nccl_get();
    int64_t *rows = PyMem_Calloc((size_t)P, sizeof(int64_t));
    if (rows == NULL)
        return PyErr_NoMemory();
    dist_meta om = *mine;
    om.shape[dim] = 0;
    for (int r = 0; r < P; r++)
        om.shape[dim] += rows[r] = c->peers[r].shape[dim];
    layout l = layout_of(mine, dim);
    if (check_pitch(c, &l, om.shape[dim], dim, what) < 0) {
        PyMem_Free(rows);
        return NULL;
    }
    dist_stream_t s = (dist_stream_t)g->stream;
    uintptr_t out_ptr = 0, stage_ptr = 0;
    PyObject *out = NULL, *stage = NULL;
    if (receives) {
        out = dist_gpu_alloc(mine->lib, &om, g->dev, &out_ptr);
        if (out == NULL || (l.outer > 1 && (stage = new_stage(c, mine->lib, l.outer *
                                             (size_t)om.shape[dim] * l.inner, &stage_ptr)) == NULL))
            goto fail;   /* the others wait for this rank until their timeout */
    }
    Py_BEGIN_ALLOW_THREADS
    dist_launch_begin();
    rc = queue_gather(c, api, g, &l, rows, root, out_ptr, stage_ptr, s);
    dist_launch_end();
    Py_END_ALLOW_THREADS
    if (dist_gpu_finish(c, rc, s, deadline, what, mine->call, g->obj, out, stage) < 0)
        goto fail;
    PyMem_Free(rows);
    Py_XDECREF(stage);
    return out != NULL ? out : Py_NewRef(Py_None);
fail:
    PyMem_Free(rows);
    Py_XDECREF(stage);
    Py_XDECREF(out);
    return NULL;
}

PyObject *dist_gpu_scatter(dist_comm *c, const dist_meta *rm, dist_gpu_arg *g,
                           const int64_t *sizes, int dim, int root, double deadline)
{
    if (dist_gpu_comm(c, g->obj != NULL ? g->dev : -1, deadline, DIST_SCATTER) < 0)
        return NULL;
    int prev = dist_gpu_enter(c);
    if (prev == -2)
        return NULL;   /* the others wait for this rank until their timeout */
    PyObject *out = scatter_on_device(c, rm, g, sizes, dim, root, deadline);
    dist_gpu_leave(c, prev);
    return out;
}

PyObject *dist_gpu_gather(dist_comm *c, const dist_meta *mine, dist_gpu_arg *g, int dim,
                          int root, double deadline)
{
    if (dist_gpu_comm(c, g->dev, deadline, mine->kind) < 0)
        return NULL;
    int prev = dist_gpu_enter(c);
    if (prev == -2)
        return NULL;   /* the others wait for this rank until their timeout */
    PyObject *out = gather_on_device(c, mine, g, dim, root, deadline);
    dist_gpu_leave(c, prev);
    return out;
}
