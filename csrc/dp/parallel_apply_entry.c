/* parallel_apply_entry.c - parallel_apply's arguments and entry points:
 * one replica's positional and keyword arguments, the device of each
 * replica, parallel_apply_run (DataParallel.forward / .parallel_apply) and
 * the module-level dpmini.parallel_apply. The calls run in parallel_apply.c.
 */
#include "dpmini.h"
#include "dataparallel.h"
#include "parallel_apply.h"
#include "dp.h"
#include "profile.h"

#include <string.h>

#define DP_SMALL_JOBS 8                  /* replicas without heap memory */

/* ------------------------------------------------------------------ */
/* Helpers: arguments                                                  */
/* ------------------------------------------------------------------ */

/* One replica's positional arguments as an exact tuple (new reference):
 * a list or tuple is unpacked, anything else becomes (input,) (docs/spec.md 6.3). */
PyObject *input_as_args(PyObject *input)
{
    if (PyTuple_CheckExact(input)) {
        return Py_NewRef(input);
    }
    if (PyTuple_Check(input) || PyList_Check(input)) {
        return PySequence_Tuple(input);
    }
    return PyTuple_Pack(1, input);
}

/* One replica's keyword arguments as an exact dict or NULL (*out, new
 * reference). None is no keywords. */
int kwargs_as_dict(PyObject *kw, const char *what, Py_ssize_t i, PyObject **out)
{
    *out = NULL;
    if (kw == NULL || kw == Py_None) {
        return 0;
    }
    if (PyDict_CheckExact(kw)) {
        *out = Py_NewRef(kw);
        return 0;
    }
    if (!PyMapping_Check(kw) || PySequence_Check(kw)) {
        PyErr_Format(PyExc_TypeError, "%s[%zd]: expected a dict of keyword arguments, got %.100s",
                     what, i, Py_TYPE(kw)->tp_name);
        return -1;
    }
    PyObject *d = PyDict_New();
    if (d == NULL || PyDict_Update(d, kw) < 0) {
        Py_XDECREF(d);
        return -1;
    }
    *out = d;
    return 0;
}

/* ------------------------------------------------------------------ */
/* Helpers: devices                                                    */
/* ------------------------------------------------------------------ */

/* The device a replica runs on when none is given: the device of the first
 * array among its top-level arguments, else entry i of the default list. */
static int auto_device(dp_state *st, PyObject *args, Py_ssize_t i,
                       dp_device **defaults, Py_ssize_t *ndefaults, dp_device *out)
{
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(args); j++) {
        PyObject *a = PyTuple_GET_ITEM(args, j);
        int r = dp_is_array_leaf(st, a);
        if (r < 0 && PyErr_Occurred()) {
            PyObject *path = PyUnicode_FromFormat("inputs[%zd][%zd]", i, j);
            dp_reraise_at(st, path);   /* a protocol probe raised: name it */
            Py_XDECREF(path);
            return -1;
        }
        if (r > 0) {
            PyArrayObject *aa = dp_as_array(st, a, "args", 0); /* GPU arrays: the shadow */
            if (aa == NULL) {
                return -1;
            }
            dp_device d = dp_array_device(st, aa);
            Py_DECREF(aa);
            if (d.kind != DP_HOST) {
                *out = d;
                return 0;
            }
            break;
        }
    }
    if (*defaults == NULL && dp_default_devices(st, defaults, ndefaults) < 0) {
        return -1;
    }
    *out = (*defaults)[i % *ndefaults];
    return 0;
}

/* parallel_apply over Python sequences. Devices come from cdevs (ncdevs
 * entries, must equal the module count) when given, else from `devices`
 * (None or a sequence, None entries allowed), else auto_device. */
static PyObject *parallel_apply_run_steps(dp_state *st, PyObject *modules, PyObject *inputs,
                                          PyObject *kwargs_tup, PyObject *devices,
                                          const dp_device *cdevs, Py_ssize_t ncdevs)
{
    PyObject *mods = NULL, *ins = NULL, *kws = NULL, *devseq = NULL, *result = NULL;
    apply_job small[DP_SMALL_JOBS];
    apply_job *jobs = small;
    dp_device *defaults = NULL;
    Py_ssize_t ndefaults = 0, m = 0;

    mods = PySequence_Fast(modules, "parallel_apply: modules must be a sequence of callables");
    if (mods == NULL) {
        goto fail;
    }
    m = PySequence_Fast_GET_SIZE(mods);
    ins = PySequence_Fast(inputs, "parallel_apply: inputs must be a sequence (one entry per module)");
    if (ins == NULL) {
        m = 0;
        goto fail;
    }
    if (PySequence_Fast_GET_SIZE(ins) != m) {
        PyErr_Format(PyExc_ValueError,
                     "parallel_apply: the number of modules (%zd) is not equal to the number "
                     "of inputs (%zd)", m, PySequence_Fast_GET_SIZE(ins));
        m = 0;
        goto fail;
    }
    if (kwargs_tup != NULL && kwargs_tup != Py_None) {
        kws = PySequence_Fast(kwargs_tup, "parallel_apply: kwargs_tup must be a sequence of dicts");
        if (kws == NULL || PySequence_Fast_GET_SIZE(kws) != m) {
            if (kws != NULL) {
                PyErr_Format(PyExc_ValueError,
                             "parallel_apply: the number of modules (%zd) is not equal to the "
                             "number of kwargs_tup entries (%zd)", m, PySequence_Fast_GET_SIZE(kws));
            }
            m = 0;
            goto fail;
        }
    }
    if (cdevs != NULL) {
        if (ncdevs != m) {
            PyErr_Format(PyExc_ValueError,
                         "parallel_apply: the number of modules (%zd) is not equal to the "
                         "number of devices (%zd)", m, ncdevs);
            m = 0;
            goto fail;
        }
    } else if (devices != NULL && devices != Py_None) {
        devseq = PySequence_Fast(devices, "parallel_apply: devices must be a sequence of devices");
        if (devseq == NULL || PySequence_Fast_GET_SIZE(devseq) != m) {
            if (devseq != NULL) {
                PyErr_Format(PyExc_ValueError,
                             "parallel_apply: the number of modules (%zd) is not equal to the "
                             "number of devices (%zd)", m, PySequence_Fast_GET_SIZE(devseq));
            }
            m = 0;
            goto fail;
        }
    }
    if (m > DP_SMALL_JOBS) {
        jobs = PyMem_Calloc((size_t)m, sizeof *jobs);
        if (jobs == NULL) {
            jobs = small;
            m = 0;
            PyErr_NoMemory();
            goto fail;
        }
    } else {
        memset(small, 0, sizeof small);
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        apply_job *job = &jobs[i];
        job->module = Py_NewRef(PySequence_Fast_GET_ITEM(mods, i));
        job->args = input_as_args(PySequence_Fast_GET_ITEM(ins, i));
        if (job->args == NULL) {
            goto fail;
        }
        if (kws != NULL &&
            kwargs_as_dict(PySequence_Fast_GET_ITEM(kws, i), "kwargs_tup", i, &job->kwargs) < 0) {
            goto fail;
        }
        PyObject *dev = devseq ? PySequence_Fast_GET_ITEM(devseq, i) : Py_None;
        if (cdevs != NULL) {
            job->dev = cdevs[i];
        } else if (dev != Py_None) {
            char name[40];
            snprintf(name, sizeof name, "devices[%zd]", i);
            if (dp_device_from_object(st, dev, name, 0, &job->dev) < 0) {
                goto fail;
            }
        } else if (auto_device(st, job->args, i, &defaults, &ndefaults, &job->dev) < 0) {
            goto fail;
        }
    }
    result = run_jobs(st, jobs, m);
fail:
    for (Py_ssize_t i = 0; i < m; i++) {
        job_clear(&jobs[i]);
    }
    if (jobs != small) {
        PyMem_Free(jobs);
    }
    PyMem_Free(defaults);
    Py_XDECREF(mods);
    Py_XDECREF(ins);
    Py_XDECREF(kws);
    Py_XDECREF(devseq);
    return result;
}

/* parallel_apply_run under dpmini.profile(): one span around it (profile.h). */
PyObject *parallel_apply_run(dp_state *st, PyObject *modules, PyObject *inputs,
                             PyObject *kwargs_tup, PyObject *devices,
                             const dp_device *cdevs, Py_ssize_t ncdevs)
{
    dp_prof_span sp;
    dp_prof_begin(&sp, DP_PROF_APPLY);
    PyObject *res = parallel_apply_run_steps(st, modules, inputs, kwargs_tup, devices, cdevs,
                                             ncdevs);
    dp_prof_end(&sp, NULL);
    return res;
}

/* ------------------------------------------------------------------ */
/* Public functions: module level                                      */
/* ------------------------------------------------------------------ */

PyDoc_STRVAR(parallel_apply_doc,
"parallel_apply(modules, inputs, kwargs_tup=None, devices=None)\n--\n\n"
"Returns a list with one result per module.\n"
"Call modules[i](*inputs[i], **kwargs_tup[i]) for every i, each on the\n"
"persistent worker thread of devices[i] (PyTorch parallel_apply, docs/spec.md 6);\n"
"return the results as a list in index order (docs/spec.md 6.4).\n"
"inputs[i]: a list or tuple is unpacked, anything else is passed as the one\n"
"positional argument. kwargs_tup: None (no keywords) or one dict per module.\n"
"devices: None, or one device per module (None entries allowed); a missing\n"
"device is that of the first array among inputs[i]'s top-level items when\n"
"it lives on a device, else entry i of the default device list.\n"
"Each worker holds the GIL while it runs Python code and enters a copy of\n"
"the caller's contextvars context (numpy.errstate etc. apply, like PyTorch\n"
"copying grad mode, docs/spec.md 6.2). With one module, or when called from inside\n"
"a replica running on a worker, the calls run inline in the caller thread.\n"
"Replicas sharing a device (e.g. ['cpu:0', 'cpu:0']) run at the same time on\n"
"threads of that device (like PyTorch's one thread per replica; the GIL is\n"
"shared as usual). Ctrl-C while waiting raises KeyboardInterrupt in\n"
"the running replicas, waits for them, and re-raises it.\n"
"With two or more replicas on virtual CPU devices, the BLAS thread pools\n"
"(OpenBLAS, MKL, BLIS; found with threadpoolctl) run with cores // replicas\n"
"threads (at least 1) until every replica has finished, then get their\n"
"counts back, so\n"
"replicas x BLAS threads <= cores; DPMINI_BLAS_LIMIT=0 turns this off\n"
"(dpmini/_blas.py; PyTorch does not do this).\n"
"NumPy arrays of 256 KiB and more (np.zeros aside) that a replica on a\n"
"worker of virtual CPU device cpu:i makes come from cpu:i's caching\n"
"allocator (NumPy's NEP 49 handler, set in the replica's context copy only;\n"
"as PyTorch replicas on GPUs use the CUDA caching allocator): no page\n"
"faults for reused temporaries; DPMINI_NUMPY_ALLOCATOR=0 turns this off.\n"
"Errors: ValueError 'parallel_apply: the number of modules (M) is not equal\n"
"to the number of inputs (N)' (likewise kwargs_tup and devices); the first\n"
"failing replica (lowest index) is re-raised with its type and the message\n"
"'Caught T in replica i on device d.\\nOriginal Traceback (most recent call\n"
"last):\\n...', the original exception as __cause__ (RuntimeError when T\n"
"cannot be built from one string). RuntimeError, before any replica runs,\n"
"for more than 1024 replicas on one device (they run at once, one worker\n"
"thread each) and for a call during interpreter finalization\n"
"(sys.is_finalizing(); as concurrent.futures); RuntimeError when a worker\n"
"thread cannot be started (out of memory, address space or threads) and\n"
"MemoryError when its Python thread state cannot be made.");

static PyObject *dp_parallel_apply(PyObject *mod, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"modules", "inputs", "kwargs_tup", "devices", NULL};
    PyObject *modules, *inputs, *kw = Py_None, *devices = Py_None;
    dp_state *st = dp_state_from_module(mod);
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|OO:parallel_apply", kwlist,
                                     &modules, &inputs, &kw, &devices)) {
        return NULL;
    }
    return parallel_apply_run(st, modules, inputs, kw, devices, NULL, 0);
}


PyMethodDef dp_parallel_apply_methods[] = {
    {"parallel_apply", (PyCFunction)(void (*)(void))dp_parallel_apply,
     METH_VARARGS | METH_KEYWORDS, parallel_apply_doc},
    {NULL, NULL, 0, NULL},
};
