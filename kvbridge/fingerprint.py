"""Content fingerprints of a checkpoint: what makes two engines' KV comparable.

KV computed by other weights is wrong KV that still has the right shape: two checkpoints of one
architecture (a fine-tune, the next version in a rolling upgrade, the same name on two hosts)
pass every layout check. The model identity (:func:`kvbridge.integrations.vllm_meta.
model_identity`) therefore names the weights by their *content*:

- :func:`checkpoint_digest` of a local directory hashes, for every weight file
  (``.safetensors``, ``.bin``, ``.pt``, ``.pth``, ``.gguf``), its name, its size, a safetensors
  file's whole header (tensor names, dtypes, shapes and offsets) and :data:`SAMPLES` evenly
  spaced windows of :data:`SAMPLE_BYTES` of its data, first and last byte included; and every
  small file that changes what the model computes from the same tokens (``*.json``: config,
  generation config, tokenizer; ``*.model``, ``*.txt``, ``*.tiktoken``: vocabularies) whole.
  Never a modification time: the same checkpoint copied to another host, or re-synced, gives the
  same digest, so shared tiers hit across hosts.
- The reads are bounded: a few dozen small reads per file, whatever its size (a 64 GB
  checkpoint is read in well under a second; docs/benchmarks.md has the measurement).
- A sample cannot prove two checkpoints equal byte for byte: two files of one size and header
  that differ only between the windows digest alike. Checkpoints that differ in training differ
  everywhere; an operator who knows more sets ``model_identity`` explicitly.

Pure functions; blocking file I/O; thread-safe. Results are cached for the process per path and
(name, size, modification time) of its files: the scheduler and every worker ask once each, and
a checkpoint rewritten in place is read again.
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
from typing import Any, BinaryIO

__all__ = ["checkpoint_digest", "clear_cache", "SAMPLES", "SAMPLE_BYTES"]

#: windows sampled from each weight file, evenly spaced over it
SAMPLES = 32
#: bytes per window
SAMPLE_BYTES = 4096
#: a safetensors header longer than this is not a safetensors header (the format caps it)
_MAX_HEADER = 100 << 20
#: small files hashed whole; larger ones (never expected) are sampled like weights
_MAX_WHOLE = 32 << 20

_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_WHOLE = (".json", ".model", ".txt", ".tiktoken", ".py", ".jinja")

_DIGEST = 16


def checkpoint_digest(path: str) -> str | None:
    """The content digest of the checkpoint directory ``path`` (hex), or None if ``path`` is
    not a directory (a hub name: the caller falls back to its declared revision). Files that
    cannot be read are named as unreadable in the digest, never skipped silently."""
    if not os.path.isdir(path):
        return None
    listing = []
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if name.endswith(_WEIGHTS + _WHOLE) and os.path.isfile(full):
            try:
                st = os.stat(full)
                listing.append((name, st.st_size, st.st_mtime_ns))
            except OSError:
                listing.append((name, -1, 0))
    return _digest(os.path.realpath(path), tuple(listing))


def clear_cache() -> None:
    """Forget every digest this process computed (benchmarks; a checkpoint rewritten with its
    old sizes and times)."""
    _digest.cache_clear()


@functools.lru_cache(maxsize=16)
def _digest(path: str, listing: tuple[tuple[str, int, int], ...]) -> str:
    """The digest; the modification times in ``listing`` only key the cache (a file rewritten
    in place is read again), they are never hashed."""
    h = hashlib.blake2b(digest_size=_DIGEST, person=b"kvbridge-ckpt")
    for name, size, _ in listing:
        h.update(f"{name}\0{size}\0".encode())
        try:
            with open(os.path.join(path, name), "rb") as f:
                if name.endswith(_WHOLE) and size <= _MAX_WHOLE:
                    h.update(f.read())
                else:
                    _weights(f, name, size, h)
        except OSError as exc:
            h.update(f"unreadable: {type(exc).__name__}\0".encode())
    return h.hexdigest()


def _weights(f: BinaryIO, name: str, size: int, h: Any) -> None:
    """Feed ``h`` a weight file's header (safetensors) and its sampled windows."""
    if name.endswith(".safetensors") and size >= 8:
        (n,) = struct.unpack("<Q", f.read(8))
        if 0 < n <= min(_MAX_HEADER, size - 8):
            h.update(f.read(n))
    if size <= SAMPLES * SAMPLE_BYTES:
        f.seek(0)
        h.update(f.read())
        return
    last = size - SAMPLE_BYTES
    for i in range(SAMPLES):
        f.seek(last * i // (SAMPLES - 1))
        h.update(f.read(SAMPLE_BYTES))
