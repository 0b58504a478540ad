"""``mooncake_store``: Mooncake Store as a remote offload tier shared by several engines.

Entry point ``mooncake_store`` in ``kvbridge.tiers``. Every engine (every worker rank) that
names this tier runs one Mooncake Store *client* that talks to one ``mooncake_master`` and
contributes ``global_segment_bytes`` of its host memory to the store; objects live in the
segments of all clients together, so a chunk stored by one engine is loaded by any other engine
of the same model and KV layout. The master decides placement and evicts (``managed = False``):
``capacity_bytes`` is informational only.

Objects are named ``kvb/<namespace>/<key>`` (namespaces never collide) and hold a 16-byte frame
before the chunk: ``b"KVBMC001"`` | payload length (u32) | crc32 (u32). Every load checks that
the object is exactly that long, the magic, the length (= ``chunk_bytes``) and the CRC: a
short, long or corrupted object (another writer, an eviction racing a slow read) is a miss,
logged at WARNING and removed — never wrong KV.

**Blocking**: every method does network round trips to the master and to the segment owners
(``blocking = True``; the manager calls it from its I/O thread only). A store with a dead master
costs seconds per call (Mooncake retries writes about 4 s); reads fail within milliseconds.

**Partial failure**: Mooncake answers error codes, not exceptions. ``contains``/``load`` stop at
the first key that is absent *or* fails (the error is logged once per code at WARNING);
``store`` returns only the keys whose put answered 0 — a failed one is absent, never half
written (Mooncake makes an object visible only when its put completes). Chunks stored in the
segment of an engine that stops vanish with it: a miss, recomputed.

Several clients in one process are supported (each instance owns one); see
``docs/backends/mooncake_store.md``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import socket
import struct
import threading
import time
import zlib
from collections.abc import Sequence
from typing import Any, ClassVar
from urllib.parse import urlsplit

from kvbridge.errors import BackendUnavailable, ConfigError
from kvbridge.offload.config import parse_size
from kvbridge.offload.tier import Tier, TierContext, TierError, check_chunk, is_key
from kvbridge_mooncake._engine import APT_HINT, PIP_HINT

__all__ = ["MooncakeStoreTier", "ERROR_NAMES", "FRAME"]

log = logging.getLogger("kvbridge.offload")

MAGIC = b"KVBMC001"
#: the frame before every chunk: magic, payload length, crc32 of the payload
FRAME = struct.Struct("<8sII")

#: Mooncake's ``ErrorCode`` values that its Python API returns (mooncake-store/include/types.h)
ERROR_NAMES: dict[int, str] = {
    -1: "INTERNAL_ERROR", -10: "BUFFER_OVERFLOW", -101: "SEGMENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE (store full)", -400: "INVALID_KEY", -500: "WRITE_FAIL",
    -600: "INVALID_PARAMS", -601: "ILLEGAL_CLIENT", -700: "INVALID_WRITE",
    -701: "INVALID_READ", -703: "REPLICA_IS_NOT_READY", -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS", -706: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL", -900: "RPC_FAIL (master unreachable?)", -901: "RPC_TIMEOUT",
}
NOT_FOUND = -704
TOO_SMALL = -600  # batch_get_into: the object is larger than the slot

ENV_MASTER = "MOONCAKE_MASTER"  # the names Mooncake's own config loader reads
ENV_METADATA = "MOONCAKE_TE_META_DATA_SERVER"


def _import_store_class() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ModuleNotFoundError as exc:
        raise BackendUnavailable(f"offload tier mooncake_store: Mooncake is not installed — "
                                 f"{PIP_HINT}") from exc
    except ImportError as exc:
        text = str(exc).splitlines()[0] if str(exc) else repr(exc)
        hint = APT_HINT if ("libibverbs" in text or "libnl" in text) else PIP_HINT
        raise BackendUnavailable(f"offload tier mooncake_store: mooncake.store cannot load "
                                 f"({text}) — {hint}") from exc
    return MooncakeDistributedStore


def _host_port(text: str, what: str, tier: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"offload tier {tier!r}: {what} must be host:port, got {text!r}")
    return host.strip("[]"), int(port)


def _code(rc: int) -> str:
    return f"{rc} {ERROR_NAMES.get(rc, 'unknown error')}"


class MooncakeStoreTier(Tier):
    """See the module docstring.

    Options: ``master`` (``host:port`` of mooncake_master; default ``$MOONCAKE_MASTER``),
    ``metadata_url`` (the master's HTTP metadata server, ``http://host:port/metadata``, or
    ``P2PHANDSHAKE``; default ``$MOONCAKE_TE_META_DATA_SERVER``), ``local_hostname``
    (``127.0.0.1``; the address other clients reach this one at), ``global_segment_bytes``
    (host memory this engine contributes, default 1 GiB; 0 = contribute nothing; sizes take
    bytes or ``"1GiB"``),
    ``local_buffer_bytes`` (Mooncake's own transfer buffer, default 16 MiB), ``protocol``
    (``tcp``; ``rdma`` needs a device), ``device`` (RDMA device names, default ``""``),
    ``batch_bytes`` (registered staging memory one batch moves through, default 64 MiB),
    ``connect_timeout_s`` (the reachability check before set-up, default 5),
    ``capacity_bytes`` (informational: the master evicts).
    """

    managed: ClassVar[bool] = False
    #: what to install when Mooncake is missing (kvbridge.registry.install_hint)
    install_hint: ClassVar[str] = ("pip install mooncake-transfer-engine-non-cuda and apt-get "
                                   "install -y libibverbs1; run mooncake_master (docs/offload.md)")
    blocking: ClassVar[bool] = True
    default_capacity: ClassVar[int] = 1 << 30

    @classmethod
    def probe(cls) -> str:
        """One line for ``kvbridge backends`` and the doctor: ``mooncake.store`` imports here;
        raises :class:`BackendUnavailable` with the install hint when it does not."""
        _import_store_class()
        return "ok (mooncake.store imports; the master is checked at start-up)"

    def __init__(self, ctx: TierContext) -> None:
        super().__init__(ctx)
        self._client: Any = None
        self._buf: mmap.mmap | None = None
        self._base = 0  # address of self._buf
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        master = str(ctx.options.get("master") or os.environ.get(ENV_MASTER) or "")
        metadata = str(ctx.options.get("metadata_url") or os.environ.get(ENV_METADATA) or "")
        if not master:
            raise ConfigError(f"offload tier {ctx.name!r} needs a 'master' option (host:port "
                              f"of mooncake_master) or ${ENV_MASTER}")
        if not metadata:
            raise ConfigError(f"offload tier {ctx.name!r} needs a 'metadata_url' option "
                              f"(http://host:port/metadata of mooncake_master's HTTP metadata "
                              f"server, or P2PHANDSHAKE) or ${ENV_METADATA}")
        if not is_key(ctx.namespace):
            raise ConfigError(f"offload tier {ctx.name!r}: bad namespace {ctx.namespace!r}")
        self.master = master
        self.metadata_url = metadata
        self.local_hostname = str(ctx.option("local_hostname", "127.0.0.1", str))
        self.global_segment_bytes = self._size("global_segment_bytes", 1 << 30)
        self.local_buffer_bytes = self._size("local_buffer_bytes", 16 << 20)
        self.protocol = str(ctx.option("protocol", "tcp", str))
        self.device = str(ctx.option("device", "", str))
        batch_bytes = self._size("batch_bytes", 64 << 20)
        self.connect_timeout_s = float(ctx.option("connect_timeout_s", 5.0, float))
        if self.global_segment_bytes < 0 or self.local_buffer_bytes <= 0:
            raise ConfigError(f"offload tier {ctx.name!r}: global_segment_bytes must be >= 0 "
                              f"and local_buffer_bytes > 0")
        self.prefix = f"kvb/{ctx.namespace}/"
        self.slot = FRAME.size + ctx.chunk_bytes
        self.slots = max(1, batch_bytes // self.slot)

        store_class = _import_store_class()  # BackendUnavailable when Mooncake cannot load
        self._check_reachable()
        try:
            self._connect(store_class)
        except BaseException:
            self.close()
            raise

    # -- set-up -----------------------------------------------------------------------------

    def _size(self, key: str, default: int) -> int:
        """A size option: bytes as an integer or ``"1GiB"``-style text."""
        return int(self.ctx.option(key, default, lambda raw: parse_size(raw, key)))

    def _check_reachable(self) -> None:
        """Fail fast on a dead master: Mooncake's own set-up retries for about 90 s."""
        targets = [("master", *_host_port(self.master, "master", self.name))]
        url = urlsplit(self.metadata_url)
        if url.scheme in ("http", "https") and url.hostname:
            targets.append(("metadata server", url.hostname,
                            url.port or (443 if url.scheme == "https" else 80)))
        for what, host, port in targets:
            try:
                with socket.create_connection((host, port), timeout=self.connect_timeout_s):
                    pass
            except OSError as exc:
                raise TierError(f"offload tier {self.name!r}: mooncake {what} {host}:{port} is "
                                f"unreachable ({exc}); master {self.master}, metadata "
                                f"{self.metadata_url} — is mooncake_master running?") from exc

    def _connect(self, store_class: Any) -> None:
        started = time.monotonic()
        client = store_class()
        rc = client.setup(self.local_hostname, self.metadata_url, self.global_segment_bytes,
                          self.local_buffer_bytes, self.protocol, self.device, self.master)
        if rc != 0:
            with contextlib.suppress(Exception):
                client.close()
            raise TierError(f"offload tier {self.name!r}: Mooncake Store set-up against master "
                            f"{self.master} (metadata {self.metadata_url}, protocol "
                            f"{self.protocol!r}) failed with rc {rc} after "
                            f"{time.monotonic() - started:.1f} s — see the Mooncake log above")
        self._client = client
        health = client.health_check()
        if health != 0:
            raise TierError(f"offload tier {self.name!r}: Mooncake Store master {self.master} "
                            f"fails its health check (rc {health}: 1 = not initialised, "
                            f"2 = master unreachable)")
        self._buf = mmap.mmap(-1, self.slot * self.slots)
        anchor = ctypes.c_char.from_buffer(self._buf)
        self._base = ctypes.addressof(anchor)
        del anchor  # no exported pointer may outlive the mmap (close() needs that)
        rc = client.register_buffer(self._base, self.slot * self.slots)
        if rc != 0:
            self._base = 0
            raise TierError(f"offload tier {self.name!r}: Mooncake Store cannot register "
                            f"{self.slot * self.slots} bytes of staging memory (rc "
                            f"{_code(rc)}; protocol {self.protocol!r})")
        log.info("offload tier %s: Mooncake Store client up in %.2f s (master %s, segment %d "
                 "bytes, %d chunks per batch)", self.name, time.monotonic() - started,
                 self.master, self.global_segment_bytes, self.slots)

    # -- helpers ----------------------------------------------------------------------------

    def _key(self, key: str) -> str:
        if not is_key(key):
            raise ValueError(f"not a tier key: {key[:80]!r}")
        return self.prefix + key

    def _live(self) -> Any:
        if self._client is None:
            raise TierError(f"offload tier {self.name!r} is closed")
        return self._client

    def _warn_once(self, what: str, rc: int, detail: str) -> None:
        tag = f"{what}:{rc}"
        if tag in self._warned:
            return
        self._warned.add(tag)
        log.warning("offload tier %s: Mooncake %s failed with %s (%s; master %s); further "
                    "failures of this kind are only counted", self.name, what, _code(rc),
                    detail, self.master)

    # -- the Tier contract ------------------------------------------------------------------

    def contains(self, keys: Sequence[str]) -> int:
        client = self._live()
        names = [self._key(k) for k in keys]
        n = 0
        for start in range(0, len(names), 1024):
            answers = client.batch_is_exist(names[start:start + 1024])
            for name, rc in zip(names[start:start + 1024], answers, strict=False):
                if rc != 1:
                    if rc != 0:
                        self._warn_once("batch_is_exist", rc, f"at {name}: counted as absent")
                    return n
                n += 1
            if len(answers) < min(1024, len(names) - start):
                return n
        return n

    def load(self, keys: Sequence[str]) -> list[bytes]:
        names = [self._key(k) for k in keys]
        out: list[bytes] = []
        with self._lock:
            client = self._live()
            assert self._buf is not None
            for start in range(0, len(names), self.slots):
                batch = names[start:start + self.slots]
                ptrs = [self._base + i * self.slot for i in range(len(batch))]
                got = client.batch_get_into(batch, ptrs, [self.slot] * len(batch))
                for i, name in enumerate(batch):
                    rc = got[i] if i < len(got) else -1
                    chunk = self._verified(name, i, rc)
                    if chunk is None:
                        return out
                    out.append(chunk)
        return out

    def _verified(self, name: str, slot: int, rc: int) -> bytes | None:
        """The chunk in staging ``slot`` if ``rc`` says it is complete and it checks out."""
        assert self._buf is not None
        if rc == NOT_FOUND:
            return None
        problem = ""
        if rc == TOO_SMALL:
            problem = f"larger than {self.slot} bytes"
        elif rc < 0:
            self._warn_once("batch_get_into", rc, f"at {name}: a miss")
            return None
        elif rc != self.slot:
            problem = f"{rc} bytes, expected {self.slot}"
        else:
            off = slot * self.slot
            magic, length, crc = FRAME.unpack_from(self._buf, off)
            payload = self._buf[off + FRAME.size:off + self.slot]
            if magic != MAGIC:
                problem = "not a kvbridge chunk (bad magic)"
            elif length != self.ctx.chunk_bytes:
                problem = f"payload length {length}, expected {self.ctx.chunk_bytes}"
            elif zlib.crc32(payload) != crc:
                problem = "checksum mismatch"
            else:
                return payload
        log.warning("offload tier %s: object %s is corrupted (%s): a miss, removed; its KV is "
                    "recomputed", self.name, name, problem)
        self._remove([name])
        return None

    def store(self, items: Sequence[tuple[str, bytes]]) -> list[str]:
        for key, data in items:
            self._key(key)
            check_chunk(self.ctx, key, data)
        stored: list[str] = []
        with self._lock:
            client = self._live()
            assert self._buf is not None
            for start in range(0, len(items), self.slots):
                batch = items[start:start + self.slots]
                names, ptrs = [], []
                for i, (key, data) in enumerate(batch):
                    off = i * self.slot
                    FRAME.pack_into(self._buf, off, MAGIC, len(data), zlib.crc32(data))
                    self._buf[off + FRAME.size:off + self.slot] = data
                    names.append(self._key(key))
                    ptrs.append(self._base + off)
                # upsert, not put: put leaves an existing object unchanged and still answers 0
                answers = client.batch_upsert_from(names, ptrs, [self.slot] * len(batch))
                for i, (key, _) in enumerate(batch):
                    rc = answers[i] if i < len(answers) else -1
                    if rc == 0:
                        stored.append(key)
                    else:
                        self._warn_once("batch_upsert_from", rc, f"at {names[i]}: not stored")
        return stored

    def evict(self, keys: Sequence[str]) -> None:
        self._live()
        self._remove([self._key(k) for k in keys])

    def _remove(self, names: list[str]) -> None:
        # force: a chunk another engine read in the last lease period (10 s) is still removed
        answers = self._live().batch_remove(names, True)
        for name, rc in zip(names, answers, strict=False):
            if rc not in (0, NOT_FOUND):
                self._warn_once("batch_remove", rc, f"at {name}: left to the master's eviction")

    def describe(self) -> str:
        return (f"{self.name} (Mooncake Store, master {self.master}, contributes "
                f"{self.global_segment_bytes} bytes; the master evicts)")

    def close(self) -> None:
        """Unmount this client's segment (its chunks vanish from the store) and disconnect.

        Idempotent. Blocking: fast with a live master, about 13 s when the master is gone.
        """
        with self._lock:
            client, self._client = self._client, None
            buf, self._buf = self._buf, None
            base, self._base = self._base, 0
            if client is not None:
                try:
                    if base:
                        client.unregister_buffer(base)
                    client.close()
                except Exception as exc:  # never let teardown raise
                    log.warning("offload tier %s: closing the Mooncake Store client failed: "
                                "%s", self.name, exc)
            if buf is not None:
                buf.close()
