"""Hand-off digests: the sender digests its KV once, the receiver checks what landed.

A hand-off moves one byte stream per (prefill rank, decode rank) part: the bytes
:func:`~kvbridge.scheduling.mapping.side_descriptors` lists, in plan order. Both sides compute
their half alone and the two halves describe the same stream (only its cut into ranges differs:
each side coalesces its own contiguous runs), so a digest of the *stream* can be computed on
either side and compared on the other.

The stream is cut into chunks of :func:`chunk_size` bytes (256 KiB — one block of a large
model's layer — or more for transfers past :data:`MAX_CHUNKS` chunks, so the digests of one
part stay under 64 KiB on the wire) and each chunk gets :data:`DIGEST_BYTES` of XXH3-128.
The prefill rank computes them from its own KV, where it was computed: for a push as the
WRITE's copy reads it (shm, every range mapped: :func:`landing` with ``source``) or else right
after posting the WRITE (while the transport moves the bytes; where it copied them inside the
post, as NIXL over UCX's cross-memory attach does, P first tells the decode rank, which hashes
what landed meanwhile: ``PushLanded``); for a pull when it stages the
KV (the whole prompt as a decode rank of its own shape reads it: the usual claim) or right
after granting any other claim (while the decode rank's READ moves the bytes): the answer to
the decode rank's ``PullDone`` carries them ready made, off its path. The decode rank digests
what landed in its blocks and compares — for a pull over shm, in the pass that copies it
(:func:`landing`: each piece of at most 64 KiB hashed right after it is copied, while it is
still in the core's cache; a 22.5 MiB READ's check then adds 0.55–0.86 ms to its copy instead
of 1.0–1.8 ms, benchmarks/copy_digest.py): a mismatch fails the receive (vLLM's
``kv_load_failure_policy`` then recomputes or fails the request), is counted
(``checksum_mismatch``) and logged with the first bad chunk's place in the stream. KV whose
digest did not match is never used.

XXH3 is not a MAC: it catches bytes that changed between two engines (a transport, NIC or
memory fault, a bug that wrote the wrong blocks), not a peer that lies — the peers' identity
and every control message are proven separately (:mod:`kvbridge.trust`). It runs at 25–40
GB/s per core here, faster than the copy it checks (docs/benchmarks.md has the measured cost).

**Two ways to the same digests.** Natively (:func:`native`, ``_digest.c``, built with kvbridge
like shm's range copy): one call per part that lets the GIL go once, through xxhash's own XXH3
functions (the xxhash package exports them, with its run-time choice of AVX2); the loader checks
its digests against xxhash's on a test stream before using it. For a stream of
:data:`SPLIT_BYTES` or more a helper thread takes chunks from the stream's back while the
calling thread takes them from its front, and the caller never waits for a helper that has not
started (only for one that is hashing a chunk it took): on a host whose cores are busy the
helper often starts late, and a fixed split in halves then waited for it (a 22.5 MiB part beside
two busy processes: 4–5 ms p50 split in halves, 1.6–1.9 ms shared, 1.7–1.9 ms on one thread;
with a core free 0.9–1.1 ms against 1.6–1.8 ms on one thread:
docs/results/2026-12-06-digest-helper.md). A part under :data:`KEEP_GIL_BYTES` is hashed
holding the GIL: letting it go even once costs taking it back, which waits up to a switch
interval (5 ms) while another thread of the engine runs Python (beside torch forward passes a
22.5 MiB part took 1.7–1.9 ms held, 5–7 ms p90 let go). Otherwise in Python
(:func:`compute_python`), fed in pieces that keep the GIL (:mod:`kvbridge.hashing`): the
transfer loop's thread digests while the engine's own threads run Python, and a thread that
gave the GIL up per piece would wait for them every time.

The digested memory must be readable from this process (host memory: CPU KV caches, or any
pinned host buffer); a CUDA KV cache is not digested (``vllm_worker`` turns digests off for it
and says so). Pure functions; thread-safe; they read the memory the descriptors name, so the
caller keeps it alive and unchanged while they run.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import logging
import os
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import xxhash

from kvbridge.blocks import LandingCopy
from kvbridge.hashing import feed
from kvbridge.layout import DescriptorArray
from kvbridge.messages import MAX_DIGEST_BYTES

__all__ = ["CHUNK_BYTES", "MAX_CHUNKS", "DIGEST_BYTES", "KEEP_GIL_BYTES", "SPLIT_BYTES",
           "chunk_size", "compute", "compute_python", "copy_compute", "landing", "mismatch",
           "native", "native_behind", "native_copy"]

#: stream bytes per digest (unless the stream has more than MAX_CHUNKS of them)
CHUNK_BYTES = 256 << 10
#: bytes of one chunk's digest (XXH3-128)
DIGEST_BYTES = 16
#: most digests one part carries (they fit one message)
MAX_CHUNKS = MAX_DIGEST_BYTES // DIGEST_BYTES
#: the extension module built from ``_digest.c``
NATIVE = "kvbridge.scheduling._digest"
#: streams of at least this many bytes are digested with a helper thread (natively)
SPLIT_BYTES = 4 << 20
#: streams under this many bytes are digested holding the GIL (natively): taking the GIL back
#: after letting it go waits, while another thread runs Python, up to its switch interval (5
#: ms), longer than hashing this much takes; a larger stream lets it go for the hash
KEEP_GIL_BYTES = 32 << 20

log = logging.getLogger("kvbridge.digests")
_PAGE = 4096
_PyBUF_READ = 0x100

# A read-only memoryview of raw memory without a ctypes array type per size (ctypes caches
# every array type it makes, so one per distinct size would grow for as long as the engine runs)
_memory = ctypes.pythonapi.PyMemoryView_FromMemory
_memory.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int]
_memory.restype = ctypes.py_object


def chunk_size(total: int) -> int:
    """Stream bytes per digest for a stream of ``total`` bytes (the same on both sides)."""
    if total <= CHUNK_BYTES * MAX_CHUNKS:
        return CHUNK_BYTES
    per = -(-total // MAX_CHUNKS)
    return -(-per // _PAGE) * _PAGE


Native = Callable[[np.ndarray, int, int, bool], bytes]
"""``(rows, chunk, threads, keep_gil) -> digests``: ``rows`` C-contiguous ``(n, 2)`` uint64
(address, length), in stream order; ``threads`` 1 (the caller alone), 2 (with a helper) or 0
(the helper's path alone, for tests); ``keep_gil``: hash holding the GIL (the helper never
needs it), else let it go for the hash."""


CopyNative = Callable[[np.ndarray, int, int, bool, int, bool, int], bytes | None]
"""``(moves, chunk, threads, keep_gil, stop, source, progress) -> digests``: copy ``moves``
(C-contiguous ``(n, 3)`` uint64: dst, src, length) and digest the destination stream (the dsts
in row order; ``source``: the srcs) in one pass, each piece hashed right after it is copied;
``stop``: the address of an int32 checked before each chunk (0: none); ``progress``: the
address of an 8-byte-aligned uint64 the copy keeps at the stream bytes copied so far (on one
thread, in order; 0: none); None when it stopped the copy (part of it may have landed)."""


class BehindFns(NamedTuple):
    """The native calls of a follower (:func:`native_behind`, kvbridge.scheduling.follow).

    ``follow(rows, chunk, out, taken, progress, stop, max_wait_us) -> bool``: digest the stream
    ``rows`` (C-contiguous ``(n, 2)`` uint64: address, length) names into ``out`` (uint8, 16
    bytes per chunk), each chunk taken from the front (through the uint64 counter ``taken``) and
    hashed once the uint64 at ``progress`` says the stream bytes up to its end landed (the GIL
    let go; between looks it sleeps on the word while it is 0, then up to ``max_wait_us``);
    ``stop``: the address of an int32 (0: none); False when stopped.
    ``back(rows, chunk, out, taken) -> int``: once every byte landed, hash the chunks nobody
    took yet from the back, sharing ``taken`` with ``follow`` (the GIL let go); how many.
    ``wake(progress)``: wake a ``follow`` asleep on that word."""

    follow: Callable[[np.ndarray, int, np.ndarray, np.ndarray, int, int, int], bool]
    back: Callable[[np.ndarray, int, np.ndarray, np.ndarray], int]
    wake: Callable[[int], None]


def _xxh3_addresses() -> tuple[int, ...]:
    """The addresses of xxhash's own XXH3 functions (its extension exports them, the update
    with its run-time choice of AVX2 or SSE2); OSError or AttributeError where they are not."""
    lib = ctypes.CDLL(importlib.import_module("xxhash._xxhash").__file__)
    update = getattr(lib, "XXH3_128bits_update_dispatch", None) or lib.XXH3_128bits_update
    fns = (lib.XXH3_createState, lib.XXH3_freeState, lib.XXH3_128bits_reset, update,
           lib.XXH3_128bits_digest)
    return tuple(int(ctypes.cast(f, ctypes.c_void_p).value or 0) for f in fns)


#: the loaders' test stream: 300 KiB (chunks of 64 KiB), cut across chunk ends, with a 1-byte range
_PROBE_CUTS = (0, 1000, 70_000, 70_001, 200_000, 300 << 10)


def _probe() -> tuple[np.ndarray, list[tuple[int, int]]]:
    """The loaders' test stream and its ranges (offset, length)."""
    data = np.frombuffer(bytes(range(256)) * 1200, dtype=np.uint8)
    return data, [(a, b - a) for a, b in zip(_PROBE_CUTS, _PROBE_CUTS[1:], strict=False)]


def _function(name: str, without: str) -> tuple[Callable[..., object], tuple[int, ...]] | None:
    """``_digest``'s function ``name`` and the addresses of xxhash's XXH3 functions; None
    (logged: ``without``) where the extension was not built or xxhash does not export them."""
    try:
        return getattr(importlib.import_module(NATIVE), name), _xxh3_addresses()
    except (ImportError, OSError, AttributeError) as exc:
        log.info("%s: %s", without, exc)
        return None


def _load_native() -> Native | None:
    """The native digests, or None (logged once): where the extension was not built, where
    xxhash does not export its functions, or where their digests differ from xxhash's own on a
    test stream (a changed signature would; nothing is trusted unchecked)."""
    found = _function("digest_ranges", "hand-off digests are hashed in Python")
    if found is None:
        return None
    fn, addresses = found

    def digest(rows: np.ndarray, size: int, threads: int, keep_gil: bool) -> bytes:
        out = np.empty(DIGEST_BYTES * -(-int(rows[:, 1].sum()) // size), dtype=np.uint8)
        fn(addresses, rows.ctypes.data, rows.shape[0], size, out.ctypes.data, threads, keep_gil)
        return out.tobytes()

    data, ranges = _probe()
    rows = np.array([(data.ctypes.data + a, n) for a, n in ranges], dtype=np.uint64)
    want = compute_python(rows.astype(np.int64), 64 << 10)
    if digest(rows, 64 << 10, 1, True) != want or digest(rows, 64 << 10, 2, False) != want:
        log.warning("hand-off digests are hashed in Python: the native digests differ from "
                    "xxhash's on a test stream")
        return None
    return digest


def _load_copy() -> CopyNative | None:
    """The native copy-and-digest, or None: as :func:`_load_native`, its digests (of what
    landed and of what was read) and its copy checked on a test stream first."""
    found = _function("copy_digest_ranges", "no native copy-and-digest")
    if found is None:
        return None
    fn, addresses = found

    def copy_digest(moves: np.ndarray, size: int, threads: int, keep_gil: bool,
                    stop: int = 0, source: bool = False, progress: int = 0) -> bytes | None:
        out = np.empty(DIGEST_BYTES * -(-int(moves[:, 2].sum()) // size), dtype=np.uint8)
        done = fn(addresses, moves.ctypes.data, moves.shape[0], size, out.ctypes.data, threads,
                  keep_gil, stop, source, progress)
        return None if done is None else out.tobytes()

    src, ranges = _probe()
    want = compute_python(np.array([(src.ctypes.data + a, n) for a, n in ranges],
                                   dtype=np.int64), 64 << 10)
    for threads in (1, 2):
        dst, word = np.zeros_like(src), np.zeros(1, dtype=np.uint64)
        moves = np.array([(dst.ctypes.data + a, src.ctypes.data + a, n) for a, n in ranges],
                         dtype=np.uint64)
        if copy_digest(moves, 64 << 10, threads, threads == 1, 0, threads == 2,
                       word.ctypes.data if threads == 1 else 0) != want or \
                not np.array_equal(dst, src) or int(word[0]) != (src.nbytes if threads == 1
                                                               else 0):
            log.warning("no native copy-and-digest: its copy or digests differ from xxhash's "
                        "on a test stream")
            return None
    return copy_digest


def _load_behind() -> BehindFns | None:
    """The native calls of a follower, or None: as :func:`_load_native`, checked on a test
    stream whose word already says it all landed, alone and with ``back`` taking its share."""
    found = _function("digest_behind", "no native digests behind a copy")
    if found is None:
        return None
    fn, addresses = found
    module = importlib.import_module(NATIVE)
    back_fn = module.digest_back

    def follow(rows: np.ndarray, size: int, out: np.ndarray, taken: np.ndarray, progress: int,
               stop: int, max_wait_us: int) -> bool:
        return fn(addresses, rows.ctypes.data, rows.shape[0], size, out.ctypes.data, progress,
                  stop, max_wait_us, taken.ctypes.data) is not None

    def back(rows: np.ndarray, size: int, out: np.ndarray, taken: np.ndarray) -> int:
        return int(back_fn(addresses, rows.ctypes.data, rows.shape[0], size, out.ctypes.data,
                           taken.ctypes.data))

    data, ranges = _probe()
    rows = np.array([(data.ctypes.data + a, n) for a, n in ranges], dtype=np.uint64)
    want = compute_python(rows.astype(np.int64), 64 << 10)
    word = np.array([data.nbytes], dtype=np.uint64)
    size, chunks = 64 << 10, len(want) // DIGEST_BYTES
    alone = np.zeros(len(want), dtype=np.uint8)  # the follower takes every chunk
    ok = follow(rows, size, alone, np.zeros(1, dtype=np.uint64), word.ctypes.data, 0, 1000)
    last = np.zeros(len(want), dtype=np.uint8)  # the back takes them all, then none is left
    taken = np.zeros(1, dtype=np.uint64)
    ok = ok and back(rows, size, last, taken) == chunks and follow(
        rows, size, last, taken, word.ctypes.data, 0, 1000) and back(rows, size, last, taken) == 0
    if not ok or alone.tobytes() != want or last.tobytes() != want:
        log.warning("no native digests behind a copy: they differ from xxhash's on a test "
                    "stream")
        return None
    return BehindFns(follow, back, module.wake)


@functools.cache
def native_behind() -> BehindFns | None:
    """The native calls of a follower behind another process's copy (``_digest.c``'s
    ``digest_behind``, ``digest_back`` and ``wake``), loaded and checked once; None without
    them (kvbridge.scheduling.follow)."""
    return _load_behind()


@functools.cache
def native_copy() -> CopyNative | None:
    """The native copy-and-digest (``_digest.c``), loaded and checked once; None without it."""
    return _load_copy()


@functools.cache
def native() -> Native | None:
    """The native digests (``_digest.c``: one call, the GIL kept or let go once, with up to
    one helper, through xxhash's own XXH3), loaded and checked once; None without them.
    Thread-safe: two first calls at once both load, and get the same answer."""
    return _load_native()


def compute(descs: DescriptorArray) -> bytes:
    """The digests of the stream ``descs`` covers, one per chunk, concatenated.

    Reads the memory in place (no copy). An empty stream has no digests (``b""``). Natively
    where the extension is there (:func:`native`; a stream of :data:`SPLIT_BYTES` or more with
    a helper thread), else in Python (:func:`compute_python`): the same digests."""
    if not len(descs):
        return b""
    total = int(descs[:, 1].sum())
    size = chunk_size(total)
    fn = native()
    if fn is not None:
        rows = np.ascontiguousarray(descs[:, :2], dtype=np.uint64)
        return fn(rows, size, _threads(total), total < KEEP_GIL_BYTES)
    return compute_python(descs, size)


def _threads(total: int) -> int:
    """Threads for a native hash of ``total`` bytes: a helper from :data:`SPLIT_BYTES` where
    this thread may run on more than one core (an engine pinned to one core gains nothing from
    it: the two would take turns; measured 0.1 ms slower for 22.5 MiB)."""
    return 2 if total >= SPLIT_BYTES and len(os.sched_getaffinity(0)) > 1 else 1


def copy_compute(moves: np.ndarray, stop: int = 0, source: bool = False,
                 progress: int = 0) -> bytes | None:
    """Copy ``moves`` (``(n, 3)`` uint64 rows of dst, src, length; not empty) and return the
    digests of the destination stream (the dsts in row order; ``source``: the srcs), as
    :func:`compute` would give them, in one pass (:func:`native_copy`: each piece hashed right
    after it is copied, while it is still in the cache; with a helper thread from
    :data:`SPLIT_BYTES`, unless ``progress``: the address of an 8-byte-aligned uint64 kept at
    the bytes copied so far, on this thread alone, in order, for a follower in another process:
    :mod:`kvbridge.scheduling.follow`).
    None when ``stop`` (the address of an int32, or 0) stopped the copy: part of it may have
    landed. Needs the extension: the caller checks :func:`native_copy` first (without it,
    copy and then :func:`compute`)."""
    fn = native_copy()
    if fn is None:
        raise RuntimeError("kvbridge was built without its native digests")
    rows = np.ascontiguousarray(moves, dtype=np.uint64)
    total = int(rows[:, 2].sum())
    return fn(rows, chunk_size(total), _threads(total), total < KEEP_GIL_BYTES, stop, source,
              progress)


def landing(stream: DescriptorArray, source: bool = False) -> LandingCopy | None:
    """A copy for a READ whose destination is ``stream`` (``source``: a WRITE whose source is)
    (:data:`kvbridge.blocks.LandingCopy`: shm copies a prepared request with it): it copies the
    moves it is given and returns the digests of ``stream`` as :func:`compute` gives them, each
    piece hashed right after it is copied (:func:`copy_compute`; with the progress word the
    transport passes, kept at the bytes copied). Where the moves' destinations (sources) are not
    ``stream`` in order (compared as runs of bytes, however each is cut), it still copies them
    all, without the progress word, and then hashes ``stream``. None without the extension, or
    for an empty stream."""
    if not len(stream) or native_copy() is None:
        return None
    side, runs = (1 if source else 0), _runs(stream[:, 0], stream[:, 1])  # now, off the path

    def copy(moves: np.ndarray, stop: int, progress: int = 0) -> bytes | None:
        in_order = _runs(moves[:, side], moves[:, 2]) == runs
        got = copy_compute(moves, stop, source, progress if in_order else 0)
        return got if got is None or in_order else compute(stream)

    return copy


def _runs(addrs: np.ndarray, lengths: np.ndarray) -> tuple[bytes, bytes]:
    """The byte stream ``(addrs, lengths)`` names, as its maximal contiguous runs (starts,
    lengths), so that two cuts of one stream compare equal."""
    a, n = addrs.astype(np.int64), lengths.astype(np.int64)
    a, n = a[n > 0], n[n > 0]
    if not len(a):
        return b"", b""
    first = np.ones(len(a), dtype=bool)
    first[1:] = a[1:] != a[:-1] + n[:-1]
    starts = np.flatnonzero(first)
    return a[starts].tobytes(), np.add.reduceat(n, starts).tobytes()


def compute_python(descs: DescriptorArray, size: int) -> bytes:
    """:func:`compute` in Python (xxhash fed in pieces that keep the GIL), ``size`` bytes of
    stream per digest; ``descs`` not empty."""
    addrs, lengths = descs[:, 0], descs[:, 1]
    base = int(addrs.min())
    # one view from the lowest to the highest byte named (only the ranges are read)
    memory = _memory(base, int((addrs + lengths).max()) - base, _PyBUF_READ)
    out = bytearray()
    h = xxhash.xxh3_128()
    update = h.update
    left = size
    for pos, end in zip((addrs - base).tolist(), (addrs - base + lengths).tolist(), strict=True):
        if end - pos < left:  # the usual case: the whole range inside the chunk
            feed(update, memory[pos:end])
            left -= end - pos
            continue
        while pos < end:
            take = min(left, end - pos)
            feed(update, memory[pos:pos + take])
            pos += take
            left -= take
            if left == 0:
                out += h.digest()
                h.reset()
                left = size
    if left != size:
        out += h.digest()
    return bytes(out)


def mismatch(expected: bytes | None, descs: DescriptorArray,
             actual: bytes | None = None) -> str | None:
    """None when the stream ``descs`` covers has the digests ``expected`` (the sender's);
    otherwise what differs, naming the first bad chunk and its byte range in the stream.
    ``actual``: the stream's digests, computed already (else computed here)."""
    if expected is None:
        return "the sender sent no digests"
    if actual is None:
        actual = compute(descs)
    if actual == expected:
        return None
    if len(actual) != len(expected):
        return (f"the sender digested {len(expected) // DIGEST_BYTES} chunks, "
                f"{len(actual) // DIGEST_BYTES} landed")
    bad = [i for i in range(0, len(actual), DIGEST_BYTES)
           if actual[i:i + DIGEST_BYTES] != expected[i:i + DIGEST_BYTES]]
    first = bad[0] // DIGEST_BYTES
    total = int(descs[:, 1].sum())
    size = chunk_size(total)
    return (f"digest mismatch in {len(bad)} of {len(actual) // DIGEST_BYTES} chunks, the first "
            f"at bytes {first * size}–{min((first + 1) * size, total) - 1} of the part's "
            f"{total}-byte stream")
