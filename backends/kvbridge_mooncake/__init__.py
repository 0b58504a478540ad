"""Mooncake Transfer Engine backend for kvbridge (entry point ``mooncake``).

Importing this package is cheap: ``mooncake.engine`` is imported only when a
:class:`MooncakeTransport` is constructed (or :meth:`MooncakeTransport.probe` / :func:`raw_bench`
is called). See ``docs/backends/mooncake.md``.
"""

from __future__ import annotations

from typing import Any

from kvbridge_mooncake.transport import MooncakeTransport

__all__ = ["MooncakeTransport", "raw_bench", "raw_session"]


def raw_bench(block_bytes: int, total_bytes: int, op: str, reps: int) -> float:
    """GB/s of the Transfer Engine alone moving scattered blocks between two processes.

    Same block pattern as kvbridge's ``bench transfer``; no kvbridge code on the data path.
    Blocking; spawns one peer process and stops it before returning.
    """
    from kvbridge_mooncake._bench import raw_bench as _raw_bench

    return float(_raw_bench(block_bytes, total_bytes, op, reps))


def raw_session(total_bytes: int, seed: int = 0) -> Any:
    """A :class:`kvbridge_mooncake._bench.RawSession`: the engine alone, one transfer per
    ``run(op, block_bytes)`` call (seconds), for the paired ``kvbridge bench transfer``."""
    from kvbridge_mooncake._bench import RawSession

    return RawSession(total_bytes, seed)
