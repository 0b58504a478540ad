"""``disk``: chunks as files under a directory; survives an engine restart (kvbridge.tiers entry).

Layout: ``<path>/<namespace>/<key[:2]>/<key>.kvb``. A file is

    b"KVBCHNK2" | scheme (u8) | key id (8 bytes) | key length (u16) | key (ascii)
                | payload length (u64) | payload | tag

**What is checked.** At start the tier directory ``<path>/<namespace>`` is created if missing
(mode 0700, parents 0700) and checked with :func:`kvbridge.host.files.private_dir`: it must be
this user's and private, and every directory above it (links included) must belong to root or
this user and be closed to writes by others unless sticky; anything else refuses to start with
an error naming the path (:class:`~kvbridge.host.files.UnsafePath`, a ``ConfigError``). The
tier then holds an fd of that directory and does every file operation relative to directory
fds: the two-character prefix directories are opened (made 0700) with ``O_NOFOLLOW`` and must
be this user's and private; chunk files are opened with ``O_NOFOLLOW | O_NONBLOCK`` and must be
regular files of this user's whose ``fstat`` size is exactly the size of a chunk file for that
key — *before* its payload is read. So a link (to another file, to ``/dev/zero``) or a FIFO is
a miss that returns at once and reads nothing, and of a file of the wrong size only the first
17 bytes are read (to tell a truncated chunk of this tier's from someone else's file);
``entries()`` lists regular files only and follows no link either.

**Tag.** With a secret (:attr:`TierContext.secret <kvbridge.offload.tier.TierContext.secret>`,
the engine's: :func:`kvbridge.trust.resolve`) the scheme is HMAC-SHA256 keyed by
``HMAC(secret, b"kvbridge disk tier v2")``, over the namespace, the header, the key and the
payload; the key id is a one-way tag of that key. A chunk whose MAC does not verify is a miss,
never KV: written by someone who does not have the secret, or by a fleet with another secret
sharing the volume. Fleets that share a disk-tier volume must share the secret to share chunks;
otherwise each other's chunks are misses (and a store of the same key replaces the other
fleet's file). Without a secret (an engine explicitly configured insecure) the tag is a CRC32,
which guards against accidents only: anyone who can write the directory can make the engine
serve KV of their choosing. Files of the previous format (``KVBCHNK1``) are misses.

**Misses, and what is removed.** A file this tier can prove it wrote — same magic, scheme and
key id — that is truncated or whose tag or key does not match, or a file too short to hold a
header at all, is *corrupted*: a miss, logged at WARNING and removed (the tier contract).
Anything else — another key id (another secret), the other scheme, another format, a link, a
FIFO or other non-regular file, a file of another owner — is *foreign*: a miss, logged once
per kind at WARNING and **left in place** (it may be another fleet's); a later store of that
key replaces it by rename, and capacity eviction may remove it like any other entry
``entries()`` listed.

Writes go to a temporary file (``O_EXCL | O_NOFOLLOW``, mode 0600) in the prefix directory and
are renamed into place (atomic on POSIX), so a crash leaves either the old state or a leftover
``.tmp-*`` file, which the next start removes; never a half-written chunk under a real name.
``fsync`` (option, default off) makes the data durable across power loss too; without it a power
cut may leave a short file, which the size check turns into a miss. A store that cannot create
a directory or a file is a skipped chunk (logged once, counted by the manager), never an
exception.

Blocking (file I/O); the manager calls it from its I/O thread only.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
import struct
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from kvbridge.errors import ConfigError
from kvbridge.host import files
from kvbridge.host.files import UnsafePath
from kvbridge.offload.config import parse_bool
from kvbridge.offload.tier import Tier, TierContext, check_chunk, is_key

__all__ = ["DiskTier", "MAGIC", "SUFFIX"]

log = logging.getLogger("kvbridge.offload")

MAGIC = b"KVBCHNK2"
SUFFIX = ".kvb"
#: magic | scheme | key id | key length
_HEAD = struct.Struct("<8sB8sH")
#: what identifies a writer: magic | scheme | key id
_WHO = 8 + 1 + 8
_LEN = struct.Struct("<Q")
_HMAC, _CRC = 1, 2
_TAG_BYTES = {_HMAC: 32, _CRC: 4}
_MAC_LABEL = b"kvbridge disk tier v2"
_NO_KEY_ID = bytes(8)


class _Corrupted(ValueError):
    """A chunk this tier wrote that is damaged: a miss, removed."""


class _Foreign(ValueError):
    """A file this tier cannot prove it wrote: a miss, left in place. ``kind`` groups the
    warnings (each kind is logged once)."""

    def __init__(self, kind: str, msg: str) -> None:
        super().__init__(msg)
        self.kind = kind


class DiskTier(Tier):
    """See the module docstring. Options: ``path`` (required), ``capacity_bytes`` (default
    10 GiB), ``fsync`` (default false)."""

    default_capacity = 10 << 30

    def __init__(self, ctx: TierContext) -> None:
        super().__init__(ctx)
        path = ctx.options.get("path")
        if not path:
            raise ConfigError(f"offload tier {ctx.name!r} needs a 'path' option (a directory)")
        if not is_key(ctx.namespace):
            raise ConfigError(f"offload tier {ctx.name!r}: bad namespace {ctx.namespace!r}")
        self.fsync = parse_bool(ctx.options.get("fsync", False),
                                f"offload tier {ctx.name!r}: fsync")
        self.root = Path(os.path.abspath(Path(str(path)).expanduser())) / ctx.namespace
        try:
            self._fd: int | None = files.private_dir(self.root)
        except UnsafePath as exc:
            raise UnsafePath(f"offload tier {ctx.name!r} refuses its directory: {exc}") from None
        except OSError as exc:
            raise ConfigError(f"offload tier {ctx.name!r}: cannot use {self.root}: "
                              f"{exc}") from exc
        if ctx.secret is not None:
            self._scheme = _HMAC
            mac_key = hmac.new(ctx.secret, _MAC_LABEL, hashlib.sha256).digest()
            self._mac: hmac.HMAC | None = hmac.new(mac_key, digestmod=hashlib.sha256)
            ns = ctx.namespace.encode()
            self._mac.update(struct.pack("<H", len(ns)) + ns)
            self._key_id = hmac.new(mac_key, b"key id", hashlib.sha256).digest()[:8]
        else:
            self._scheme, self._mac, self._key_id = _CRC, None, _NO_KEY_ID
        self._tag_bytes = _TAG_BYTES[self._scheme]
        self._warned: set[str] = set()
        try:
            self._remove_leftovers()
        except OSError as exc:
            self.close()
            raise ConfigError(f"offload tier {ctx.name!r}: cannot list {self.root}: "
                              f"{exc}") from exc

    # -- names and directories ---------------------------------------------------------------

    def _path(self, key: str) -> Path:
        """Where ``key``'s chunk lives (for logs and tests; never opened by path)."""
        if not is_key(key):
            raise ValueError(f"not a tier key: {key[:80]!r}")
        return self.root / key[:2] / (key + SUFFIX)

    def _root(self) -> int:
        if self._fd is None:
            raise ValueError(f"offload tier {self.name!r} is closed")
        return self._fd

    @contextmanager
    def _dirs(self) -> Iterator[dict[str, int | None]]:
        """Prefix directory fds opened during one call (None: absent), closed after it."""
        opened: dict[str, int | None] = {}
        try:
            yield opened
        finally:
            for fd in opened.values():
                if fd is not None:
                    os.close(fd)

    def _subdir(self, opened: dict[str, int | None], key: str, *, create: bool) -> int | None:
        """The fd of ``key``'s prefix directory (None when absent and not ``create``); raises
        :class:`OSError` or :class:`UnsafePath` when it cannot be made or is not safe."""
        self._path(key)  # validates the key
        prefix = key[:2]
        if prefix in opened and (opened[prefix] is not None or not create):
            return opened[prefix]
        try:
            fd: int | None = files.subdir(self._root(), prefix, create=create)
        except FileNotFoundError:
            if create:
                raise
            fd = None
        opened[prefix] = fd
        return fd

    def _file_bytes(self, key: str) -> int:
        return _HEAD.size + len(key) + _LEN.size + self.ctx.chunk_bytes + self._tag_bytes

    def _warn_once(self, kind: str, msg: str, *args: object) -> None:
        if kind in self._warned:
            log.debug("offload tier %s: " + msg, self.name, *args)
            return
        self._warned.add(kind)
        log.warning("offload tier %s: " + msg + " (further ones are logged at DEBUG only)",
                    self.name, *args)

    def _remove_leftovers(self) -> None:
        root = self._root()
        for prefix in files.listdir(root):
            if len(prefix) != 2 or not all(c in "0123456789abcdef" for c in prefix):
                continue
            try:
                sub = files.subdir(root, prefix, create=False)
            except (OSError, UnsafePath):
                continue
            try:
                for name in files.listdir(sub):
                    if name.startswith(".tmp-"):
                        files.remove(sub, name)
            finally:
                os.close(sub)

    # -- the format ----------------------------------------------------------------------------

    def _tag(self, parts: Sequence[bytes]) -> bytes:
        if self._mac is not None:
            mac = self._mac.copy()
            for part in parts:
                mac.update(part)
            return mac.digest()
        crc = 0
        for part in parts:
            crc = zlib.crc32(part, crc)
        return struct.pack("<I", crc)

    def _encode(self, key: str, payload: bytes) -> bytes:
        """One chunk file's bytes, as this tier writes them."""
        kb = key.encode()
        head = _HEAD.pack(MAGIC, self._scheme, self._key_id, len(kb)) + kb + \
            _LEN.pack(len(payload))
        return b"".join((head, payload, self._tag((head, payload))))

    def _decode(self, key: str, head: bytes, payload: bytes, tag: bytes) -> bytes:
        """``payload`` if ``head | payload | tag`` is ``key``'s chunk as this tier wrote it;
        :class:`_Foreign` or :class:`_Corrupted` saying what is wrong."""
        magic, scheme, key_id, klen = _HEAD.unpack_from(head)
        self._check_writer(magic, scheme, key_id)
        kb = key.encode()
        if klen != len(kb) or head[_HEAD.size:_HEAD.size + klen] != kb:
            raise _Corrupted("the key inside does not match the file name")
        (length,) = _LEN.unpack_from(head, _HEAD.size + klen)
        if length != self.ctx.chunk_bytes:
            raise _Corrupted(f"payload is {length} bytes, expected {self.ctx.chunk_bytes}")
        if not hmac.compare_digest(self._tag((head, payload)), tag):
            raise _Corrupted("MAC mismatch" if self._mac is not None else "checksum mismatch")
        return payload

    def _check_writer(self, magic: bytes, scheme: int, key_id: bytes) -> None:
        if magic != MAGIC:
            raise _Foreign("format", "not in this tier's format (an older kvbridge's or "
                           "another program's file)")
        if scheme != self._scheme:
            raise _Foreign("scheme", "written by an engine without a secret (CRC only)"
                           if scheme == _CRC else "written by an engine with a secret (MAC)"
                           if scheme == _HMAC else f"unknown scheme {scheme}")
        if key_id != self._key_id:
            raise _Foreign("secret", "written with another secret (another fleet sharing "
                           "this volume, or someone without the secret)")

    def _read(self, sub: int, key: str) -> bytes:
        """``key``'s verified payload; FileNotFoundError, _Foreign, _Corrupted or OSError."""
        name = key + SUFFIX
        try:
            fd, st = files.open_regular(sub, name)
        except UnsafePath as exc:
            raise _Foreign("file", str(exc)) from None
        try:
            expected = self._file_bytes(key)
            if st.st_size != expected:
                who = os.pread(fd, _WHO, 0) if st.st_size >= _WHO else b""
                if len(who) == _WHO:
                    magic, scheme, key_id = who[:8], who[8], who[9:]
                    self._check_writer(magic, scheme, key_id)
                    raise _Corrupted(f"{st.st_size} bytes, expected {expected} (truncated?)")
                # too short to say who wrote it: nobody's chunk (a power cut's leftover)
                raise _Corrupted(f"{st.st_size} bytes, too short for a chunk header")
            hlen = _HEAD.size + len(key) + _LEN.size
            try:
                blob_head = files.read_exactly(fd, hlen)
                payload = files.read_exactly(fd, self.ctx.chunk_bytes, hlen)
                tag = files.read_exactly(fd, self._tag_bytes, hlen + self.ctx.chunk_bytes)
            except ValueError as exc:  # shrank while read: someone is rewriting it
                raise _Foreign("changed", str(exc)) from None
        finally:
            os.close(fd)
        return self._decode(key, blob_head, payload, tag)

    # -- the Tier contract ---------------------------------------------------------------------

    def contains(self, keys: Sequence[str]) -> int:
        n = 0
        with self._dirs() as opened:
            for key in keys:
                try:
                    sub = self._subdir(opened, key, create=False)
                    if sub is None:
                        break
                    st = os.stat(key + SUFFIX, dir_fd=sub, follow_symlinks=False)
                except (OSError, UnsafePath):
                    break
                if not stat.S_ISREG(st.st_mode) or st.st_size != self._file_bytes(key):
                    break
                n += 1
        return n

    def load(self, keys: Sequence[str]) -> list[bytes]:
        out: list[bytes] = []
        with self._dirs() as opened:
            for key in keys:
                path = self._path(key)
                sub: int | None = None
                try:
                    sub = self._subdir(opened, key, create=False)
                    if sub is None:
                        break
                    out.append(self._read(sub, key))
                except FileNotFoundError:
                    break
                except _Corrupted as exc:
                    log.warning("offload tier %s: chunk %s is corrupted (%s): a miss, file "
                                "removed; its KV is recomputed", self.name, path, exc)
                    if sub is not None:
                        files.remove(sub, key + SUFFIX)
                    break
                except _Foreign as exc:
                    self._warn_once(f"foreign {exc.kind}", "%s is not a chunk this engine can "
                                    "trust (%s): a miss, left in place", path, exc)
                    break
                except UnsafePath as exc:  # the prefix directory
                    self._warn_once("foreign dir", "%s is refused (%s): a miss", path.parent,
                                    exc)
                    break
                except OSError as exc:
                    self._warn_once("read", "cannot read %s: %s (a miss)", path, exc)
                    break
        return out

    def store(self, items: Sequence[tuple[str, bytes]]) -> list[str]:
        stored = []
        with self._dirs() as opened:
            for key, data in items:
                check_chunk(self.ctx, key, data)
                path = self._path(key)
                try:
                    sub = self._subdir(opened, key, create=True)
                    assert sub is not None
                    files.write_atomic(sub, key + SUFFIX, self._encode(key, data),
                                       fsync=self.fsync)
                except (OSError, UnsafePath) as exc:
                    self._warn_once("store", "cannot write %s: %s (skipped; the manager counts "
                                    "it)", path, exc)
                    continue
                stored.append(key)
        return stored

    def evict(self, keys: Sequence[str]) -> None:
        with self._dirs() as opened:
            for key in keys:
                try:
                    sub = self._subdir(opened, key, create=False)
                    if sub is not None:
                        files.remove(sub, key + SUFFIX)
                except (OSError, UnsafePath) as exc:
                    self._warn_once("evict", "cannot remove %s: %s", self._path(key), exc)

    def entries(self) -> list[tuple[str, int]]:
        root = self._root()
        found = []
        for prefix in files.listdir(root):
            if len(prefix) != 2 or not all(c in "0123456789abcdef" for c in prefix):
                continue
            try:
                sub = files.subdir(root, prefix, create=False)
            except (OSError, UnsafePath) as exc:
                self._warn_once("entries", "skipping %s: %s", self.root / prefix, exc)
                continue
            try:
                for name in files.listdir(sub):
                    key = name[: -len(SUFFIX)]
                    if not name.endswith(SUFFIX) or not is_key(key) or key[:2] != prefix:
                        continue
                    try:
                        st = os.stat(name, dir_fd=sub, follow_symlinks=False)
                    except OSError:
                        continue
                    if stat.S_ISREG(st.st_mode):
                        found.append((st.st_mtime, key, st.st_size))
            finally:
                os.close(sub)
        found.sort()
        return [(key, size) for _, key, size in found]

    def describe(self) -> str:
        how = "HMAC-SHA256 per chunk" if self._mac is not None else \
            "CRC32 per chunk, no secret: accidents only"
        return f"{self.name} at {self.root} (capacity {self.capacity_bytes} bytes, {how})"

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
