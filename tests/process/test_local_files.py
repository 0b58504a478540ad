"""Local files another process may have touched (issue 25, part 4): the disk offload tier trusts
nothing on disk it did not check.

Disk tier: its directory and every parent are checked for owner and mode (refused naming the
path); chunk files are opened relative to directory fds with ``O_NOFOLLOW``, regular files only,
sized by ``fstat`` before a byte is read, so a link, a FIFO, ``/dev/zero`` or a huge file is a
prompt miss; chunks carry a MAC keyed by the engine's secret, so a chunk written by someone
without it (the old CRC format included) or by a fleet with another secret is a miss, never KV,
and another fleet's chunk is left in place; a store that cannot make its directory is a counted
skip. Range copy: the cache directory chain is checked, and the library loaded is the inode that
was checked (through its fd), not whatever the path names by then.

Tests that need a file of another owner run as root and give it to uid 1000 (CI); elsewhere they
are skipped.
"""

from __future__ import annotations

import logging
import os
import pwd
import shutil
import struct
import subprocess
import sys
import threading
import uuid
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvbridge.host.files import UnsafePath
from kvbridge.layout import KVLayout
from kvbridge.offload.blocks import BlockIO
from kvbridge.offload.config import OffloadConfig
from kvbridge.offload.manager import OffloadManager, build_tiers
from kvbridge.offload.orders import OffloadPlan, StoreOrder
from kvbridge.offload.tier import TierContext
from kvbridge.offload.tiers.disk import SUFFIX, DiskTier
from kvbridge.testing.conformance import CHUNK, chunk_of

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
NS = "ab" * 16
SECRET = b"fleet-one-secret-0123456789abcdef"
OTHER_SECRET = b"fleet-two-secret-fedcba9876543210"


def _other_uid() -> int:
    """A uid that is not ours, to give files to (root only: CI runs as root with uid 1000)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file to another user")
    try:
        pwd.getpwuid(1000)
    except KeyError:
        pytest.skip("no user with uid 1000 here")
    return 1000


def _ctx(path: Path, secret: bytes | None = None, **opts: Any) -> TierContext:
    extra: dict[str, Any] = {"secret": secret} if secret is not None else {}
    return TierContext("disk", CHUNK, NS, {"path": str(path), **opts}, **extra)


def _disk(path: Path, secret: bytes | None = None) -> DiskTier:
    return DiskTier(_ctx(path, secret))


def _key() -> str:
    return uuid.uuid4().hex


@pytest.fixture(params=[None, SECRET], ids=["no-secret", "secret"])
def secret(request: pytest.FixtureRequest) -> bytes | None:
    """Every file-type defect is tested with and without a secret (the checks do not depend
    on it)."""
    value: bytes | None = request.param
    return value


# -- the tier directory and its parents ------------------------------------------------------------


def test_tier_directory_of_another_user_is_refused_naming_it(tmp_path: Path) -> None:
    uid = _other_uid()
    tier_dir = tmp_path / "kv" / NS
    tier_dir.mkdir(parents=True, mode=0o700)
    os.chown(tier_dir, uid, uid)
    with pytest.raises(UnsafePath, match=f"{tier_dir}.*uid {uid}"):
        _disk(tmp_path / "kv")


def test_path_directory_of_another_user_is_refused_naming_it(tmp_path: Path) -> None:
    uid = _other_uid()
    (tmp_path / "kv").mkdir(mode=0o755)
    os.chown(tmp_path / "kv", uid, uid)
    with pytest.raises(UnsafePath, match=f"{tmp_path / 'kv'} .*belongs to another user"):
        _disk(tmp_path / "kv")


@pytest.mark.parametrize("where,mode", [
    ("tier", 0o770),    # the tier directory itself, group-writable
    ("tier", 0o750),    # ... or only group-readable: chunks are KV, private to the engine
    ("path", 0o777),    # the configured path (parent of the tier directory), world-writable
    ("above", 0o775),   # a directory further up, group-writable
])
def test_directory_others_may_write_is_refused_naming_it(tmp_path: Path, where: str,
                                                        mode: int) -> None:
    above = tmp_path / "above"
    path = above / "kv"
    tier_dir = path / NS
    tier_dir.mkdir(parents=True, mode=0o700)
    target = {"tier": tier_dir, "path": path, "above": above}[where]
    os.chmod(target, mode)
    with pytest.raises(UnsafePath, match=str(target)):
        _disk(path)


def test_sticky_world_writable_parent_and_own_links_are_accepted(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # like /tmp
    (tmp_path / "mine").symlink_to(shared)
    tier = _disk(tmp_path / "mine" / "kv", SECRET)
    k = _key()
    assert tier.store([(k, chunk_of(k))]) == [k]
    assert [bytes(x) for x in tier.load([k])] == [chunk_of(k)]
    assert os.stat(shared / "kv" / NS).st_mode & 0o777 == 0o700
    tier.close()


def test_parent_link_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    uid = _other_uid()
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    os.lchown(link, uid, uid)
    with pytest.raises(UnsafePath, match=f"{link} is a symbolic link owned by uid {uid}"):
        _disk(link / "kv")
    assert not (real / "kv").exists()  # nothing was created through it


# -- chunk files that are not what they claim --------------------------------------------------


def test_correct_chunk_round_trips_with_a_secret(tmp_path: Path) -> None:
    tier = _disk(tmp_path, SECRET)
    keys = [_key() for _ in range(3)]
    assert tier.store([(k, chunk_of(k)) for k in keys]) == keys
    again = _disk(tmp_path, SECRET)  # another process of the same fleet: same secret
    assert again.contains(keys) == 3
    assert [bytes(x) for x in again.load(keys)] == [chunk_of(k) for k in keys]
    assert sorted(k for k, _ in again.entries()) == sorted(keys)
    assert "HMAC-SHA256" in again.describe()
    tier.close()
    again.close()


def test_chunk_replaced_by_a_link_is_a_miss_not_followed(tmp_path: Path,
                                                        secret: bytes | None) -> None:
    tier = _disk(tmp_path / "kv", secret)
    a, b = _key(), _key()
    tier.store([(a, chunk_of(a)), (b, chunk_of(b))])
    elsewhere = tmp_path / "elsewhere.kvb"
    path = tier._path(b)
    shutil.copyfile(path, elsewhere)  # a valid chunk for b, outside the tier directory
    path.unlink()
    path.symlink_to(elsewhere)
    assert tier.contains([a, b]) == 1
    assert [bytes(x) for x in tier.load([a, b])] == [chunk_of(a)]
    assert path.is_symlink() and elsewhere.exists()  # neither followed nor "cleaned" through
    assert tier.store([(b, chunk_of(b))]) == [b]  # a store replaces the link itself
    assert not path.is_symlink() and elsewhere.exists()
    assert [bytes(x) for x in tier.load([b])] == [chunk_of(b)]
    tier.close()


def test_chunk_replaced_by_a_fifo_is_a_prompt_miss(tmp_path: Path, secret: bytes | None) -> None:
    tier = _disk(tmp_path / "kv", secret)
    k = _key()
    tier.store([(k, chunk_of(k))])
    path = tier._path(k)
    path.unlink()
    os.mkfifo(path, 0o600)
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.append(tier.load([k])), daemon=True)
    reader.start()
    reader.join(timeout=5)
    try:
        assert not reader.is_alive(), "load blocked on a FIFO (the I/O thread would hang)"
        assert got == [[]]
        assert tier.contains([k]) == 0
    finally:
        if reader.is_alive():  # the old behaviour: release the blocked open
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            reader.join(timeout=5)
    tier.close()


_LOAD_UNDER_A_MEMORY_LIMIT = """
import resource, sys, time
from kvbridge.offload.tiers.disk import DiskTier
from kvbridge.offload.tier import TierContext
tier = DiskTier(TierContext("disk", int(sys.argv[3]), sys.argv[4], {"path": sys.argv[1]}))
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
t0 = time.monotonic()
got = tier.load([sys.argv[2]])
print(len(got), round(time.monotonic() - t0, 3))
"""


@pytest.mark.parametrize("what", ["/dev/zero", "sparse 64 GiB file"])
def test_chunk_that_would_exhaust_memory_is_a_miss_without_reading_it(tmp_path: Path,
                                                                      what: str) -> None:
    """Run in a child with a 3 GiB address-space limit: reading the file whole would fail
    there (MemoryError) instead of exhausting the machine's memory."""
    tier = _disk(tmp_path / "kv")
    k = _key()
    tier.store([(k, chunk_of(k))])
    path = tier._path(k)
    path.unlink()
    if what == "/dev/zero":
        path.symlink_to("/dev/zero")
    else:
        with open(path, "wb") as f:
            f.truncate(64 << 30)
    tier.close()
    proc = subprocess.run([sys.executable, "-c", _LOAD_UNDER_A_MEMORY_LIMIT, str(tmp_path / "kv"),
                           k, str(CHUNK), NS], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    n, seconds = proc.stdout.split()
    assert n == "0" and float(seconds) < 1.0


def test_chunk_of_the_old_crc_format_is_a_miss(tmp_path: Path, secret: bytes | None,
                                               caplog: Any) -> None:
    """KVBCHNK1 | key length | key | payload length | crc32 | payload: a valid CRC, which
    anyone can compute, no longer makes it KV."""
    tier = _disk(tmp_path, secret)
    k = _key()
    payload = b"\x42" * CHUNK  # what an attacker wants the engine to serve
    kb = k.encode()
    old = b"".join((struct.pack("<8sH", b"KVBCHNK1", len(kb)), kb,
                    struct.pack("<QI", len(payload), zlib.crc32(payload)), payload))
    path = tier._path(k)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    path.write_bytes(old)
    assert tier.load([k]) == []
    assert "not in this tier's format" in caplog.text and path.exists()  # left in place
    assert tier.store([(k, chunk_of(k))]) == [k]  # replaced by a real chunk
    assert [bytes(x) for x in tier.load([k])] == [chunk_of(k)]
    tier.close()


def test_chunk_of_another_secret_is_a_miss_and_left_in_place(tmp_path: Path, caplog: Any) -> None:
    """Two fleets with different secrets share one volume (same path, same namespace): each
    one's chunks are misses for the other, and neither deletes the other's."""
    mine, theirs = _disk(tmp_path, SECRET), _disk(tmp_path, OTHER_SECRET)
    k = _key()
    assert theirs.store([(k, chunk_of(k))]) == [k]
    path = theirs._path(k)
    before = path.read_bytes()
    with caplog.at_level(logging.WARNING, logger="kvbridge.offload"):
        assert mine.load([k]) == []
        assert mine.load([k]) == []
    assert path.read_bytes() == before  # not deleted, not touched
    assert [bytes(x) for x in theirs.load([k])] == [chunk_of(k)]
    warnings = [r for r in caplog.records if "another secret" in r.getMessage()]
    assert len(warnings) == 1  # logged once, not per lookup
    mine.close()
    theirs.close()


def test_chunk_written_without_a_secret_is_a_miss_for_an_engine_with_one(tmp_path: Path) -> None:
    """Downgrade: someone who writes the CRC variant of the new format (no secret needed)."""
    insecure, mine = _disk(tmp_path), _disk(tmp_path, SECRET)
    k = _key()
    insecure.store([(k, b"\x42" * CHUNK)])
    assert mine.load([k]) == [] and insecure._path(k).exists()
    assert "CRC32" in insecure.describe()
    insecure.close()
    mine.close()


def test_chunk_rewritten_by_someone_without_the_secret_is_a_miss(tmp_path: Path) -> None:
    """Someone who can write the directory but has not the secret copies a genuine chunk's
    header (key id included) and puts their own payload in: the MAC does not verify."""
    tier = _disk(tmp_path, SECRET)
    k = _key()
    tier.store([(k, chunk_of(k))])
    path = tier._path(k)
    genuine = path.read_bytes()
    head = len(genuine) - CHUNK - 32
    path.write_bytes(genuine[:head] + b"\x42" * CHUNK + genuine[-32:])
    assert tier.load([k]) == []
    assert not path.exists()  # it claims to be ours and is damaged: removed (tier contract)
    tier.close()


def test_entries_follow_no_link_and_list_regular_files_only(tmp_path: Path,
                                                           secret: bytes | None) -> None:
    tier = _disk(tmp_path / "kv", secret)
    # distinct prefixes: a random key could otherwise land in the "ff" directory replaced below
    good, linked, fifo = "aa" + _key()[2:], "bb" + _key()[2:], "cc" + _key()[2:]
    in_linked_dir = "ff" + _key()[2:]
    tier.store([(k, chunk_of(k)) for k in (good, linked, fifo)])
    outside = tmp_path / "outside"
    outside.mkdir()
    # a chunk replaced by a link to a valid copy outside
    shutil.copyfile(tier._path(linked), outside / "copy.kvb")
    tier._path(linked).unlink()
    tier._path(linked).symlink_to(outside / "copy.kvb")
    # a chunk replaced by a FIFO
    tier._path(fifo).unlink()
    os.mkfifo(tier._path(fifo), 0o600)
    # a whole prefix directory that is a link to a directory holding a valid chunk
    other = _disk(tmp_path / "other", secret)
    other.store([(in_linked_dir, chunk_of(in_linked_dir))])
    prefix = tier.root / "ff"
    shutil.rmtree(prefix, ignore_errors=True)
    prefix.symlink_to(other._path(in_linked_dir).parent)

    again = _disk(tmp_path / "kv", secret)
    assert [k for k, _ in again.entries()] == [good]
    assert again.load([in_linked_dir]) == [] and again.contains([in_linked_dir]) == 0
    # a store under the linked prefix is skipped: nothing is written through the link
    assert again.store([(in_linked_dir, chunk_of(in_linked_dir))]) == []
    assert sorted(os.listdir(other._path(in_linked_dir).parent)) == [in_linked_dir + SUFFIX]
    for t in (tier, other, again):
        t.close()


def test_store_where_the_directory_cannot_be_made_is_a_skip(tmp_path: Path,
                                                            secret: bytes | None) -> None:
    """The prefix directory cannot be created (a file holds its name): ``store`` returns what
    it stored and raises nothing."""
    tier = _disk(tmp_path, secret)
    a, b = "aa" + _key()[2:], "bb" + _key()[2:]
    (tier.root / "aa").write_bytes(b"not a directory")
    assert tier.store([(a, chunk_of(a)), (b, chunk_of(b))]) == [b]
    assert tier.load([b]) != [] and tier.load([a]) == []
    tier.close()


def test_store_that_cannot_make_its_directory_is_counted_by_the_manager(tmp_path: Path) -> None:
    """The same through the manager, with the engine's secret: a counted failed store, not a
    tier exception."""
    kv = {f"layer{i}": np.zeros((8, 2, 4, 8), dtype=np.float32) for i in range(2)}
    layout = KVLayout.from_tensors(kv, 8, 4)
    io = BlockIO(layout)
    cfg = OffloadConfig.parse({"tiers": [{"name": "disk", "path": str(tmp_path / "m")}]})
    tiers = build_tiers(cfg, io.chunk_bytes, NS, secret=SECRET)
    assert isinstance(tiers[0], DiskTier)
    manager = OffloadManager(cfg, tiers, io, layout_fingerprint=layout.fingerprint())
    try:
        # every prefix directory is unmakeable: the root holds files under all 256 names
        for i in range(256):
            (tiers[0].root / f"{i:02x}").write_bytes(b"x")
        manager.apply(OffloadPlan(stores=[StoreOrder("req", ("k0", "k1"), (0, 1))]))
        assert manager.flush()
        counters = manager.take_counters()
        assert counters.get("offload_store_failed_disk") == 2
        assert counters.get("offload_tier_errors_disk", 0) == 0  # no exception out of store
    finally:
        manager.close()
