/* parallel_apply_errors.c - a replica's exception: taken with its traceback
 * on the worker, re-raised on the caller as "Caught T in replica i on device
 * d." (docs/spec.md 6.5) (parallel_apply.h).
 */
#include "dpmini.h"
#include "dataparallel.h"
#include "parallel_apply.h"

#include <string.h>

/* ------------------------------------------------------------------ */
/* Helpers: exceptions                                                 */
/* ------------------------------------------------------------------ */

/* The exception being raised, as an instance with its traceback attached
 * (new reference); the error indicator is cleared. Never NULL. */
PyObject *replica_take_exception(void)
{
    PyObject *exc;
    if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_SystemError, "a replica failed without setting an exception");
    }
#if PY_VERSION_HEX >= 0x030C0000
    exc = PyErr_GetRaisedException();
#else
    PyObject *type, *tb;
    PyErr_Fetch(&type, &exc, &tb);
    PyErr_NormalizeException(&type, &exc, &tb);
    if (exc != NULL && tb != NULL) {
        PyException_SetTraceback(exc, tb);
    }
    Py_XDECREF(type);
    Py_XDECREF(tb);
    if (exc == NULL) {
        exc = PyObject_CallNoArgs(PyExc_SystemError);
        if (exc == NULL) {   /* out of memory: keep whatever that raised */
            return replica_take_exception();
        }
    }
#endif
    return exc;
}

/* Raise exc again (steals the reference). */
void restore_exception(PyObject *exc)
{
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(exc);
#else
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), exc, PyException_GetTraceback(exc));
#endif
}

/* msg as a str whose repr() is itself, so that str(KeyError(m)) shows the
 * text unquoted (PyTorch's KeyErrorMessage, docs/spec.md 6.5): an instance of the
 * module's dpmini._dpmini._KeyErrorMessage, which pickles by name. Falls
 * back to msg. */
static PyObject *keyerror_message(dp_state *st, PyObject *msg)
{
    PyObject *res = PyObject_CallOneArg(st->KeyErrorMessage, msg);
    if (res == NULL) {
        PyErr_Clear();
        res = Py_NewRef(msg);
    }
    return res;
}

/* Re-raise exc, raised by replica i on dev, as PyTorch's ExceptionWrapper
 * does (docs/spec.md 6.5): same type, message "Caught T in replica i on device d.\n
 * Original Traceback (most recent call last):\n...", the original as
 * __cause__; RuntimeError when the type cannot be built from one string.
 * Exceptions that are not Exception subclasses (KeyboardInterrupt,
 * SystemExit) are re-raised unchanged. */
void raise_replica_error(dp_state *st, PyObject *exc, Py_ssize_t i, dp_device dev)
{
    PyObject *tp = (PyObject *)Py_TYPE(exc);
    PyObject *tb = NULL, *lines = NULL, *empty = NULL, *text = NULL, *name = NULL;
    PyObject *msg = NULL, *arg = NULL, *attr = NULL, *kw = NULL, *noargs = NULL;
    PyObject *wrapped = NULL;
    char devbuf[32];

    if (!PyObject_IsInstance(exc, PyExc_Exception)) {
        restore_exception(Py_NewRef(exc));
        return;
    }
    dp_device_format(dev, devbuf, sizeof devbuf);

    tb = PyException_GetTraceback(exc);
    lines = PyObject_CallFunctionObjArgs(st->format_exception, tp, exc,
                                         tb ? tb : Py_None, NULL);
    empty = PyUnicode_FromStringAndSize(NULL, 0);
    if (lines != NULL && empty != NULL) {
        text = PyUnicode_Join(empty, lines);
    }
    if (text == NULL) {   /* formatting failed: fall back to str(exc) */
        PyErr_Clear();
        text = PyUnicode_FromFormat("%s: %S\n", ((PyTypeObject *)tp)->tp_name, exc);
        if (text == NULL) {
            goto fail;
        }
    }
    name = PyObject_GetAttrString(tp, "__name__");
    if (name == NULL) {
        goto fail;
    }
    {
        static const char head[] = "Traceback (most recent call last):\n";
        PyObject *prefix = PyUnicode_FromString(head);
        if (prefix == NULL) {
            goto fail;
        }
        Py_ssize_t starts = PyUnicode_Tailmatch(text, prefix, 0, PY_SSIZE_T_MAX, -1);
        if (starts < 0) {
            Py_DECREF(prefix);
            goto fail;
        }
        if (starts) {
            msg = PyUnicode_FromFormat("Caught %U in replica %zd on device %s.\nOriginal %U",
                                       name, i, devbuf, text);
        } else {   /* no Python frame (e.g. a builtin replica): keep the shape */
            msg = PyUnicode_FromFormat("Caught %U in replica %zd on device %s.\nOriginal %U%U",
                                       name, i, devbuf, prefix, text);
        }
        Py_DECREF(prefix);
    }
    if (msg == NULL) {
        goto fail;
    }

    if (tp == PyExc_KeyError) {
        arg = keyerror_message(st, msg);
    } else {
        arg = Py_NewRef(msg);
    }
    attr = PyObject_GetAttrString(tp, "message");
    if (attr == NULL) {
        PyErr_Clear();
    }
    if (attr != NULL && PyObject_IsTrue(attr) == 1) {
        noargs = PyTuple_New(0);
        kw = Py_BuildValue("{sO}", "message", arg);
        if (noargs != NULL && kw != NULL) {
            wrapped = PyObject_Call(tp, noargs, kw);
        }
    } else {
        PyErr_Clear();
        wrapped = PyObject_CallOneArg(tp, arg);
    }
    if (wrapped != NULL && !PyExceptionInstance_Check(wrapped)) {
        Py_CLEAR(wrapped);
    }
    if (wrapped == NULL) {
        if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_Exception)) {
            goto fail;   /* e.g. KeyboardInterrupt while building it: keep it */
        }
        PyErr_Clear();
        wrapped = PyObject_CallOneArg(PyExc_RuntimeError, msg);
        if (wrapped == NULL) {
            goto fail;
        }
    }
    PyException_SetCause(wrapped, Py_NewRef(exc));
    PyErr_SetObject((PyObject *)Py_TYPE(wrapped), wrapped);
fail:
    Py_XDECREF(tb);
    Py_XDECREF(lines);
    Py_XDECREF(empty);
    Py_XDECREF(text);
    Py_XDECREF(name);
    Py_XDECREF(msg);
    Py_XDECREF(arg);
    Py_XDECREF(attr);
    Py_XDECREF(kw);
    Py_XDECREF(noargs);
    Py_XDECREF(wrapped);
}
