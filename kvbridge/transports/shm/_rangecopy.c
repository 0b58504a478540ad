/* kvbridge.transports.shm._rangecopy: copy many byte ranges in one call, without the GIL.
 *
 * Built by setuptools when kvbridge is built or installed (setup.py, ext_modules; optional: a
 * host without a C compiler installs without it and shm moves bytes by cross-memory attach).
 * The Python side is kvbridge/transports/shm/rangecopy.py, which states the contract.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* copy_ranges(rows, n, stop) -> int
 * rows: address of n rows of (dst, src, length) uint64; stop: address of an int32 checked every
 * 64 rows. Copies the rows in order with the GIL released; returns how many were copied. */
static PyObject *copy_ranges(PyObject *self, PyObject *args) {
    unsigned long long rows_addr, n, stop_addr;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKK:copy_ranges", &rows_addr, &n, &stop_addr)) {
        return NULL;
    }
    const uint64_t *rows = (const uint64_t *)(uintptr_t)rows_addr;
    const volatile int32_t *stop = (const volatile int32_t *)(uintptr_t)stop_addr;
    uint64_t i;
    Py_BEGIN_ALLOW_THREADS
    for (i = 0; i < n; i++) {
        if ((i & 63) == 0 && *stop) break;
        memmove((void *)(uintptr_t)rows[3 * i], (const void *)(uintptr_t)rows[3 * i + 1],
                (size_t)rows[3 * i + 2]);
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLongLong(i);
}

static PyMethodDef methods[] = {
    {"copy_ranges", copy_ranges, METH_VARARGS,
     "copy_ranges(rows_addr, n, stop_addr) -> rows copied; (dst, src, length) uint64 rows, "
     "GIL released"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_rangecopy",
    "Copy many byte ranges in one call with the GIL released (kvbridge shm).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__rangecopy(void) { return PyModule_Create(&module); }
