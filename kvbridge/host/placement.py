"""Where an engine rank runs, and the one placement known to break a transport.

:func:`local_placement` reads this host's boot id, the cores the calling thread may use, and
the cores any thread of this process may use. In a vLLM CPU worker the first is one core even
when the engine was given several: vLLM pins each OpenMP thread to one core of the rank's
``VLLM_CPU_OMP_THREADS_BIND`` list, the worker's main thread (OpenMP's first) to the list's
first core, and every thread started after it inherits that core — kvbridge's loop, NIXL's
progress thread, UCX's threads. (Measured with ``VLLM_CPU_OMP_THREADS_BIND=0-1``: every thread of
the worker but one OpenMP thread on core 0; with ``nobind``, all on cores 0-1.) It goes into
this rank's :class:`~kvbridge.messages.EngineInfo`, so each side of a handshake knows the
other's.

:func:`shared_core_warning` says when two ranks on one host are both confined to the same
single core over a transport that is not ``shared_core_safe`` (its
:class:`~kvbridge.transport.Capabilities`; NIXL is not): UCX's connection set-up between them
livelocks (the P's progress thread spins on the half-open socket, the D's answer does not land)
and their first hand-off stalls for seconds to minutes (docs/backends/nixl.md, "Known issue
(UCX)"). The peer table logs it once per handshake. The placement a peer sends is only
compared, never acted on, so a forged one can at most cause or hide this warning.

:func:`fleet_cores` is the placement kvbridge's own fleets use on one host (``kvbridge bench
serve --fleet``, the fleet tests, the simulator): P and D engines on disjoint cores.

Pure functions; :func:`local_placement` reads ``/proc`` and never raises.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from kvbridge.messages import MAX_PLACEMENT_CORES, EngineInfo, Placement
from kvbridge.transport import Capabilities

__all__ = ["fleet_cores", "local_placement", "process_cores", "shared_core_warning",
           "BOOT_ID_PATH", "DOCS"]

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
DOCS = "docs/backends/nixl.md#known-issue-ucx-never-confine-a-p-and-a-d-to-the-same-core"


def local_placement(boot_id_path: str = BOOT_ID_PATH) -> Placement | None:
    """This host's boot id, the calling thread's allowed cores and the union of every thread's
    of this process (:func:`process_cores`), or ``None`` if unknown."""
    try:
        with open(boot_id_path) as f:
            host = f.read().strip()[:64]
        cores = tuple(sorted(os.sched_getaffinity(0)))
    except (OSError, AttributeError):  # no /proc, or no sched_getaffinity (not Linux)
        return None
    if not host or not cores or len(cores) > MAX_PLACEMENT_CORES:
        return None
    return Placement(host=host, cores=cores, process_cores=process_cores())


def process_cores(tasks: str = "/proc/self/task") -> tuple[int, ...]:
    """The cores any thread of this process may use (empty if unknown)."""
    cores: set[int] = set()
    try:
        for tid in os.listdir(tasks):
            try:
                cores |= os.sched_getaffinity(int(tid))
            except (OSError, ValueError):  # the thread ended meanwhile
                continue
    except (OSError, AttributeError):
        return ()
    return tuple(sorted(cores)) if len(cores) <= MAX_PLACEMENT_CORES else ()


def _span(cores: Sequence[int]) -> str:
    """``0-3,6`` for (0, 1, 2, 3, 6)."""
    runs: list[list[int]] = []
    for c in sorted(cores):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def shared_core_warning(mine: EngineInfo, theirs: EngineInfo, transport: str,
                        caps: Capabilities) -> str | None:
    """A warning if both ranks run on one host confined to the same single core and the
    *transport* between them (named for the message) is not ``caps.shared_core_safe``."""
    a, b = mine.placement, theirs.placement
    if caps.shared_core_safe or a is None or b is None or a.host != b.host:
        return None
    if len(a.cores) != 1 or a.cores != b.cores:
        return None
    wider = [f"{who} process may use cores {_span(p.process_cores)}"
             for who, p in (("its", b), ("this rank's", a)) if len(p.process_cores) > 1]
    why = ""
    if wider:
        why = (f" ({' and '.join(wider)}, but a vLLM CPU worker pins its main thread, and so "
               "every thread started after it, to the first core of its "
               "VLLM_CPU_OMP_THREADS_BIND list; VLLM_CPU_OMP_THREADS_BIND=nobind leaves them on "
               "all of the process's cores)")
    return (f"engine {theirs.engine_id} rank {theirs.rank} runs on this host with its transfer "
            f"threads (kvbridge's loop, the transport's threads) confined to the same single "
            f"core ({a.cores[0]}) as this rank's{why}: the {transport} transport's first "
            f"connection between them can livelock, and hand-offs stall until stall_s gives "
            f"them up; give P and D engines' first cores apart ({DOCS})")


def fleet_cores(cpus: Sequence[int], prefill: int, decode: int) -> tuple[list[int], list[int]]:
    """The core of each of *prefill* P and *decode* D engines on a host of *cpus* (their
    ``cpu_bind``; the simulator's pinned engines).

    P engines and D engines get disjoint cores whenever there are two or more: the first
    ``max(1, len(cpus) * prefill // (prefill + decode))`` cores (at most ``len(cpus) - 1``) go
    round-robin to the P engines, the rest to the D engines; on two cores, every P on the first
    and every D on the second, as in 1P1D.

    Why never a P and a D on one core: vLLM's CPU worker binds its main thread, and so every
    thread it starts (NIXL's progress thread, UCX's, kvbridge's), to its ``cpu_bind`` core. When
    a D opens its first UCX connection to a P confined to the same single core, UCX's connection
    set-up livelocks: P's progress thread spins on the half-open socket (poll and epoll_wait
    return at once, 100 % of the core) and D's answer does not arrive until something pauses P
    (a debugger attaching for a few milliseconds ends it), so the first hand-off of that pair
    stalls for seconds to minutes and its lease expires (docs/backends/nixl.md, "Known issue
    (UCX)"). Real fleets never share a core between a P and a D. With one core there is no
    choice: everything goes on it.
    """
    if prefill < 1 or decode < 1 or not cpus:
        raise ValueError(f"fleet_cores needs cores and engines of both roles, got {len(cpus)} "
                         f"core(s) for {prefill}P{decode}D")
    cores = list(cpus)
    if len(cores) == 1:
        return cores * prefill, cores * decode
    split = min(len(cores) - 1, max(1, len(cores) * prefill // (prefill + decode)))
    p_cores, d_cores = cores[:split], cores[split:]
    return ([p_cores[i % len(p_cores)] for i in range(prefill)],
            [d_cores[i % len(d_cores)] for i in range(decode)])
