/* dataparallel_state_dict.c - DataParallel.state_dict / load_state_dict:
 * the module's entries with the "module." level that torch.nn.DataParallel's
 * keys carry (spec 1.8), loaded back with nn.Module's messages. The other
 * forwarded nn.Module methods are in dataparallel_module.c.
 */
#include "dataparallel_type.h"

/* state_dict(*, destination=None, prefix='', keep_vars=False): the module's
 * entries under prefix + "module." (spec 1.8). */
PyObject *dp_DataParallel_state_dict(dp_DataParallelObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"destination", "prefix", "keep_vars", NULL};
    PyObject *destination = Py_None, *prefix = NULL, *keep_vars = Py_False;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|OUO:state_dict", kwlist, &destination,
                                     &prefix, &keep_vars)) {
        return NULL;
    }
    /* nn.Module.state_dict still takes them positionally, with a FutureWarning */
    if (PyTuple_GET_SIZE(args) > 0 &&
        PyErr_WarnEx(PyExc_FutureWarning,
                     "DataParallel.state_dict: positional arguments are deprecated (as in "
                     "torch.nn.Module.state_dict); pass destination=, prefix=, keep_vars= "
                     "by keyword", 1) < 0) {
        return NULL;
    }
    PyObject *full = prefix == NULL ? PyUnicode_FromString("module.")
                                    : PyUnicode_FromFormat("%Umodule.", prefix);
    if (full == NULL) {
        return NULL;
    }
    PyObject *kw = Py_BuildValue("{sOsOsO}", "destination", destination, "prefix", full,
                                 "keep_vars", keep_vars);
    Py_DECREF(full);
    if (kw == NULL) {
        return NULL;
    }
    PyObject *res = dp_wrapper_forward_call(self, "state_dict", NULL, kw);
    Py_DECREF(kw);
    return res;
}

/* ", "-joined '"key"' items of a list, as nn.Module's load_state_dict message. */
static PyObject *quoted_keys(PyObject *keys)
{
    PyObject *parts = PyList_New(0), *sep = NULL, *res = NULL;
    for (Py_ssize_t i = 0; parts != NULL && i < PyList_GET_SIZE(keys); i++) {
        PyObject *q = PyUnicode_FromFormat("\"%S\"", PyList_GET_ITEM(keys, i));
        if (q == NULL || PyList_Append(parts, q) < 0) {
            Py_XDECREF(q);
            Py_CLEAR(parts);
            break;
        }
        Py_DECREF(q);
    }
    if (parts != NULL && (sep = PyUnicode_FromString(", ")) != NULL) {
        res = PyUnicode_Join(sep, parts);
    }
    Py_XDECREF(parts);
    Py_XDECREF(sep);
    return res;
}

/* 1 when key is a str starting with "module." (the wrapper's level). */
static int has_module_prefix(PyObject *key)
{
    static const char prefix[] = "module.";
    if (!PyUnicode_Check(key) || PyUnicode_GET_LENGTH(key) < 7) {
        return 0;
    }
    for (Py_ssize_t i = 0; i < 7; i++) {
        if (PyUnicode_READ_CHAR(key, i) != (Py_UCS4)(unsigned char)prefix[i]) {
            return 0;
        }
    }
    return 1;
}

/* load_state_dict(state_dict, strict=True, assign=False): keys must carry the
 * "module." prefix that state_dict() gives; the module loads the rest with
 * strict=False and the missing/unexpected keys are reported here, prefixed,
 * in nn.Module's words ("Error(s) in loading state_dict for DataParallel"). */
PyObject *dp_DataParallel_load_state_dict(dp_DataParallelObject *self, PyObject *args,
                                    PyObject *kwargs)
{
    static char *kwlist[] = {"state_dict", "strict", "assign", NULL};
    PyObject *sd;
    int strict = 1, assign = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|pp", kwlist, &sd, &strict, &assign)) {
        return NULL;
    }
    PyObject *m = dp_wrapper_module_method(self, "load_state_dict");
    if (m == NULL) {
        return NULL;
    }
    Py_DECREF(m);
    int is_mapping = PyDict_Check(sd);
    if (!is_mapping) {   /* collections.abc.Mapping, as nn.Module.load_state_dict checks */
        PyObject *abc = PyImport_ImportModule("collections.abc");
        PyObject *mapping = abc == NULL ? NULL : PyObject_GetAttrString(abc, "Mapping");
        is_mapping = mapping == NULL ? -1 : PyObject_IsInstance(sd, mapping);
        Py_XDECREF(abc);
        Py_XDECREF(mapping);
        if (is_mapping < 0) {
            return NULL;
        }
    }
    if (!is_mapping) {
        PyErr_Format(PyExc_TypeError, "DataParallel.load_state_dict: state_dict: expected a "
                     "mapping (dict-like), got %.100s", Py_TYPE(sd)->tp_name);
        return NULL;
    }
    PyObject *inner = PyDict_New(), *unexpected = PyList_New(0), *items = NULL;
    PyObject *kw = NULL, *got = NULL, *missing = NULL, *res = NULL, *meta = NULL;
    if (inner == NULL || unexpected == NULL || (items = PyMapping_Items(sd)) == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *key = PyTuple_GET_ITEM(PyList_GET_ITEM(items, i), 0);
        PyObject *val = PyTuple_GET_ITEM(PyList_GET_ITEM(items, i), 1);
        if (has_module_prefix(key)) {
            PyObject *rest = PyUnicode_Substring(key, 7, PyUnicode_GET_LENGTH(key));
            int rc = rest == NULL ? -1 : PyDict_SetItem(inner, rest, val);
            Py_XDECREF(rest);
            if (rc < 0) {
                goto done;
            }
        }
        else if (PyList_Append(unexpected, key) < 0) {
            goto done;
        }
    }
    /* torch keeps per-module versions in state_dict._metadata, keyed by the
     * module path: carry them over without the "module" level. */
    meta = PyObject_GetAttrString(sd, "_metadata");
    if (meta == NULL) {
        PyErr_Clear();
    }
    else if (PyDict_Check(meta)) {
        PyObject *inner_meta = PyDict_New(), *k, *v;
        Py_ssize_t pos = 0;
        while (inner_meta != NULL && PyDict_Next(meta, &pos, &k, &v)) {
            PyObject *nk = NULL;
            if (PyUnicode_Check(k) && PyUnicode_CompareWithASCIIString(k, "module") == 0) {
                nk = PyUnicode_FromString("");
            }
            else if (has_module_prefix(k)) {
                nk = PyUnicode_Substring(k, 7, PyUnicode_GET_LENGTH(k));
            }
            else {
                continue;
            }
            if (nk == NULL || PyDict_SetItem(inner_meta, nk, v) < 0) {
                Py_CLEAR(inner_meta);
            }
            Py_XDECREF(nk);
        }
        PyObject *od = NULL;
        if (inner_meta != NULL) {
            PyObject *collections = PyImport_ImportModule("collections");
            od = collections == NULL ? NULL
                 : PyObject_CallMethod(collections, "OrderedDict", "O", inner);
            Py_XDECREF(collections);
        }
        int rc = od == NULL ? -1 : PyObject_SetAttrString(od, "_metadata", inner_meta);
        Py_XDECREF(inner_meta);
        if (rc < 0) {
            Py_XDECREF(od);
            goto done;
        }
        Py_SETREF(inner, od);
    }
    kw = assign ? Py_BuildValue("{sOsO}", "strict", Py_False, "assign", Py_True)
                : Py_BuildValue("{sO}", "strict", Py_False);
    PyObject *call_args = kw == NULL ? NULL : PyTuple_Pack(1, inner);
    got = call_args == NULL ? NULL : dp_wrapper_forward_call(self, "load_state_dict", call_args, kw);
    Py_XDECREF(call_args);
    if (got == NULL) {
        goto done;
    }
    /* got is torch's _IncompatibleKeys(missing_keys, unexpected_keys). */
    PyObject *gm = PyObject_GetAttrString(got, "missing_keys");
    PyObject *gu = gm == NULL ? NULL : PyObject_GetAttrString(got, "unexpected_keys");
    missing = PyList_New(0);
    PyObject *extra = PyList_New(0);
    int ok = gm != NULL && gu != NULL && missing != NULL && extra != NULL;
    for (int pass = 0; ok && pass < 2; pass++) {
        PyObject *src = pass == 0 ? gm : gu, *dst = pass == 0 ? missing : extra;
        PyObject *it = PyObject_GetIter(src), *k;
        while (it != NULL && (k = PyIter_Next(it)) != NULL) {
            PyObject *pk = PyUnicode_FromFormat("module.%S", k);
            Py_DECREF(k);
            if (pk == NULL || PyList_Append(dst, pk) < 0) {
                Py_XDECREF(pk);
                ok = 0;
                break;
            }
            Py_DECREF(pk);
        }
        ok = ok && it != NULL && !PyErr_Occurred();
        Py_XDECREF(it);
    }
    Py_XDECREF(gm);
    Py_XDECREF(gu);
    if (ok) {
        PyObject *tail = PySequence_List(unexpected);
        ok = tail != NULL && PyList_SetSlice(extra, PyList_GET_SIZE(extra),
                                             PyList_GET_SIZE(extra), tail) == 0;
        Py_XDECREF(tail);
    }
    if (!ok) {
        Py_XDECREF(extra);
        goto done;
    }
    if (strict && (PyList_GET_SIZE(missing) > 0 || PyList_GET_SIZE(extra) > 0)) {
        /* nn.Module's words: "...for DataParallel:\n\tMissing key(s) in
         * state_dict: "a", "b". \n\tUnexpected key(s) in state_dict: "c". " */
        PyObject *msg = PyUnicode_FromString("Error(s) in loading state_dict for DataParallel:");
        for (int pass = 0; msg != NULL && pass < 2; pass++) {
            PyObject *keys = pass == 0 ? missing : extra;
            if (PyList_GET_SIZE(keys) == 0) {
                continue;
            }
            PyObject *q = quoted_keys(keys);
            PyObject *more = q == NULL ? NULL
                : PyUnicode_FromFormat("%U\n\t%s key(s) in state_dict: %U. ", msg,
                                       pass == 0 ? "Missing" : "Unexpected", q);
            Py_XDECREF(q);
            Py_SETREF(msg, more);
        }
        if (msg != NULL) {
            PyErr_SetObject(PyExc_RuntimeError, msg);
            Py_DECREF(msg);
        }
        Py_XDECREF(extra);
        goto done;
    }
    res = PyObject_CallFunctionObjArgs((PyObject *)Py_TYPE(got), missing, extra, NULL);
    Py_XDECREF(extra);
done:
    Py_XDECREF(inner);
    Py_XDECREF(unexpected);
    Py_XDECREF(items);
    Py_XDECREF(kw);
    Py_XDECREF(got);
    Py_XDECREF(missing);
    Py_XDECREF(meta);
    return res;
}

