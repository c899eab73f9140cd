/* dpmini.h - the declarations of csrc/py/, the Python-facing layer: module
 * state, Device and device memory, dpmini.Array, argument conversion, the
 * leaves of other array libraries, and the funnel from a dpc_status to a
 * Python exception. Each layer above declares its own in a header of its
 * folder (engine/engine.h, tree/walk.h, dp/dp.h); a file includes the
 * headers of exactly the layers it calls (docs/architecture.md).
 *
 * Include this first in every C file of csrc/ that uses Python (never in
 * core/). py/state.c defines DP_IMPORT_ARRAY before including it, so the
 * NumPy C-API table is defined there and imported everywhere else.
 *
 * Conventions
 *   - Functions returning int: 0 on success, -1 with a Python exception set.
 *   - Functions returning PyObject*: a new reference, or NULL with an
 *     exception set.
 *   - `argname` parameters name the user's argument in error messages
 *     ("device_ids[1]", "dim", "args[0]['x']"); never NULL.
 *   - Sizes along a dim are in elements (int64_t); byte counts are size_t.
 */
#ifndef DPMINI_DPMINI_H
#define DPMINI_DPMINI_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define NPY_NO_DEPRECATED_API NPY_1_22_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL dpmini_ARRAY_API
#ifndef DP_IMPORT_ARRAY
#define NO_IMPORT_ARRAY
#endif
#include <numpy/arrayobject.h>

/* NumPy 1.x headers have no accessor for a dtype's item size. */
#if NPY_ABI_VERSION < 0x02000000
#define PyDataType_ELSIZE(descr) ((descr)->elsize)
#endif

#include <stdint.h>

/* ------------------------------------------------------------------ */
/* Devices (device.c) and module state                                 */
/* ------------------------------------------------------------------ */

/* Kinds match the worker-slot kinds of pool.h. */
enum { DP_HOST = 0, DP_VCPU = 1, DP_CUDA = 2 };

typedef struct {
    int kind;   /* DP_HOST, DP_VCPU or DP_CUDA                         */
    int index;  /* -1 for DP_HOST; 0..DP_POOL_MAX_INDEX-1 otherwise    */
} dp_device;

static inline int dp_device_eq(dp_device a, dp_device b)
{
    return a.kind == b.kind && a.index == b.index;
}

typedef struct dp_state {
    PyTypeObject *DeviceType;        /* dpmini.Device                      */
    PyTypeObject *BufferType;        /* dpmini._Buffer: owns device memory */
    PyTypeObject *DataParallelType;  /* dpmini.DataParallel                */
    PyTypeObject *ArrayType;         /* dpmini.Array: an array on a GPU    */
    PyTypeObject *HostDLPackType;    /* _HostDLPack: DLPack export of a host
                                        ndarray of an ml_dtypes dtype
                                        (host_dlpack.c)                    */
    PyObject *DPError;               /* dpmini.DPError(Exception)          */
    PyObject *CudaError;             /* dpmini.CudaError(DPError)          */
    PyObject *NcclError;             /* dpmini.NcclError(DPError)          */
    PyObject *SplitWarning;          /* dpmini.SplitWarning(UserWarning)   */
    PyObject *ZeroDimError;          /* dpmini.ZeroDimError(ValueError,
                                        RuntimeError): a 0-dim array to split */
    PyObject *RequiresGradError;     /* dpmini._dpmini._RequiresGradError(TypeError):
                                        a torch tensor that requires grad met in
                                        grad mode; entry points retry in dpmini._torch */
    PyObject *copy_copy;             /* copy.copy                          */
    PyObject *dataclasses_fields;    /* dataclasses.fields                 */
    PyObject *format_exception;      /* traceback.format_exception         */
    PyObject *KeyErrorMessage;       /* dpmini._dpmini._KeyErrorMessage(str):
                                        repr() is the text itself (docs/spec.md 6.5) */
    PyObject *origins;               /* dict: array type -> its library's
                                        from_dlpack, or None (interop.c)  */
    PyObject *numpy_handlers;        /* list by virtual CPU device index: its
                                        NumPy allocator capsule or None; NULL
                                        until first used (numpy_allocator.c) */
    PyObject *replica_contexts;      /* tuple of the registered replica context
                                        providers, replaced (never mutated) on
                                        each change; NULL: none
                                        (dp/parallel_apply.c) */
    PyObject *torch_host;            /* tuple (torch.Tensor, nn.Parameter,
                                        torch.from_dlpack, torch.from_numpy,
                                        tuple of torch dtypes NumPy holds)
                                        once torch is imported; NULL before
                                        (interop_torch.c, the host fast path) */
    PyObject *park_openmp_type;      /* a type whose instances, as replicas on
                                        virtual CPU devices, park the caller's
                                        OpenMP team (torch.nn.Module, set by
                                        dpmini/_torch.py); NULL: never
                                        (dp/parallel_apply.c, core/omp_team.h) */
    PyObject *park_openmp_prepare;   /* called (no arguments) before a call
                                        parks, or NULL (torch.get_num_threads:
                                        torch sets a thread's count on first use,
                                        which must not happen inside the region) */
    int torch_context_loaded;        /* 1 once a call found torch imported and
                                        loaded its adapter (interop_torch.c) */
    /* A copy of src (any device) on dev, synchronously; a new shadow or
     * ndarray. The engine's dp_copy_to_device, set by module init: py/
     * (array.c's Array.to, copy_to_host, __array__) copies through it
     * without calling up into engine/. Never NULL once the module exists. */
    PyObject *(*copy_to_device)(struct dp_state *st, PyArrayObject *src, dp_device dev);
} dp_state;

extern struct PyModuleDef dp_module_def;

/* State of the dpmini module, from the module object (module functions). */
dp_state *dp_state_from_module(PyObject *module);
/* State from an instance's type; works for Python subclasses of dpmini
 * types too. Never fails once dpmini is imported. */
dp_state *dp_state_from_type(PyTypeObject *tp);

/* Import NumPy's C-API table (state.c defines it): 0, or -1 with an
 * exception set. Called once by module init before anything uses NumPy. */
int dp_import_numpy(void);

/* ------------------------------------------------------------------ */
/* Devices (device.c)                                                  */
/* ------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    dp_device dev;
} dp_DeviceObject;

/* Flags for dp_device_from_object. */
#define DP_DEV_ALLOW_HOST 1   /* accept "cpu" and -1 as the host          */

/* Parse a device: a dpmini.Device, "cpu" (host), "cpu:N" (virtual CPU
 * device N), "cuda", "cuda:N" or an int N >= 0 (CUDA device N), -1 (host).
 * CUDA devices must exist (dpmini.device_count() > N); otherwise ValueError
 * naming argname and saying that there is no such CUDA device.
 * The host is refused (ValueError) unless DP_DEV_ALLOW_HOST is set. */
int dp_device_from_object(dp_state *st, PyObject *obj, const char *argname,
                          int flags, dp_device *out);

/* bytes, bytearray and memoryview are sequences of ints, which would read as
 * CUDA device numbers: TypeError naming argname (-1), else 0. */
int dp_refuse_bytes_as_devices(PyObject *obj, const char *argname);

/* Parse a non-empty sequence of devices (hosts refused). *out is
 * PyMem_Malloc'ed (caller PyMem_Free's it); *n its length. Errors name
 * "argname[i]". An empty sequence is ValueError. */
int dp_device_list_from_object(dp_state *st, PyObject *obj, const char *argname,
                               dp_device **out, Py_ssize_t *n);

/* New reference to a dpmini.Device for d. */
PyObject *dp_device_to_object(dp_state *st, dp_device d);

/* "cpu", "cpu:3", "cuda:0" into buf (always NUL-terminated). */
void dp_device_format(dp_device d, char *buf, size_t size);

/* The default device list when device_ids is None: every CUDA device when
 * there are any, else cpu:0 .. cpu:(dp_cpu_device_count()-1). */
int dp_default_devices(dp_state *st, dp_device **out, Py_ssize_t *n);

/* Number of virtual CPU devices used by default: $DPMINI_CPU_DEVICES when
 * set, else the number of usable cores, at least 2. */
int dp_cpu_device_count(void);

/* Number of CUDA devices (0 when built without CUDA or with no driver). */
int dp_cuda_device_count(void);

/* ------------------------------------------------------------------ */
/* Memory (device.c)                                                   */
/* ------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    dp_device dev;
    void *ptr;        /* 64-byte aligned; owned; NULL only when nbytes == 0 */
    size_t nbytes;    /* bytes requested                                    */
    int exported;     /* CUDA memory handed to another library (array.c):
                         0 no; 1 to DLPack consumers that all named
                         export_stream; 2 otherwise (a CAI read, no stream):
                         see gpu_export.c for the wait before reuse */
    void *export_stream;
} dp_BufferObject;

/* A new buffer of nbytes on device d (MemoryError on failure). Memory comes
 * from a per-device caching allocator, as in PyTorch's CUDA allocator, so a
 * repeated scatter of the same shapes does not page-fault every call. */
PyObject *dp_buffer_new(dp_state *st, dp_device d, size_t nbytes);

/* A new ndarray on device d whose base is a fresh buffer. `descr` is
 * stolen. strides NULL means C order; otherwise they must describe a dense
 * layout of `shape` (from dp_dense_strides). */
PyArrayObject *dp_empty(dp_state *st, dp_device d, PyArray_Descr *descr, int nd,
                        const npy_intp *shape, const npy_intp *strides);

/* Small arrays of one call carved out of shared buffers (dp_empty_slab):
 * one allocation for many arrays instead of one each. A buffer lives until
 * the last array in it is freed, so only small pieces share one, and a
 * buffer holds at most DP_SLAB_MAX bytes. Zero-initialise; one per device;
 * dp_slab_clear drops the caller's reference (the arrays keep theirs). */
#define DP_SLAB_PIECE_MAX ((size_t)4096)  /* larger arrays get their own buffer */
#define DP_SLAB_MAX ((size_t)65536)
typedef struct {
    PyObject *buf;      /* the buffer being filled, or NULL               */
    size_t used, cap;   /* bytes handed out of buf (64-aligned), its size */
    size_t next;        /* size of the next buffer when the caller gives
                           no hint: the first piece's own size, then
                           1 KiB, doubling up to DP_SLAB_MAX              */
} dp_slab;

/* dp_empty, but when the array has 1..DP_SLAB_PIECE_MAX bytes and d is not
 * a CUDA device, its memory is carved out of s's buffer (a new one when it
 * is full; 64-byte aligned pieces); its base is that buffer, so
 * dp_array_device and the memory accounting see d. hint: bytes the caller
 * still means to carve from s, this array's included (sizes the next
 * buffer; 0 when unknown). s NULL: dp_empty. `descr` is stolen. */
PyArrayObject *dp_empty_slab(dp_state *st, dp_slab *s, dp_device d, PyArray_Descr *descr,
                             int nd, const npy_intp *shape, const npy_intp *strides,
                             size_t hint);
/* Drop s's reference to its buffer. */
void dp_slab_clear(dp_slab *s);
/* The bytes dp_empty_slab carves for nbytes (64-byte aligned). */
#define DP_SLAB_ROUND(n) (((n) + 63) & ~(size_t)63)

/* The device an ndarray's memory belongs to: the device of the dpmini
 * buffer at the end of its base chain, else the host. */
dp_device dp_array_device(dp_state *st, PyArrayObject *a);

/* ------------------------------------------------------------------ */
/* Arrays and arguments (convert.c)                                    */
/* ------------------------------------------------------------------ */

/* Is obj an array leaf (scatter, gather, replicate, explain): a
 * numpy.ndarray (subclasses included), a dpmini.Array, or a foreign array
 * (dp_is_foreign_array)? NumPy scalars, Python numbers, bytes and
 * memoryview are not. 1/0, or -1 with the probe's error (see interop.c). */
int dp_is_array_leaf(dp_state *st, PyObject *obj);

/* The ndarray subclasses dpmini refuses as array leaves, because plain
 * chunks would silently change their meaning: numpy.ma.MaskedArray (the mask
 * would be lost) and numpy.matrix (its operators). Other subclasses (memmap,
 * recarray, user subclasses) are accepted; their chunks and gathered results
 * are plain ndarrays. Returns 1 for a refused one (with TypeError naming
 * argname and what to do when argname is not NULL; no exception when it is
 * NULL), 0 otherwise, -1 with an exception set. */
int dp_refused_array_subclass(PyObject *obj, const char *argname);

/* obj (ndarray, dpmini.Array, foreign array, buffer-protocol object or
 * __array_interface__ object) as an ndarray without a copy (a shadow for GPU
 * memory; see dp_import_foreign for the exceptions). Refuses object dtypes and, with min_ndim 1,
 * 0-dim arrays (dp_raise_zero_dim). */
PyArrayObject *dp_as_array(dp_state *st, PyObject *obj, const char *argname,
                           int min_ndim);

/* dpmini.ZeroDimError "argname: chunk expects at least a 1-dimensional tensor
 * (got a 0-dim array) ...", PyTorch's words (docs/spec.md 10.3). Always -1. */
int dp_raise_zero_dim(dp_state *st, const char *argname);

/* Parse a Python int dim and wrap it against ndim (IndexError "Dimension out
 * of range (expected to be in range of [-r, r-1], but got d)" naming
 * argname). */
int dp_wrap_dim_or_raise(int dim, int ndim, const char *argname, int *out);

/* hasattr(obj, name) that lets errors other than AttributeError through (an
 * __array_interface__ property raising KeyboardInterrupt, say): 1, 0, or -1
 * with an exception set. */
int dp_has_attr(PyObject *obj, const char *name);

/* The one conversion of integer arguments (dims, chunk sizes, in_dims and
 * out_dims entries, buffer sizes). Accepted: int and anything with
 * __index__ (NumPy integer scalars of every width, 0-dim integer arrays, as
 * operator.index accepts them). Refused with TypeError "argname: expected
 * an int, got T": bool (Python or NumPy), floats, arrays with dimensions
 * (whatever their size). A value outside [lo, hi] (huge ints, uint64 past
 * int64) is a ValueError "argname: V is out of range (expected an int from
 * lo to hi)". dp_is_index_like says whether obj is of an accepted kind
 * (without calling __index__). */
int dp_is_index_like(PyObject *obj);
int dp_index_from_object(PyObject *obj, const char *argname, long long lo, long long hi,
                         long long *out);

/* dp_index_from_object with the int32 range of a dim. */
int dp_int_from_object(PyObject *obj, const char *argname, int *out);

/* The one conversion of real-number arguments (weights): int, float, NumPy
 * integer and float scalars, 0-dim such arrays, and other objects with
 * __float__ (Fraction, Decimal). Refused with TypeError: bool, complex,
 * str, arrays with dimensions; an int too large for a float64 is a
 * ValueError naming argname. */
int dp_real_from_object(PyObject *obj, const char *argname, double *out);

/* A type's name as written in Python (numpy.int64, mylib.ndarray), for
 * messages. New reference. */
PyObject *dp_type_name(PyObject *obj);

/* TypeError for an out= argument that is not an ndarray or a GPU array,
 * naming its full type (mylib.ndarray, not a bare "ndarray") and what to
 * pass instead. Always -1. */
int dp_refuse_out_array(PyObject *obj, const char *argname);

/* ------------------------------------------------------------------ */
/* Arrays of other libraries (interop.c)                               */
/* ------------------------------------------------------------------ */

/* Does obj (not an ndarray, not a dpmini.Array) export __dlpack__ with
 * __dlpack_device__, or __cuda_array_interface__ (PyTorch, JAX, CuPy)?
 * 1/0; -1 when looking a protocol up raised something other than
 * AttributeError (re-raised, same type, naming the protocol and the type;
 * callers prefix the path with dp_reraise_at). */
int dp_is_foreign_array(dp_state *st, PyObject *obj);

/* Re-raise the pending Exception (same type, the original as __cause__) as
 * "<path>: <message>", unless the message starts with path already.
 * BaseExceptions that are not Exceptions pass as they are. */
void dp_reraise_at(dp_state *st, PyObject *path);

/* Re-raise the pending Exception as the same type with message msg (a str,
 * stolen; it names the path), the original as __cause__; st may be NULL
 * (a KeyError's str is then its repr). BaseExceptions that are not
 * Exceptions pass as they are; a type that cannot be built from one message
 * stays as it was. */
void dp_reraise_msg(dp_state *st, PyObject *msg);

/* Make cause (stolen; may be NULL) the __cause__ (and __context__) of the
 * pending exception, as `raise new from cause` does; with nothing pending
 * it only drops cause. */
void dp_attach_cause(PyObject *cause);

/* A foreign array as an ndarray (host memory: numpy.from_dlpack, a view) or
 * a shadow ndarray (CUDA memory, array.c's import), without a copy; a JAX
 * array sharded over several JAX devices is read with numpy.asarray (a
 * copy). TypeError naming argname for a tensor that requires grad, a device
 * dpmini cannot read, or a producer that fails. */
PyArrayObject *dp_import_foreign(dp_state *st, PyObject *obj, const char *argname);

/* dp_import_foreign for reading where obj's memory lives (device_of,
 * parallel_apply's choice of devices), not for copying it: a tensor that
 * requires grad is read detached (the same memory) whatever the grad mode. */
PyArrayObject *dp_import_foreign_detached(dp_state *st, PyObject *obj, const char *argname);

/* The name of obj's DLPack dtype ("bfloat16", "complex32", "float8_e4m3fn")
 * in buf when NumPy has no such dtype, else NULL (also when obj's
 * __dlpack__() fails). Never leaves an exception (interop_dtype.c). */
const char *dp_dlpack_dtype_missing(PyObject *obj, char *buf, size_t n);

/* Is d one of ml_dtypes' dtypes (bfloat16, float8_*, int4, ...)? They are
 * recognised by their scalar type's module, not by kind or type number
 * (both are assigned at run time; interop_dtype.c). */
int dp_dtype_is_ml(PyArray_Descr *d);

/* The dtype that sums of d accumulate in (new reference): float32 for
 * ml_dtypes' floating dtypes (bfloat16, float8, float6, float4), complex64
 * for its complex32; the sum is rounded to d once at the end. NULL (no
 * exception) for every other dtype, which sums in itself
 * (interop_dtype.c). */
PyArray_Descr *dp_sum_descr(PyArray_Descr *d);

/* For a dtype mismatch message: a note (static text) saying that got is want
 * in the other byte order, or "" when the two differ otherwise or are
 * equivalent. Never leaves an exception (interop_dtype.c). */
const char *dp_byteorder_note(PyArray_Descr *want, PyArray_Descr *got);

/* The converter back into obj's library (new reference): that library's
 * from_dlpack (torch, jax.numpy, cupy, else array_api_compat's namespace or
 * the type's package), or Py_None for NumPy, dpmini.Array and libraries with
 * none. Cached per type. */
PyObject *dp_array_origin(dp_state *st, PyObject *obj);

/* origin(arr): arr (stolen; ndarray or dpmini.Array) in the origin's
 * library, sharing its memory; arr itself when origin is NULL or None, and
 * a host ndarray the library refuses (CuPy holds GPU memory only) stays an
 * ndarray. Other errors name argname. */
PyObject *dp_to_origin(dp_state *st, PyObject *origin, PyObject *arr, const char *argname);

/* dp_to_origin on each of items[0..n) in place; -1 leaves the failed slot
 * NULL (the others as they are, owned by the caller). */
int dp_convert_all(dp_state *st, PyObject *origin, PyObject **items, Py_ssize_t n,
                   const char *argname);

/* torch.is_grad_enabled() in this thread: 1/0; -1 when torch is not
 * imported (never an exception). */
int dp_torch_grad_enabled(void);

/* When torch is imported and its adapter not loaded yet: import
 * dpmini._torch, which registers torch's replica context provider
 * (parallel_apply.c). 0, or -1 with the import's error. */
int dp_torch_context_load(dp_state *st);

/* torch's host tensors without DLPack's Python layers (interop_torch.c).
 * dp_torch_host_view: obj.numpy() for a torch.Tensor or nn.Parameter (exact
 * types) on the CPU whose dtype NumPy has: the same view of the same memory
 * numpy.from_dlpack(obj) gives. NULL with no error when that does not apply
 * (the caller then takes the DLPack path); NULL with an error only for an
 * exception that is not an Exception (KeyboardInterrupt). */
PyArrayObject *dp_torch_host_view(dp_state *st, PyObject *obj);
/* dp_torch_from_host: torch.from_numpy(arr) when origin is torch.from_dlpack
 * and arr a native, aligned, writeable ndarray of a dtype torch has, with
 * non-negative strides: the tensor torch.from_dlpack(arr) gives (same
 * memory). NULL with no error when that does not apply or torch refuses; the
 * caller then takes from_dlpack. arr is borrowed. */
PyObject *dp_torch_from_host(dp_state *st, PyObject *origin, PyArrayObject *arr);

/* Is obj a torch.nn.Module instance (only looked up when torch.nn is
 * imported)? 1/0/-1. */
int dp_is_torch_module(PyObject *obj);

/* dpmini._torch.<name>(*args, **kwargs) (kwargs may be NULL): the
 * torch-specific rules (autograd, nn.Module replicas) live in Python. */
PyObject *dp_torch_call(const char *name, PyObject *args, PyObject *kwargs);

/* After an entry point returned NULL: when the pending exception is
 * st->RequiresGradError (a tensor that requires grad, grad mode on), clear
 * it and return dpmini._torch.<name>(*args, **kwargs), the differentiable
 * form of the same call; otherwise NULL with the exception left pending. */
PyObject *dp_autograd_retry(dp_state *st, const char *name, PyObject *args, PyObject *kwargs);

/* A module-level entry point: steps(m, args, kw) inside one span of phase
 * (a DP_PROF_* kind of core/profile.h) under dpmini.profile(); when it fails
 * because a torch tensor requires grad in grad mode, the call goes to its
 * differentiable form dpmini._torch.<torch_name> (dp_autograd_retry). */
typedef struct dp_entry {
    PyCFunctionWithKeywords steps; /* the call itself */
    int phase;                     /* DP_PROF_* */
    const char *label;             /* the span's label, or NULL */
    const char *torch_name;        /* the function of dpmini._torch */
    const char *const *structures; /* dp_freeze_iterators' structure parameters */
} dp_entry;
PyObject *dp_entry_call(PyObject *m, PyObject *args, PyObject *kw, const dp_entry *e);

/* args and kw (kw may be NULL) with each argument that is a one-shot
 * iterator (a generator, map, iter(x)) replaced by the tuple of its items,
 * so that a call that may run twice (dp_autograd_retry) reads the same
 * values both times. The structure parameters (NULL-terminated names of
 * the call's first parameters, in order; NULL for none), such as
 * scatter's inputs, where an iterator is one object handed to every
 * replica, are left as given. 0 with new references in *args_out and
 * *kw_out (NULL when kw is), or -1. */
int dp_freeze_iterators(PyObject *args, PyObject *kw, const char *const *structures,
                        PyObject **args_out, PyObject **kw_out);

/* once(m, args, kw) on dp_freeze_iterators' arguments, and its
 * differentiable form dpmini._torch.<torch_name> on the same ones when it
 * failed for a tensor that requires grad (dp_autograd_retry). */
PyObject *dp_call_with_retry(PyObject *m, PyObject *args, PyObject *kw,
                             PyCFunctionWithKeywords once, const char *torch_name,
                             const char *const *structures);

/* After replicate's broadcast, one device's row (a list, changed in place):
 * an entry that is the import itself (already on that device) becomes the
 * original leaf; any other goes back into its library (origins[i]). */
int dp_replicas_leaves(dp_state *st, PyObject *row, PyObject *imported, PyObject *leaves,
                       PyObject *origins);

/* A comm function's result (stolen) in the library of `like` (the input
 * array; with from_seq, the first item of the input sequence): an array, or
 * each item of a tuple/list result. NumPy / dpmini / unknown: as it is. */
PyObject *dp_comm_back(dp_state *st, PyObject *like, int from_seq, PyObject *result);

/* broadcast_coalesced's rows (stolen list of lists): entry i of each row in
 * the library of arrays[i]. */
PyObject *dp_comm_back_rows(dp_state *st, PyObject *arrays, PyObject *rows);

/* "numpy.ndarray", "dpmini.Array", "torch.Tensor", "jax.Array", "cupy.ndarray". */
PyObject *dp_array_type_name(dp_state *st, PyObject *obj);

/* "torch.Tensor cpu", "cupy.ndarray cuda:0", "numpy.ndarray cpu:1": the type
 * name and the device of arr (obj imported). */
PyObject *dp_array_describe(dp_state *st, PyObject *obj, PyArrayObject *arr);

/* ------------------------------------------------------------------ */
/* GPU arrays and memory (array.c, gpu_error.c; see gpu.h, cuda_api.h) */
/* ------------------------------------------------------------------ */

/* Inside the C core a GPU array is a "shadow" ndarray: dtype, shape and byte
 * strides as NumPy keeps them, data = the DEVICE pointer, base chain ending
 * in a CUDA dpmini._Buffer (owned memory, or a borrowed one that keeps an
 * imported producer alive). dp_array_device() says DP_CUDA for it. A shadow
 * never reaches Python code or NumPy's data-touching functions: every public
 * exit passes results through dp_export, which wraps shadows as
 * dpmini.Array. */
typedef struct {
    PyObject_HEAD
    PyArrayObject *meta;  /* the shadow ndarray (strong, never NULL)  */
    dp_device dev;        /* its device (DP_CUDA)                     */
} dp_ArrayObject;

#include "cuda_api.h"

/* The one funnel from a failed dpc_status to a Python exception:
 * dpmini.CudaError / NcclError (with .status = the library's code) naming op,
 * the device, the call and the library's message; MemoryError for an
 * out-of-memory. A sticky CUDA error's message says the context is
 * corrupted and the process must restart (recoverable errors were already
 * cleared on the failing thread by CUDA_TRY). Returns -1. */
int dp_gpu_raise(dp_state *st, dpc_status s, const char *op);

/* obj, stolen: a shadow ndarray on a GPU becomes a dpmini.Array; anything
 * else is returned as is. NULL passes through. */
PyObject *dp_export(dp_state *st, PyObject *obj);

/* A device-array object: a dpmini.Array, or any object exposing
 * __cuda_array_interface__ (CuPy, PyTorch CUDA tensors, Numba) or a CUDA
 * __dlpack_device__. Returns 1/0 (never fails, no exception left set). Only
 * AttributeError means "no such protocol": an object whose protocol raises
 * anything else answers 1, so dp_device_object_meta raises it naming the
 * argument. */
int dp_is_device_object(dp_state *st, PyObject *obj);

/* The shadow ndarray of a device-array object (new reference): a
 * dpmini.Array's own, or a zero-copy import that keeps obj alive (DLPack
 * first when __dlpack_device__ is CUDA, so the producer can order its work
 * before our stream; else the CUDA Array Interface). NULL with an exception
 * naming argname (TypeError/BufferError, or the producer's own error). */
PyArrayObject *dp_device_object_meta(dp_state *st, PyObject *obj, const char *argname);

/* A buffer on CUDA device d that does not own ptr but keeps owner alive
 * (imports). */
PyObject *dp_buffer_wrap(dp_state *st, dp_device d, void *ptr, size_t nbytes,
                         PyObject *owner);

/* nbytes of page-locked host memory as a host buffer (pin_memory=True). */
PyObject *dp_buffer_new_pinned(dp_state *st, size_t nbytes);

/* numpy_allocator.c: 1 unless $DPMINI_NUMPY_ALLOCATOR is 0 (or NumPy's
 * headers predate NEP 49's API): read once a call, not once a replica
 * (getenv scans the environment). */
int dp_numpy_allocator_enabled(void);
/* numpy_allocator.c: the NumPy data allocator (NEP 49 handler capsule) for
 * replicas on dev, new reference: device dev's caching allocator when dev is
 * a virtual CPU device, else None. NULL with an exception. GIL held. */
PyObject *dp_numpy_allocator(dp_state *st, dp_device dev);
/* numpy_allocator.c: make handler (from dp_numpy_allocator; None: nothing)
 * NumPy's allocator in the current context. 0, or -1 with an exception. */
int dp_numpy_allocator_enter(PyObject *handler);

/* ------------------------------------------------------------------ */
/* Method tables and type specs of py/ (module/module.c adds them)     */
/* ------------------------------------------------------------------ */

extern PyMethodDef dp_device_methods[];       /* device.c   */
extern PyMethodDef dp_array_methods[];        /* array.c    */
extern PyMethodDef dp_profile_methods[];      /* profile_py.c */
extern PyType_Spec dp_array_spec;             /* array.c    */
extern PyType_Spec dp_device_spec;            /* device.c   */
extern PyType_Spec dp_buffer_spec;            /* device.c   */
extern PyType_Spec dp_host_dlpack_spec;       /* host_dlpack.c */

#endif
