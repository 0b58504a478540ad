"""NIXL backend for kvbridge (entry point ``nixl``): UCX by default, LIBFABRIC for AWS EFA.

Importing this package is cheap: nixl is imported only when a :class:`NixlTransport` is
constructed (or :meth:`NixlTransport.probe` / :func:`raw_bench` is called). See
``docs/backends/nixl.md`` and ``docs/efa.md``.
"""

from __future__ import annotations

from typing import Any

from kvbridge_nixl.transport import NixlTransport

__all__ = ["NixlTransport", "raw_bench", "raw_session", "raw_responder", "block_cost"]


def raw_bench(block_bytes: int, total_bytes: int, op: str, reps: int, **options: Any) -> float:
    """Best-of-``reps`` GB/s of the NIXL API alone moving scattered blocks between two processes.

    Same pattern as ``kvbridge bench transfer`` (initiator blocks in order, target blocks at a
    random permutation, one descriptor per block); no kvbridge code on the data path. Blocking;
    spawns one target process and always stops it. ``options`` are nixl backend options
    (``backends``, ``progress_delay_us``…) so both columns run the same agent configuration.
    """
    from kvbridge_nixl._bench import raw_bench as _raw_bench

    return float(_raw_bench(block_bytes, total_bytes, op, reps, **options))


def block_cost(planes: int, num_blocks: int, cases: Any, reps: int,
               **options: Any) -> dict[str, list[tuple[float, float, float]]]:
    """kvbridge's per-transfer work on the block path and NIXL's request creation, measured
    with real agents (see :func:`kvbridge_nixl._bench.block_cost`); for ``kvbridge bench
    descriptors``."""
    from kvbridge_nixl._bench import block_cost as _block_cost

    return _block_cost(planes, num_blocks, cases, reps, **options)


def raw_session(total_bytes: int, seed: int = 0, **options: Any) -> Any:
    """A :class:`kvbridge_nixl._bench.RawSession`: NIXL alone, one transfer per ``run(op,
    block_bytes)`` call (seconds), for the paired ``kvbridge bench transfer``; with ``peer``
    and ``local``, over the bench's own buffers and a :func:`raw_responder`."""
    from kvbridge_nixl._bench import RawSession

    return RawSession(total_bytes, seed, **options)


def raw_responder(address: int, nbytes: int, **options: Any) -> Any:
    """A :class:`kvbridge_nixl._bench.RawResponder`: a NIXL agent alone over memory the caller
    owns, the far side of a shared :func:`raw_session` (``kvbridge bench transfer`` starts one
    in its target process)."""
    from kvbridge_nixl._bench import RawResponder

    return RawResponder(address, nbytes, **options)
