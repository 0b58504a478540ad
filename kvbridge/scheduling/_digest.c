/* kvbridge.scheduling._digest: a hand-off's digests (XXH3-128 per chunk of its byte stream) in
 * one call, with the GIL released once, on the calling thread and at most one helper; or a copy
 * and the digests of its destination in one pass (each piece hashed right after it is copied,
 * while it is still in the cache), which may publish how far it got in a word of shared memory;
 * or the digests of a stream another process is writing, each chunk once that word says it
 * landed (digest_behind: a push's receiver hashes behind the sender's copy).
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
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <linux/futex.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "../_share.h"

typedef struct { uint64_t low64, high64; } hash128;
typedef void *(*create_fn)(void);
typedef int (*free_fn)(void *);
typedef int (*reset_fn)(void *);
typedef int (*update_fn)(void *, const void *, size_t);
typedef hash128 (*digest_fn)(const void *);

typedef struct {
    create_fn create; free_fn release; reset_fn reset; update_fn update; digest_fn digest;
} xxh3;

/* One call's work, shared by the calling thread and at most one helper (kvbridge/_share.h):
 * each takes one chunk at a time from `taken` (a claim succeeds while the count is under
 * `chunks`), the caller the chunks from the front of the stream, the helper those from the back,
 * so each walks its own rows in order and the two never take the same chunk. */
typedef struct {
    kvb_share sh;
    _Atomic uint64_t own_taken;
    _Atomic uint64_t *taken; /* &own_taken, or a counter shared with another call's job */
    xxh3 f;
    /* n rows, the stream in order: (address, length), or with `copy` (dst, src, length), the
     * stream being the destination's */
    const uint64_t *rows;
    uint64_t n, chunk, chunks, total, stride;
    int copy, hash_src; /* with `copy`: hash each piece's source (as read), not its destination */
    const volatile int32_t *stop; /* checked before each chunk is taken; NULL: never stops */
    /* with `copy` on one thread: after each piece is copied, the stream bytes copied so far
     * are stored here (release), for a reader in another process to hash behind the copy;
     * without `copy`: the word digest_behind waits on. NULL: none */
    _Atomic uint64_t *progress;
    int woke; /* the copy woke the progress word's waiter (once, after its first piece) */
    unsigned char *out;
} job;

/* the copy goes this far ahead of the hash: both in the core's own cache */
#define PIECE ((uint64_t)64 << 10)

static uint64_t row_len(const job *j, uint64_t r) { return j->rows[j->stride * r + j->stride - 1]; }

/* The progress word's low 32 bits, the futex a reader sleeps on until the copy starts. */
static uint32_t *futex_word(_Atomic uint64_t *word) {
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    return (uint32_t *)(void *)word;
#else
    return (uint32_t *)(void *)word + 1;
#endif
}

/* Wake whoever sleeps on `word` (in any process that maps it: not a private futex). */
static void wake_word(_Atomic uint64_t *word) {
    syscall(SYS_futex, futex_word(word), FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
}

static void put_be64(unsigned char *p, uint64_t v) {
    for (int i = 7; i >= 0; i--) { p[i] = (unsigned char)(v & 0xff); v >>= 8; }
}

/* Hash `len` stream bytes from row `row`, `off` bytes in, into digest `c`. */
static void digest_chunk(job *j, void *st, uint64_t row, uint64_t off, uint64_t len,
                         uint64_t c) {
    uint64_t pos = c * j->chunk;  /* stream bytes before this row's piece */
    j->f.reset(st);
    while (len && row < j->n) {
        uint64_t have = row_len(j, row) - off, take = have < len ? have : len;
        char *at = (char *)(uintptr_t)(j->rows[j->stride * row] + off);
        if (take && j->copy) {
            const char *from = (const char *)(uintptr_t)(j->rows[j->stride * row + 1] + off);
            for (uint64_t done = 0; done < take;) {
                uint64_t piece = take - done < PIECE ? take - done : PIECE;
                memmove(at + done, from + done, (size_t)piece);
                if (j->progress) {
                    atomic_store_explicit(j->progress, pos + done + piece, memory_order_release);
                    if (!j->woke) {
                        j->woke = 1;
                        wake_word(j->progress);
                    }
                }
                j->f.update(st, (j->hash_src ? from : at) + done, (size_t)piece);
                done += piece;
            }
        } else if (take) {
            j->f.update(st, at, (size_t)take);
        }
        pos += take;
        len -= take;
        off += take;
        if (off == row_len(j, row)) { row++; off = 0; }
    }
    hash128 h = j->f.digest(st);  /* canonical form: high64 then low64, big-endian */
    put_be64(j->out + 16 * c, h.high64);
    put_be64(j->out + 16 * c + 8, h.low64);
}

static uint64_t chunk_len(const job *j, uint64_t c) {
    return c + 1 < j->chunks ? j->chunk : j->total - c * j->chunk;
}

/* Move (row, off) `len` stream bytes on. */
static void skip(const job *j, uint64_t *row, uint64_t *off, uint64_t len) {
    for (uint64_t left = len; left && *row < j->n;) {
        uint64_t have = row_len(j, *row) - *off, step = have < left ? have : left;
        left -= step;
        *off += step;
        if (*off == row_len(j, *row)) { (*row)++; *off = 0; }
    }
}

static int take(job *j) {
    return !(j->stop && *j->stop) && atomic_fetch_add(j->taken, 1) < j->chunks;
}

static void drop(job *j) {
    if (kvb_share_drop(&j->sh)) free(j);
}

/* The caller's share: chunks 0, 1, 2, ... while any is left; 0 when out of memory. */
static int front(job *j) {
    void *st = j->f.create();
    if (st == NULL) return 0;
    uint64_t row = 0, off = 0;
    for (uint64_t c = 0; take(j); c++) {
        uint64_t len = chunk_len(j, c);
        digest_chunk(j, st, row, off, len, c);
        skip(j, &row, &off, len);
    }
    j->f.release(st);
    return 1;
}

/* The last chunk, the one before, ... while any is left to take: the chunks hashed, or -1 when
 * out of memory. */
static int64_t from_back(job *j) {
    void *st = j->f.create();
    if (st == NULL) return -1;
    /* (row, off): the end of the stream, then the start of each chunk taken */
    uint64_t row = j->n, off = 0, c = j->chunks;
    while (take(j)) {
        c--;
        uint64_t len = chunk_len(j, c);
        for (uint64_t left = len; left;) {  /* back by len bytes */
            if (off == 0) { row--; off = row_len(j, row); continue; }
            uint64_t step = off < left ? off : left;
            off -= step;
            left -= step;
        }
        digest_chunk(j, st, row, off, len, c);
    }
    j->f.release(st);
    return (int64_t)(j->chunks - c);
}

/* The helper's share (from_back). */
static void *back(void *arg) {
    job *j = arg;
    if (kvb_share_enter(&j->sh)) {
        from_back(j);
        kvb_share_leave(&j->sh);
    }
    drop(j);
    return NULL;
}

/* Wait until the progress word reaches `want` (1) or the stop word is set (0). While the word
 * is 0 (the copy has not started) it sleeps on it as a futex (the copy wakes it after its first
 * piece; whoever sets the stop word wakes it too; 50 ms at most, to look again); after, it
 * looks again 20 us after the word moved and twice as late each time it did not, up to
 * `max_ns`. */
static int wait_for(job *j, uint64_t want, long max_ns, uint64_t *seen) {
    long nap = max_ns < 20000 ? max_ns : 20000;
    for (;;) {
        uint64_t now = atomic_load_explicit(j->progress, memory_order_acquire);
        if (now >= want) return 1;
        if (j->stop && *j->stop) return 0;
        if (now == 0) {
            struct timespec most = {0, 50000000};
            syscall(SYS_futex, futex_word(j->progress), FUTEX_WAIT, 0, &most, NULL, 0);
            continue;
        }
        if (now != *seen) {
            *seen = now;
            nap = max_ns < 20000 ? max_ns : 20000;
        } else if (nap < max_ns) {
            nap = nap * 2 < max_ns ? nap * 2 : max_ns;
        }
        struct timespec ts = {0, nap};
        nanosleep(&ts, NULL);
    }
}

/* Each chunk from the front, taken (from `taken`: a digest_back call may take them from the
 * back meanwhile) and hashed once the progress word says it landed: 1 when no chunk is left to
 * take, 0 when out of memory, -1 when stopped. Its naps are as short as asked: the calling
 * thread's timer slack (50 us by default, added to each) is 1 us during the call. */
static int behind(job *j, long max_ns) {
    void *st = j->f.create();
    if (st == NULL) return 0;
    int slack = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
    uint64_t row = 0, off = 0, seen = 0;
    int ok = 1;
    for (uint64_t c = 0; take(j); c++) {
        uint64_t len = chunk_len(j, c);
        if (!wait_for(j, c * j->chunk + len, max_ns, &seen)) {
            ok = -1;
            break;
        }
        digest_chunk(j, st, row, off, len, c);
        skip(j, &row, &off, len);
    }
    if (j->stop && *j->stop) ok = -1;
    if (slack > 0) prctl(PR_SET_TIMERSLACK, (unsigned long)slack, 0, 0, 0);
    j->f.release(st);
    return ok;
}

/* The call's work on the calling thread (and a helper): 1 when every digest was written, 0
 * when out of memory, -1 when stopped (the chunks taken before are copied and digested). */
static int run(job *j, int threads) {
    if ((threads > 1 || threads == 0) && j->chunks > 1 && kvb_share_spawn(&j->sh, back, j)
        && threads == 0) {
        kvb_share_wait_finished(&j->sh);  /* the helper's path alone, for tests */
    }
    int ok = front(j);
    kvb_share_close(&j->sh);
    if (ok && atomic_load(j->taken) >= j->chunks) return 1;
    /* stopped, or out of memory in the caller: chunks nobody took stay undone */
    return j->stop && *j->stop ? -1 : 0;
}

/* The job of one call (NULL: out of memory, with Python's error set), holding the caller's
 * reference; `a` the five function addresses, checked by the caller. */
static job *new_job(const unsigned long long a[5], unsigned long long rows_addr,
                    unsigned long long n, unsigned long long chunk, unsigned long long out_addr,
                    int copy, unsigned long long stop_addr) {
    job *j = calloc(1, sizeof *j);
    if (j == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    j->f = (xxh3){(create_fn)(uintptr_t)a[0], (free_fn)(uintptr_t)a[1], (reset_fn)(uintptr_t)a[2],
                  (update_fn)(uintptr_t)a[3], (digest_fn)(uintptr_t)a[4]};
    j->rows = (const uint64_t *)(uintptr_t)rows_addr;
    j->n = n;
    j->copy = copy;
    j->stride = copy ? 3 : 2;
    j->stop = (const volatile int32_t *)(uintptr_t)stop_addr;
    j->chunk = chunk;
    for (uint64_t i = 0; i < n; i++) j->total += row_len(j, i);
    j->chunks = (j->total + chunk - 1) / chunk;
    j->out = (unsigned char *)(uintptr_t)out_addr;
    atomic_init(&j->own_taken, 0);
    j->taken = &j->own_taken;
    kvb_share_init(&j->sh);
    return j;
}

/* Run `j` holding the GIL or not, drop the caller's reference: run()'s answer. */
static int run_call(job *j, int threads, int keep_gil) {
    int ok;
    if (keep_gil) {
        ok = run(j, threads);
    } else {
        Py_BEGIN_ALLOW_THREADS
        ok = run(j, threads);
        Py_END_ALLOW_THREADS
    }
    drop(j);
    return ok;
}

static int check_word(unsigned long long addr) {
    if (addr % 8) {
        PyErr_SetString(PyExc_ValueError, "a progress word must be 8-byte aligned");
        return 0;
    }
    return 1;
}

static int check_args(const unsigned long long a[5], unsigned long long chunk) {
    if (chunk == 0 || !a[0] || !a[1] || !a[2] || !a[3] || !a[4]) {
        PyErr_SetString(PyExc_ValueError, "a positive chunk and five function addresses");
        return 0;
    }
    return 1;
}

/* digest_ranges(fns, rows, n, chunk, out, threads[, keep_gil]) -> digests written
 * fns: (create, free, reset, update, digest) addresses of xxhash's XXH3_createState,
 * XXH3_freeState, XXH3_128bits_reset, XXH3_128bits_update, XXH3_128bits_digest; rows: address
 * of n rows of (address, length) uint64; out: room for ceil(total / chunk) digests of 16
 * bytes; threads: 1, or 2 for a helper thread that takes chunks from the back while the caller
 * takes them from the front (never waited for before it started), or 0 (for tests of the
 * helper's path): the caller waits until the helper took what it could, then takes the rest;
 * keep_gil: hash holding the GIL (the helper never needs it). Letting it go costs taking it back
 * after, and while another thread runs Python that waits up to its switch interval (5 ms). */
static PyObject *digest_ranges(PyObject *self, PyObject *args) {
    unsigned long long a[5], rows_addr, n, chunk, out_addr;
    int threads, keep_gil = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "(KKKKK)KKKKi|p:digest_ranges", &a[0], &a[1], &a[2], &a[3],
                          &a[4], &rows_addr, &n, &chunk, &out_addr, &threads, &keep_gil)
        || !check_args(a, chunk)) {
        return NULL;
    }
    job *j = new_job(a, rows_addr, n, chunk, out_addr, 0, 0);
    if (j == NULL) return NULL;
    uint64_t chunks = j->chunks;
    if (run_call(j, threads, keep_gil) != 1) return PyErr_NoMemory();
    return PyLong_FromUnsignedLongLong(chunks);
}

/* copy_digest_ranges(fns, rows, n, chunk, out, threads, keep_gil, stop[, hash_src[, progress]])
 * -> digests or None. As digest_ranges, for a copy made in the same pass: rows: address of n
 * rows of (dst, src, length) uint64, the stream being the destinations in row order (hash_src:
 * the sources); each piece of at most 64 KiB is copied (memmove) and at once hashed where it
 * landed (or where it was read), still in the cache; stop: address of an int32 checked before each chunk is
 * taken, or 0. None when stopped: the chunks taken before it are copied and digested, the
 * others neither. progress: the address of an 8-byte-aligned uint64 where the stream bytes
 * copied so far are stored (release) after each piece, or 0; with one, the copy runs on the
 * calling thread alone, in stream order. */
static PyObject *copy_digest_ranges(PyObject *self, PyObject *args) {
    unsigned long long a[5], rows_addr, n, chunk, out_addr, stop_addr, progress = 0;
    int threads, keep_gil, hash_src = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "(KKKKK)KKKKipK|pK:copy_digest_ranges", &a[0], &a[1], &a[2],
                          &a[3], &a[4], &rows_addr, &n, &chunk, &out_addr, &threads, &keep_gil,
                          &stop_addr, &hash_src, &progress)
        || !check_args(a, chunk) || !check_word(progress)) {
        return NULL;
    }
    job *j = new_job(a, rows_addr, n, chunk, out_addr, 1, stop_addr);
    if (j == NULL) return NULL;
    j->hash_src = hash_src;
    j->progress = (_Atomic uint64_t *)(uintptr_t)progress;
    if (progress) threads = 1;
    uint64_t chunks = j->chunks;
    int ok = run_call(j, threads, keep_gil);
    if (ok == 0) return PyErr_NoMemory();
    if (ok < 0) Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(chunks);
}

/* digest_behind(fns, rows, n, chunk, out, progress, stop, max_wait_us[, taken]) -> digests or
 * None.
 * As digest_ranges on one thread with the GIL released, for a stream another process is
 * writing in order: each chunk is hashed once the uint64 at `progress` (8-byte aligned, loaded
 * with acquire) says the stream bytes up to its end landed; between looks it sleeps, from 20 us
 * after the word moved up to max_wait_us while it does not. stop: the address of an int32
 * looked at between waits (0: none). None when stopped: the chunks before are digested. A word
 * that runs ahead of the bytes makes digests of what was there, which then differ from the
 * writer's: never a digest of bytes that were not read. taken: the address of an 8-byte-aligned
 * uint64 counting the chunks taken, shared with a digest_back call on the same rows and out
 * that takes them from the back (0: its own); each chunk is hashed by one of the two. */
static PyObject *digest_behind(PyObject *self, PyObject *args) {
    unsigned long long a[5], rows_addr, n, chunk, out_addr, progress, stop_addr, max_us,
        taken = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "(KKKKK)KKKKKKK|K:digest_behind", &a[0], &a[1], &a[2], &a[3],
                          &a[4], &rows_addr, &n, &chunk, &out_addr, &progress, &stop_addr,
                          &max_us, &taken)
        || !check_args(a, chunk) || !check_word(progress) || !check_word(taken)) {
        return NULL;
    }
    if (!progress || max_us == 0 || max_us >= 1000000) {  /* a nap is under one second */
        PyErr_SetString(PyExc_ValueError, "a progress word and 0 < max_wait_us < 1000000");
        return NULL;
    }
    job *j = new_job(a, rows_addr, n, chunk, out_addr, 0, stop_addr);
    if (j == NULL) return NULL;
    j->progress = (_Atomic uint64_t *)(uintptr_t)progress;
    if (taken) j->taken = (_Atomic uint64_t *)(uintptr_t)taken;
    uint64_t chunks = j->chunks;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = behind(j, (long)max_us * 1000);
    Py_END_ALLOW_THREADS
    drop(j);
    if (ok == 0) return PyErr_NoMemory();
    if (ok < 0) Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(chunks);
}

/* digest_back(fns, rows, n, chunk, out, taken) -> chunks hashed here. The caller's help to a
 * digest_behind on the same rows and out once every byte landed: it takes chunks from the back
 * through the shared counter at `taken` (8-byte aligned) until none is left, the GIL released;
 * the follower's chunks are done once its call returned. */
static PyObject *digest_back(PyObject *self, PyObject *args) {
    unsigned long long a[5], rows_addr, n, chunk, out_addr, taken;
    (void)self;
    if (!PyArg_ParseTuple(args, "(KKKKK)KKKKK:digest_back", &a[0], &a[1], &a[2], &a[3], &a[4],
                          &rows_addr, &n, &chunk, &out_addr, &taken)
        || !check_args(a, chunk) || !check_word(taken)) {
        return NULL;
    }
    if (!taken) {
        PyErr_SetString(PyExc_ValueError, "no counter of the chunks taken");
        return NULL;
    }
    job *j = new_job(a, rows_addr, n, chunk, out_addr, 0, 0);
    if (j == NULL) return NULL;
    j->taken = (_Atomic uint64_t *)(uintptr_t)taken;
    int64_t done;
    Py_BEGIN_ALLOW_THREADS
    done = from_back(j);
    Py_END_ALLOW_THREADS
    drop(j);
    if (done < 0) return PyErr_NoMemory();
    return PyLong_FromLongLong(done);
}

/* wake(progress) -> None: wake a digest_behind sleeping on the word at `progress` (after
 * setting its stop word, or the word itself). */
static PyObject *wake(PyObject *self, PyObject *args) {
    unsigned long long progress;
    (void)self;
    if (!PyArg_ParseTuple(args, "K:wake", &progress) || !check_word(progress)) return NULL;
    if (!progress) {
        PyErr_SetString(PyExc_ValueError, "no progress word");
        return NULL;
    }
    wake_word((_Atomic uint64_t *)(uintptr_t)progress);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"digest_ranges", digest_ranges, METH_VARARGS,
     "digest_ranges(fns, rows_addr, n, chunk, out_addr, threads[, keep_gil]) -> digests "
     "written; XXH3-128 per chunk of the stream of (address, length) uint64 rows, the GIL "
     "released once or kept"},
    {"copy_digest_ranges", copy_digest_ranges, METH_VARARGS,
     "copy_digest_ranges(fns, rows_addr, n, chunk, out_addr, threads, keep_gil, stop_addr"
     "[, hash_src[, progress_addr]]) -> digests written, or None when stopped; copies (dst, "
     "src, length) uint64 rows and digests the destination (or source) stream in one pass, each "
     "piece hashed right after it is copied (and the progress word kept)"},
    {"digest_behind", digest_behind, METH_VARARGS,
     "digest_behind(fns, rows_addr, n, chunk, out_addr, progress_addr, stop_addr, max_wait_us"
     "[, taken_addr]) -> digests written, or None when stopped; digests each chunk of the "
     "stream once the progress word says it landed"},
    {"digest_back", digest_back, METH_VARARGS,
     "digest_back(fns, rows_addr, n, chunk, out_addr, taken_addr) -> chunks hashed; takes the "
     "chunks of a digest_behind's stream from the back once every byte landed"},
    {"wake", wake, METH_VARARGS, "wake(progress_addr) -> None; wakes a digest_behind waiting on "
     "the word"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_digest",
    "A hand-off's XXH3-128 digests in one call with the GIL released (kvbridge).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__digest(void) { return PyModule_Create(&module); }
