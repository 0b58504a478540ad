"""Where an engine rank runs, and the one placement known to break a transport.

:func:`local_placement` reads this host's boot id and the cores the calling thread may use (in
a vLLM CPU worker, the ``VLLM_CPU_OMP_THREADS_BIND`` core(s): vLLM binds the worker's main thread
and every thread started after inherits it). It goes into this rank's
:class:`~kvbridge.messages.EngineInfo`, so each side of a handshake knows the other's.

:func:`shared_core_warning` says when two NIXL ranks on one host are both confined to the same
single core: UCX's connection set-up between them livelocks (the P's progress thread spins on
the half-open socket, the D's answer does not land) and their first hand-off stalls for seconds
to minutes (docs/backends/nixl.md, "Known issue (UCX)"). The peer table logs it once per
handshake. The placement a peer sends is only compared, never acted on, so a forged one can at
most cause or hide this warning.

Pure functions; :func:`local_placement` reads ``/proc`` and never raises.
"""

from __future__ import annotations

import os

from kvbridge.messages import MAX_PLACEMENT_CORES, EngineInfo, Placement

__all__ = ["local_placement", "shared_core_warning", "BOOT_ID_PATH", "DOCS"]

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
DOCS = "docs/backends/nixl.md#known-issue-ucx-never-confine-a-p-and-a-d-to-the-same-core"


def local_placement(boot_id_path: str = BOOT_ID_PATH) -> Placement | None:
    """This host's boot id and the calling thread's allowed cores, or ``None`` if unknown."""
    try:
        with open(boot_id_path) as f:
            host = f.read().strip()[:64]
        cores = tuple(sorted(os.sched_getaffinity(0)))
    except (OSError, AttributeError):  # no /proc, or no sched_getaffinity (not Linux)
        return None
    if not host or not cores or len(cores) > MAX_PLACEMENT_CORES:
        return None
    return Placement(host=host, cores=cores)


def shared_core_warning(mine: EngineInfo, theirs: EngineInfo) -> str | None:
    """A warning if both ranks use NIXL on one host confined to the same single core."""
    a, b = mine.placement, theirs.placement
    if a is None or b is None or a.host != b.host:
        return None
    if "nixl" not in (mine.backend, theirs.backend):
        return None
    if len(a.cores) != 1 or a.cores != b.cores:
        return None
    return (f"engine {theirs.engine_id} rank {theirs.rank} runs on this host confined to the "
            f"same single core ({a.cores[0]}) as this rank: NIXL/UCX's first connection between "
            f"them can livelock and stall hand-offs for minutes; give P and D engines disjoint "
            f"cores ({DOCS})")
