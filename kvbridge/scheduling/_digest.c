/* kvbridge.scheduling._digest: a hand-off's digests (XXH3-128 per chunk of its byte stream) in
 * one call, with the GIL released once, on one or two threads.
 *
 * It links nothing: the XXH3 functions are called through addresses the caller passes, taken
 * from the xxhash package kvbridge already depends on (its extension exports them, with its
 * run-time choice of AVX2 or SSE2). The Python side, kvbridge/scheduling/digests.py, checks the
 * result against xxhash's own before it uses this path, and states the contract. Built by
 * setuptools when kvbridge is built or installed; optional (without it, digests are hashed in
 * Python).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct { uint64_t low64, high64; } hash128;
typedef void *(*create_fn)(void);
typedef int (*free_fn)(void *);
typedef int (*reset_fn)(void *);
typedef int (*update_fn)(void *, const void *, size_t);
typedef hash128 (*digest_fn)(const void *);

typedef struct {
    create_fn create; free_fn release; reset_fn reset; update_fn update; digest_fn digest;
} xxh3;

typedef struct {
    const xxh3 *f;
    const uint64_t *rows; /* n rows of (address, length): the stream, in order */
    uint64_t n, row, off;  /* this share's first byte: row `row`, `off` bytes in */
    uint64_t chunk, first, count; /* digests first .. first + count - 1 */
    unsigned char *out;
    int failed;
} share;

static void put_be64(unsigned char *p, uint64_t v) {
    for (int i = 7; i >= 0; i--) { p[i] = (unsigned char)(v & 0xff); v >>= 8; }
}

static void *digest_share(void *arg) {
    share *s = arg;
    void *st = s->f->create();
    if (st == NULL) { s->failed = 1; return NULL; }
    uint64_t row = s->row, off = s->off;
    for (uint64_t c = 0; c < s->count; c++) {
        uint64_t left = s->chunk;
        s->f->reset(st);
        while (left && row < s->n) {
            uint64_t len = s->rows[2 * row + 1] - off, take = len < left ? len : left;
            if (take) s->f->update(st, (const void *)(uintptr_t)(s->rows[2 * row] + off), (size_t)take);
            left -= take;
            off += take;
            if (off == s->rows[2 * row + 1]) { row++; off = 0; }
        }
        hash128 h = s->f->digest(st);  /* canonical form: high64 then low64, big-endian */
        put_be64(s->out + 16 * (s->first + c), h.high64);
        put_be64(s->out + 16 * (s->first + c) + 8, h.low64);
    }
    s->f->release(st);
    return NULL;
}

/* digest_ranges(fns, rows, n, chunk, out, threads) -> digests written
 * fns: (create, free, reset, update, digest) addresses of xxhash's XXH3_createState,
 * XXH3_freeState, XXH3_128bits_reset, XXH3_128bits_update, XXH3_128bits_digest; rows: address
 * of n rows of (address, length) uint64; out: room for ceil(total / chunk) digests of 16
 * bytes; threads: 1 or 2 (the stream split at a chunk boundary). */
static PyObject *digest_ranges(PyObject *self, PyObject *args) {
    unsigned long long a[5], rows_addr, n, chunk, out_addr;
    int threads;
    (void)self;
    if (!PyArg_ParseTuple(args, "(KKKKK)KKKKi:digest_ranges", &a[0], &a[1], &a[2], &a[3], &a[4],
                          &rows_addr, &n, &chunk, &out_addr, &threads)) {
        return NULL;
    }
    if (chunk == 0 || !a[0] || !a[1] || !a[2] || !a[3] || !a[4]) {
        PyErr_SetString(PyExc_ValueError, "a positive chunk and five function addresses");
        return NULL;
    }
    xxh3 f = {(create_fn)(uintptr_t)a[0], (free_fn)(uintptr_t)a[1], (reset_fn)(uintptr_t)a[2],
              (update_fn)(uintptr_t)a[3], (digest_fn)(uintptr_t)a[4]};
    const uint64_t *rows = (const uint64_t *)(uintptr_t)rows_addr;
    uint64_t total = 0;
    for (uint64_t i = 0; i < n; i++) total += rows[2 * i + 1];
    uint64_t chunks = (total + chunk - 1) / chunk;
    unsigned char *out = (unsigned char *)(uintptr_t)out_addr;
    share sh[2] = {{&f, rows, n, 0, 0, chunk, 0, chunks, out, 0},
                   {&f, rows, n, 0, 0, chunk, 0, 0, out, 0}};
    if (threads > 1 && chunks > 1) {
        uint64_t half = chunks / 2, pos = half * chunk, row = 0;
        while (row < n && pos >= rows[2 * row + 1]) { pos -= rows[2 * row + 1]; row++; }
        sh[0].count = half;
        sh[1] = (share){&f, rows, n, row, pos, chunk, half, chunks - half, out, 0};
    }
    int spawned = 0;
    pthread_t th;
    Py_BEGIN_ALLOW_THREADS
    if (sh[1].count) spawned = pthread_create(&th, NULL, digest_share, &sh[1]) == 0;
    digest_share(&sh[0]);
    if (sh[1].count) {
        if (spawned) pthread_join(th, NULL);
        else digest_share(&sh[1]);
    }
    Py_END_ALLOW_THREADS
    if (sh[0].failed || sh[1].failed) return PyErr_NoMemory();
    return PyLong_FromUnsignedLongLong(chunks);
}

static PyMethodDef methods[] = {
    {"digest_ranges", digest_ranges, METH_VARARGS,
     "digest_ranges(fns, rows_addr, n, chunk, out_addr, threads) -> digests written; XXH3-128 "
     "per chunk of the stream of (address, length) uint64 rows, the GIL released once"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_digest",
    "A hand-off's XXH3-128 digests in one call with the GIL released (kvbridge).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__digest(void) { return PyModule_Create(&module); }
