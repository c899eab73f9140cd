/* lib_search.c - the one search for NCCL and the CUDA runtime (capi.h's
 * dp_lib_search order), used by nccl.c and, through the C API capsule, by
 * dpmini._dist. */
#define PY_SSIZE_T_CLEAN
#include <Python.h> /* sys.path, to find pip's nvidia-* wheels; not py/'s state or types */
#include "gpu.h"

#include <dlfcn.h>
#include <string.h>
#include <unistd.h>

static void note(dp_lib_search *s, const char *what)
{
    size_t len = strlen(s->tried);
    if (len < sizeof s->tried - 1)
        snprintf(s->tried + len, sizeof s->tried - len, "%s%s", len ? ", " : "", what);
}

/* dst = src, cut to n - 1 bytes. */
static void keep(char *dst, size_t n, const char *src)
{
    size_t len = strlen(src);
    if (len >= n)
        len = n - 1;
    memcpy(dst, src, len);
    dst[len] = '\0';
}

static void *open_path(dp_lib_search *s, const char *path, int check_file)
{
    if (check_file && access(path, R_OK) != 0)
        return NULL;
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL)
        note(s, dlerror());
    return h;
}

static void *already_loaded(dp_lib_search *s, char *found, size_t found_len)
{
    void *h = NULL;
    for (int i = 0; s->share && s->names[i] != NULL && h == NULL; i++) {
        h = dlopen(s->names[i], RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
        if (h != NULL)
            snprintf(found, found_len, "%s, already loaded", s->names[i]);
    }
    return h;
}

static void *in_wheels(dp_lib_search *s, char *found, size_t found_len)
{
    char path[4096];
    void *h = NULL;
    PyObject *sys_path = PySys_GetObject("path");   /* borrowed */
    Py_ssize_t n = sys_path != NULL && PyList_Check(sys_path) ? PyList_GET_SIZE(sys_path) : 0;
    for (Py_ssize_t i = 0; i < n && h == NULL; i++) {
        const char *dir = PyUnicode_Check(PyList_GET_ITEM(sys_path, i))
                          ? PyUnicode_AsUTF8(PyList_GET_ITEM(sys_path, i)) : NULL;
        if (dir == NULL) {
            PyErr_Clear();
            continue;
        }
        for (int k = 0; s->names[k] != NULL && h == NULL; k++) {
            snprintf(path, sizeof path, "%s/%s/%s", dir, s->wheel, s->names[k]);
            if ((h = open_path(s, path, 1)) != NULL)
                keep(found, found_len, path);
        }
    }
    return h;
}

static void *in_cuda_homes(dp_lib_search *s, char *found, size_t found_len)
{
    char path[4096];
    void *h = NULL;
    const char *dirs[2] = {getenv("CUDA_HOME"), "/usr/local/cuda"};
    for (int d = 0; d < 2 && h == NULL; d++) {
        if (dirs[d] == NULL || !*dirs[d])
            continue;
        for (int k = 0; s->names[k] != NULL && h == NULL; k++) {
            snprintf(path, sizeof path, "%s/lib64/%s", dirs[d], s->names[k]);
            if ((h = open_path(s, path, 1)) != NULL)
                keep(found, found_len, path);
        }
    }
    return h;
}

void *dp_find_library(dp_lib_search *s, char *found, size_t found_len)
{
    s->tried[0] = '\0';
    void *h = already_loaded(s, found, found_len);
    const char *env = getenv(s->env);
    if (h == NULL && env != NULL && *env && (h = open_path(s, env, 0)) != NULL)
        keep(found, found_len, env);
    if (h == NULL)
        h = in_wheels(s, found, found_len);
    if (h == NULL)
        h = in_cuda_homes(s, found, found_len);
    for (int k = 0; s->names[k] != NULL && h == NULL; k++) {
        if ((h = open_path(s, s->names[k], 0)) != NULL)
            keep(found, found_len, s->names[k]);
    }
    return h;
}
