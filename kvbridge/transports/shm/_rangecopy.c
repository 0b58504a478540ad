/* kvbridge.transports.shm._rangecopy: copy many byte ranges in one call, without the GIL, on the
 * calling thread and at most one helper.
 *
 * Built by setuptools when kvbridge is built or installed (setup.py, ext_modules; optional: a
 * host without a C compiler installs without it and shm moves bytes by cross-memory attach).
 * The Python side is kvbridge/transports/shm/rangecopy.py, which states the contract.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* One call's rows, shared by the calling thread and at most one helper: each takes one row at a
 * time from `taken` (a claim succeeds while the count is under `n`), the caller from the front,
 * the helper from the back, and checks `stop` before each. The caller never waits for a helper
 * that has not started: once nothing is left it closes the job, and a helper that starts later
 * leaves without copying. It waits only while the helper copies a row it took. The helper is
 * detached; whoever of the two drops the last reference frees the job. */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t idle;
    int refs, closed, active, finished;
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
    pthread_mutex_lock(&j->mu);
    int last = --j->refs == 0;
    pthread_mutex_unlock(&j->mu);
    if (last) {
        pthread_mutex_destroy(&j->mu);
        pthread_cond_destroy(&j->idle);
        free(j);
    }
}

static void *back(void *arg) {
    job *j = arg;
    pthread_mutex_lock(&j->mu);
    int go = !j->closed;
    j->active = go;
    pthread_mutex_unlock(&j->mu);
    if (go) {
        uint64_t done = 0;
        while (!*j->stop && take(j)) copy_row(j, j->n - 1 - done++);
        atomic_fetch_add(&j->copied, done);
        pthread_mutex_lock(&j->mu);
        j->active = 0;
        j->finished = 1;
        pthread_cond_signal(&j->idle);
        pthread_mutex_unlock(&j->mu);
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
    uint64_t i = 0;
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
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->idle, NULL);
    j->refs = 1;
    uint64_t copied;
    Py_BEGIN_ALLOW_THREADS
    pthread_attr_t attr;
    pthread_t th;
    if (pthread_attr_init(&attr) == 0) {
        j->refs = 2;
        if (pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED) != 0
            || pthread_create(&th, &attr, back, j) != 0) {
            j->refs = 1;  /* no helper: the caller copies it all */
        }
        pthread_attr_destroy(&attr);
    }
    if (threads == 0 && j->refs == 2) {  /* the helper's path alone, for tests */
        pthread_mutex_lock(&j->mu);
        while (!j->finished) pthread_cond_wait(&j->idle, &j->mu);
        pthread_mutex_unlock(&j->mu);
    }
    uint64_t done = 0;
    while (!*stop && take(j)) copy_row(j, done++);
    pthread_mutex_lock(&j->mu);
    j->closed = 1;  /* a helper that starts from now on leaves at once */
    while (j->active) pthread_cond_wait(&j->idle, &j->mu);
    pthread_mutex_unlock(&j->mu);
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
