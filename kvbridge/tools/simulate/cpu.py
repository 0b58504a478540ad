"""The host's cores as a shared resource: processor sharing among the processes on them.

On a small host (this one: 2 cores) the engine cores are pinned, one per core, while the load
generator, the proxy and each engine's API server float over all cores and take their share.
:class:`CpuPool` models that: every process is a :class:`Task` with a FIFO queue of jobs (a
single-threaded Python process does one thing at a time); at every instant the runnable tasks
share the cores **max-min fairly** (what Linux's CFS approaches for tasks of equal weight that
may migrate), subject to

- a task runs on one core at most (rate <= 1);
- the tasks pinned to a core get at most that core (sum of their rates <= 1);
- all tasks together get at most ``cores``.

A floating task fills whatever the pinned ones leave. A job of ``work`` CPU seconds finishes when
its task has received that much CPU; rates change whenever a task becomes runnable or idle, and
every job in flight is re-timed then. A task may also *spin* after its queue empties (an engine
loop polling for ``spin_s`` wall seconds before it sleeps): it stays runnable, taking its share,
without work. ``background`` adds that many always-runnable floating tasks, a fraction being one
task of that weight (other jobs on the host).

Deterministic; single-threaded (driven by one :class:`~kvbridge.tools.simulate.events.EventLoop`).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from kvbridge.tools.simulate.events import EventLoop, SimulationError

__all__ = ["Task", "CpuPool", "max_min_shares"]

_EPS = 1e-12


def max_min_shares(tasks: Sequence[tuple[float, int | None]], cores: int) -> list[float]:
    """Max-min fair CPU rates of runnable tasks given as ``(weight, pinned core or None)``.

    Progressive filling: all unfrozen rates grow as ``theta * weight`` until a task reaches one
    core, a core's pinned tasks fill it, or all cores are full; those freeze, the rest go on.
    """
    if cores < 1:
        raise SimulationError("a CPU pool needs at least one core")
    n = len(tasks)
    rate = [0.0] * n
    frozen = [w <= 0 for w, _ in tasks]
    for _, core in tasks:
        if core is not None and not 0 <= core < cores:
            raise SimulationError(f"task pinned to core {core} of a {cores}-core pool")
    while not all(frozen):
        active = [i for i in range(n) if not frozen[i]]
        used = sum(rate)
        limits: list[tuple[float, list[int]]] = []
        w_all = sum(tasks[i][0] for i in active)
        limits.append(((cores - used) / w_all, active))
        for i in active:
            limits.append(((1.0 - rate[i]) / tasks[i][0], [i]))
        for c in {tasks[i][1] for i in active if tasks[i][1] is not None}:
            pinned = [i for i in active if tasks[i][1] == c]
            on_core = sum(rate[j] for j in range(n) if tasks[j][1] == c)
            limits.append(((1.0 - on_core) / sum(tasks[i][0] for i in pinned), pinned))
        step = max(0.0, min(lim for lim, _ in limits))
        for i in active:
            rate[i] += step * tasks[i][0]
        for lim, members in limits:
            if lim <= step + _EPS:
                for i in members:
                    frozen[i] = True
    return rate


class Task:
    """One process (or pinned engine core): a FIFO queue of CPU jobs."""

    def __init__(self, pool: CpuPool, name: str, core: int | None, spin_s: float,
                 weight: float) -> None:
        self.pool, self.name, self.core, self.spin_s, self.weight = pool, name, core, spin_s, weight
        self.jobs: deque[tuple[float, Callable[..., None], tuple[Any, ...]]] = deque()
        self.left = 0.0
        """CPU seconds the head job still needs"""
        self.spin_until = -1.0
        self.rate = 0.0
        self.cpu_s = 0.0

    def submit(self, t: float, work: float, fn: Callable[..., None], *args: Any) -> None:
        """Queue ``work`` CPU seconds; ``fn(t_done, *args)`` when they are done (FIFO)."""
        if work < 0 or work != work:
            raise SimulationError(f"{self.name}: a job of {work!r} CPU seconds")
        self.pool.advance(t)
        if not self.jobs:
            self.left = work
        self.jobs.append((work, fn, args))
        self.spin_until = -1.0
        self.pool.reschedule(t)


class CpuPool:
    """``cores`` cores shared by :class:`Task` s (see the module docstring)."""

    def __init__(self, loop: EventLoop, cores: int, background: float = 0.0) -> None:
        self.loop, self.cores = loop, cores
        self.tasks: list[Task] = []
        self.background = background
        self._t = 0.0
        self._pending: list[float] = []
        """times of the ticks already queued on the event loop (a heap)"""
        self._shares: dict[tuple[tuple[float, int | None], ...], list[float]] = {}
        """max_min_shares by runnable set (a handful of distinct sets recur all run long)"""

    def task(self, name: str, core: int | None = None, spin_s: float = 0.0) -> Task:
        t = Task(self, name, core, spin_s, 1.0)
        self.tasks.append(t)
        return t

    def advance(self, t: float) -> None:
        """Credit every runnable task with the CPU it got since the last change."""
        dt = t - self._t
        if dt > 0:
            for task in self.tasks:
                if task.rate > 0:
                    got = task.rate * dt
                    task.cpu_s += got
                    if task.jobs:
                        task.left -= got
        self._t = max(self._t, t)

    def reschedule(self, t: float) -> None:
        """New rates for the runnable set; the next job completion or spin end as an event."""
        runnable = [task for task in self.tasks if task.jobs or task.spin_until > t + _EPS]
        spec: list[tuple[float, int | None]] = [(task.weight, task.core) for task in runnable]
        whole, part = divmod(self.background, 1.0)
        spec += [(1.0, None)] * int(whole) + ([(part, None)] if part > 0 else [])
        key = tuple(spec)
        shares = self._shares.get(key)
        if shares is None:
            shares = self._shares[key] = max_min_shares(spec, self.cores) if spec else []
        for task in self.tasks:
            task.rate = 0.0
        for task, r in zip(runnable, shares, strict=False):
            task.rate = r
        nxt = float("inf")
        for task in runnable:
            if task.jobs and task.rate > 0:
                nxt = min(nxt, t + max(0.0, task.left) / task.rate)
            elif not task.jobs:
                nxt = min(nxt, task.spin_until)
        # a tick already queued no later than the next event re-checks then; a later one is
        # harmless (it finds nothing due and reschedules)
        if nxt < float("inf") and (not self._pending or nxt < self._pending[0] - _EPS):
            heapq.heappush(self._pending, nxt)
            self.loop.at(nxt, self._tick)

    def _tick(self, t: float) -> None:
        while self._pending and self._pending[0] <= t + _EPS:
            heapq.heappop(self._pending)
        self.advance(t)
        done: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        for task in self.tasks:
            while task.jobs and task.left <= 1e-9:
                _, fn, args = task.jobs.popleft()
                done.append((fn, args))
                if task.jobs:
                    task.left = task.jobs[0][0]
                elif task.spin_s > 0:
                    task.spin_until = t + task.spin_s
        self.reschedule(t)
        for fn, args in done:
            fn(t, *args)
