"""``disk``: chunks as files under a directory; survives an engine restart (kvbridge.tiers entry).

Layout: ``<path>/<namespace>/<key[:2]>/<key>.kvb``, the directory created mode 0700. A file is

    b"KVBCHNK1" | key length (u16) | key (ascii) | payload length (u64) | crc32 (u32) | payload

Writes go to a temporary file in the same directory and are renamed into place (atomic on
POSIX), so a crash leaves either the old state or a leftover ``.tmp-*`` file, which the next
start removes; never a half-written chunk under a real name. ``fsync`` (option, default off)
makes the data durable across power loss too; without it a power cut may leave a short file,
which the checksum turns into a miss. Every load re-checks magic, key, length and CRC: a
corrupted or truncated file is a miss, logged at WARNING and deleted — never wrong KV. The CRC
guards against accidents, not an attacker with write access to the directory (keep it private:
docs/offload.md).

Blocking (file I/O); the manager calls it from its I/O thread only.
"""

from __future__ import annotations

import logging
import os
import struct
import tempfile
import zlib
from collections.abc import Sequence
from pathlib import Path

from kvbridge.errors import ConfigError
from kvbridge.offload.config import parse_bool
from kvbridge.offload.tier import Tier, TierContext, check_chunk, is_key

__all__ = ["DiskTier"]

log = logging.getLogger("kvbridge.offload")

MAGIC = b"KVBCHNK1"
_HEAD = struct.Struct("<8sH")
_TAIL = struct.Struct("<QI")
SUFFIX = ".kvb"


def encode(key: str, payload: bytes) -> bytes:
    """One chunk file's bytes (exposed for tests that corrupt files on purpose)."""
    kb = key.encode()
    return b"".join((_HEAD.pack(MAGIC, len(kb)), kb,
                     _TAIL.pack(len(payload), zlib.crc32(payload)), payload))


def decode(key: str, blob: bytes, expected_len: int) -> bytes:
    """The payload of ``blob``; :class:`ValueError` saying what is wrong."""
    if len(blob) < _HEAD.size:
        raise ValueError(f"truncated header ({len(blob)} bytes)")
    magic, klen = _HEAD.unpack_from(blob)
    if magic != MAGIC:
        raise ValueError("bad magic")
    off = _HEAD.size
    if blob[off:off + klen] != key.encode():
        raise ValueError("key does not match the file name")
    off += klen
    if len(blob) < off + _TAIL.size:
        raise ValueError("truncated header")
    length, crc = _TAIL.unpack_from(blob, off)
    off += _TAIL.size
    if length != expected_len:
        raise ValueError(f"payload is {length} bytes, expected {expected_len}")
    payload = blob[off:]
    if len(payload) != length:
        raise ValueError(f"truncated payload ({len(payload)} of {length} bytes)")
    if zlib.crc32(payload) != crc:
        raise ValueError("checksum mismatch")
    return payload


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
        self.root = Path(str(path)).expanduser() / ctx.namespace
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise ConfigError(f"offload tier {ctx.name!r}: cannot create {self.root}: "
                              f"{exc}") from exc
        self.fsync = parse_bool(ctx.options.get("fsync", False),
                                f"offload tier {ctx.name!r}: fsync")
        self._warned: set[str] = set()
        self._remove_leftovers()

    def _path(self, key: str) -> Path:
        if not is_key(key):
            raise ValueError(f"not a tier key: {key[:80]!r}")
        return self.root / key[:2] / (key + SUFFIX)

    def _remove_leftovers(self) -> None:
        for tmp in self.root.glob("*/.tmp-*"):
            tmp.unlink(missing_ok=True)

    def contains(self, keys: Sequence[str]) -> int:
        n = 0
        for key in keys:
            if not self._path(key).is_file():
                break
            n += 1
        return n

    def load(self, keys: Sequence[str]) -> list[bytes]:
        out: list[bytes] = []
        for key in keys:
            path = self._path(key)
            try:
                blob = path.read_bytes()
            except FileNotFoundError:
                break
            except OSError as exc:
                log.warning("offload tier %s: cannot read %s: %s (a miss)", self.name, path, exc)
                break
            try:
                out.append(decode(key, blob, self.ctx.chunk_bytes))
            except ValueError as exc:
                log.warning("offload tier %s: chunk %s is corrupted (%s): a miss, file removed; "
                            "its KV is recomputed", self.name, path, exc)
                path.unlink(missing_ok=True)
                break
        return out

    def store(self, items: Sequence[tuple[str, bytes]]) -> list[str]:
        stored = []
        for key, data in items:
            check_chunk(self.ctx, key, data)
            path = self._path(key)
            path.parent.mkdir(exist_ok=True, mode=0o700)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(encode(key, data))
                    if self.fsync:
                        f.flush()
                        os.fsync(f.fileno())
                os.replace(tmp, path)
            except OSError as exc:
                Path(tmp).unlink(missing_ok=True)
                if "store" not in self._warned:
                    self._warned.add("store")
                    log.warning("offload tier %s: cannot write %s: %s (further failures are "
                                "only counted)", self.name, path, exc)
                continue
            stored.append(key)
        return stored

    def evict(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._path(key).unlink(missing_ok=True)

    def entries(self) -> list[tuple[str, int]]:
        found = []
        for path in self.root.glob(f"*/*{SUFFIX}"):
            key = path.name[: -len(SUFFIX)]
            if not is_key(key):
                continue
            try:
                st = path.stat()
            except OSError:
                continue
            found.append((st.st_mtime, key, st.st_size))
        found.sort()
        return [(key, size) for _, key, size in found]

    def describe(self) -> str:
        return f"{self.name} at {self.root} (capacity {self.capacity_bytes} bytes)"

