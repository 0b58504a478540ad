"""What naming a checkpoint by content costs at start-up (kvbridge.fingerprint).

    .venv/bin/python benchmarks/model_identity.py [GiB ...]   (default: 1 4)

For the test model, and for synthetic safetensors checkpoints of the given sizes (written as
4 GiB shards of pseudo-random bytes under a temporary directory, removed afterwards), prints
the time of ``checkpoint_digest`` with the files out of the page cache (``posix_fadvise``
DONTNEED, best effort: a device that ignores it reads warm) and warm, next to reading every
byte once (what hashing the whole checkpoint would at least cost), and the ratio.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from kvbridge.fingerprint import checkpoint_digest, clear_cache
from kvbridge.tools.report import print_table
from kvbridge.tools.tiny_model import build_tiny_model

SHARD = 4 << 30
CHUNK = 64 << 20


def _write(d: Path, gib: int) -> None:
    left, i = gib << 30, 0
    block = os.urandom(CHUNK)
    while left > 0:
        size = min(SHARD, left)
        header = b'{"__metadata__":{"format":"pt"}}'
        with open(d / f"model-{i:05d}.safetensors", "wb") as f:
            f.write(len(header).to_bytes(8, "little") + header)
            for _ in range(size // CHUNK):
                f.write(block)
        left, i = left - size, i + 1
    (d / "config.json").write_text('{"model_type": "synthetic"}')
    os.sync()  # dirty pages cannot be dropped from the page cache


def _evict(d: Path) -> None:
    for f in d.iterdir():
        with open(f, "rb") as fh:
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _read_all(d: Path) -> float:
    t0 = time.perf_counter()
    for f in sorted(d.iterdir()):
        with open(f, "rb") as fh:
            while fh.read(CHUNK):
                pass
    return time.perf_counter() - t0


def _row(name: str, d: Path) -> list[object]:
    size = sum(f.stat().st_size for f in d.iterdir())
    clear_cache()
    _evict(d)
    t0 = time.perf_counter()
    checkpoint_digest(str(d))
    cold = time.perf_counter() - t0
    clear_cache()
    t0 = time.perf_counter()
    checkpoint_digest(str(d))
    warm = time.perf_counter() - t0
    _evict(d)
    full = _read_all(d)
    shown = f"{size / (1 << 30):.2f} GiB" if size >= 1 << 30 else f"{size / (1 << 20):.1f} MiB"
    return [name, shown, f"{cold * 1e3:.1f}", f"{warm * 1e3:.1f}",
            f"{full * 1e3:.0f}", f"{full / cold:.0f}x"]


def main(sizes: list[int]) -> None:
    rows = [_row("test model (tiny-qwen3)", Path(build_tiny_model()))]
    for gib in sizes:
        with tempfile.TemporaryDirectory(prefix="kvb-ckpt-") as tmp:
            _write(Path(tmp), gib)
            rows.append(_row(f"synthetic {gib} GiB", Path(tmp)))
    print_table(["checkpoint", "size", "digest cold ms", "digest warm ms",
                 "read every byte ms", "read all / digest"], rows, list("lrrrrr"))


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 4])
