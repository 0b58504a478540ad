/* kvbridge.transports.shm._rangecopy: copy many byte ranges in one call, without the GIL, on the
 * calling thread and at most one helper.
 *
 * Built by setuptools when kvbridge is built or installed (setup.py, ext_modules; optional: a
 * host without a C compiler installs without it and shm moves bytes by cross-memory attach).
 * The Python side is kvbridge/transports/shm/rangecopy.py, which states the contract.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../_share.h"

/* One call's rows, shared by the calling thread and at most one helper (kvbridge/_share.h):
 * each takes one row at a time from `taken` (a claim succeeds while the count is under `n`), the
 * caller from the front, the helper from the back, and checks `stop` before each. */
typedef struct {
    kvb_share sh;
    _Atomic uint64_t taken, copied;
    const uint64_t *rows; /* n rows of (dst, src, length) */
    uint64_t n;
    const volatile int32_t *stop;
} job;

static int take(job *j) { return atomic_fetch_add(&j->taken, 1) < j->n; }

static void copy_row(job *j, uint64_t i) {
    memmove((void *)(uintptr_t)j->rows[3 * i], (const void *)(uintptr_t)j->rows[3 * i + 1],
            (size_t)j->rows[3 * i + 2]);
}

static void drop(job *j) {
    if (kvb_share_drop(&j->sh)) free(j);
}

static void *back(void *arg) {
    job *j = arg;
    if (kvb_share_enter(&j->sh)) {
        uint64_t done = 0;
        while (!*j->stop && take(j)) copy_row(j, j->n - 1 - done++);
        atomic_fetch_add(&j->copied, done);
        kvb_share_leave(&j->sh);
    }
    drop(j);
    return NULL;
}

/* copy_ranges(rows, n, stop[, threads]) -> int
 * rows: address of n rows of (dst, src, length) uint64; stop: address of an int32 checked every
 * 64 rows (one thread) or before every row (two). Copies the rows with the GIL released, once
 * for the whole call: in order on the calling thread, or (threads 2) with a helper thread taking
 * rows from the back, never waited for before it started, or (threads 0, for tests) the
 * helper first and the caller after it; returns how many were copied (all unless stopped). */
static PyObject *copy_ranges(PyObject *self, PyObject *args) {
    unsigned long long rows_addr, n, stop_addr;
    int threads = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKK|i:copy_ranges", &rows_addr, &n, &stop_addr, &threads)) {
        return NULL;
    }
    const uint64_t *rows = (const uint64_t *)(uintptr_t)rows_addr;
    const volatile int32_t *stop = (const volatile int32_t *)(uintptr_t)stop_addr;
    uint64_t i;
    job *j = (threads > 1 || threads == 0) && n > 1 ? calloc(1, sizeof *j) : NULL;
    if (j == NULL) {  /* one thread (or no memory for a job: one thread) */
        Py_BEGIN_ALLOW_THREADS
        for (i = 0; i < n; i++) {
            if ((i & 63) == 0 && *stop) break;
            memmove((void *)(uintptr_t)rows[3 * i], (const void *)(uintptr_t)rows[3 * i + 1],
                    (size_t)rows[3 * i + 2]);
        }
        Py_END_ALLOW_THREADS
        return PyLong_FromUnsignedLongLong(i);
    }
    j->rows = rows;
    j->n = n;
    j->stop = stop;
    atomic_init(&j->taken, 0);
    atomic_init(&j->copied, 0);
    kvb_share_init(&j->sh);
    uint64_t copied;
    Py_BEGIN_ALLOW_THREADS
    if (kvb_share_spawn(&j->sh, back, j) && threads == 0) {
        kvb_share_wait_finished(&j->sh);  /* the helper's path alone, for tests */
    }
    uint64_t done = 0;
    while (!*stop && take(j)) copy_row(j, done++);
    kvb_share_close(&j->sh);
    copied = done + atomic_load(&j->copied);
    Py_END_ALLOW_THREADS
    drop(j);
    return PyLong_FromUnsignedLongLong(copied);
}

static PyMethodDef methods[] = {
    {"copy_ranges", copy_ranges, METH_VARARGS,
     "copy_ranges(rows_addr, n, stop_addr[, threads]) -> rows copied; (dst, src, length) "
     "uint64 rows, GIL released once; threads 2: a helper copies rows from the back"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_rangecopy",
    "Copy many byte ranges in one call with the GIL released (kvbridge shm).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__rangecopy(void) { return PyModule_Create(&module); }
