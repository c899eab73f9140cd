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
 * before the sends and after the receives without a host round trip.
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

/* Where rank r's piece starts: in the whole array when outer == 1, else in
 * the staging buffer. */
static uintptr_t piece_at(uintptr_t whole, uintptr_t stage, const layout *l, size_t off)
{
    return l->outer == 1 ? whole + off * l->inner : stage + l->outer * off * l->inner;
}

PyObject *dist_gpu_scatter(dist_comm *c, const dist_meta *rm, dist_gpu_arg *g,
                           const int64_t *sizes, int dim, int root, double deadline)
{
    int P = c->size, me = c->rank, rc = NCCL_OK, cuda = CUDA_OK;
    if (dist_gpu_comm(c, g->obj != NULL ? g->dev : -1, deadline, DIST_SCATTER) < 0)
        return NULL;
    const dist_nccl_api *api = dist_nccl_get();
    layout l = layout_of(rm, dim);
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
        cuda = restage(api, g->ptr, stage_ptr, &l, sizes, P, 1, s);
    }
    if (cuda == CUDA_OK) {
        size_t off = 0;
        api->GroupStart();
        if (sizes[me] > 0)
            rc = api->Recv((void *)out_ptr, l.outer * (size_t)sizes[me] * l.inner, NCCL_T_UINT8,
                           root, (dist_ncclComm_t)c->nccl, s);
        for (int r = 0; me == root && r < P && rc == NCCL_OK; r++) {
            if (sizes[r] > 0)
                rc = api->Send((void *)piece_at(g->ptr, stage_ptr, &l, off),
                               l.outer * (size_t)sizes[r] * l.inner, NCCL_T_UINT8, r,
                               (dist_ncclComm_t)c->nccl, s);
            off += (size_t)sizes[r];
        }
        int end = api->GroupEnd();
        rc = rc != NCCL_OK ? rc : end;
    }
    if (dist_gpu_finish(c, cuda != CUDA_OK ? NCCL_UNHANDLED_CUDA : rc, s, deadline, "scatter",
                        rm->call, g->obj, out, stage) < 0)
        goto fail;
    Py_XDECREF(stage);
    return out;
fail:
    Py_XDECREF(stage);
    Py_DECREF(out);
    return NULL;
}

PyObject *dist_gpu_gather(dist_comm *c, const dist_meta *mine, dist_gpu_arg *g, int dim,
                          int root, double deadline)
{
    int P = c->size, me = c->rank, all = root < 0, rc = NCCL_OK, cuda = CUDA_OK;
    int receives = all || me == root;
    const char *what = all ? "all_gather" : "gather";
    if (dist_gpu_comm(c, g->dev, deadline, mine->kind) < 0)
        return NULL;
    const dist_nccl_api *api = dist_nccl_get();
    int64_t *rows = PyMem_Calloc((size_t)P, sizeof(int64_t));
    if (rows == NULL)
        return PyErr_NoMemory();
    dist_meta om = *mine;
    om.shape[dim] = 0;
    for (int r = 0; r < P; r++)
        om.shape[dim] += rows[r] = c->peers[r].shape[dim];
    layout l = layout_of(mine, dim);
    dist_stream_t s = (dist_stream_t)g->stream;
    uintptr_t out_ptr = 0, stage_ptr = 0;
    PyObject *out = NULL, *stage = NULL;
    if (receives) {
        out = dist_gpu_alloc(mine->lib, &om, g->dev, &out_ptr);
        if (out == NULL || (l.outer > 1 && (stage = new_stage(c, mine->lib, l.outer *
                                             (size_t)om.shape[dim] * l.inner, &stage_ptr)) == NULL))
            goto fail;   /* the others wait for this rank until their timeout */
    }
    size_t off = 0, mine_bytes = l.outer * (size_t)rows[me] * l.inner;
    api->GroupStart();
    for (int r = 0; r < P && rc == NCCL_OK; r++) {
        if (receives && rows[r] > 0)
            rc = api->Recv((void *)piece_at(out_ptr, stage_ptr, &l, off),
                           l.outer * (size_t)rows[r] * l.inner, NCCL_T_UINT8, r,
                           (dist_ncclComm_t)c->nccl, s);
        off += (size_t)rows[r];
        if (rc == NCCL_OK && mine_bytes > 0 && (all || r == root))
            rc = api->Send((void *)g->ptr, mine_bytes, NCCL_T_UINT8, r, (dist_ncclComm_t)c->nccl, s);
    }
    int end = api->GroupEnd();
    rc = rc != NCCL_OK ? rc : end;
    if (rc == NCCL_OK && stage != NULL)
        cuda = restage(api, out_ptr, stage_ptr, &l, rows, P, 0, s);
    if (dist_gpu_finish(c, cuda != CUDA_OK ? NCCL_UNHANDLED_CUDA : rc, s, deadline, what,
                        mine->call, g->obj, out, stage) < 0)
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
