"""Engine models: one P (prefill) and one D (decode) vLLM engine loop each, step by step.

Both loops work like vLLM v1's engine core: a step is scheduled from what is queued when it
starts, costs what the profile says for what it batched, and its results are visible when it
ends; an idle loop sleeps until work arrives.

P (:class:`PrefillEngine`): FCFS chunked prefill. Each step fills ``max_batched_tokens``: first
the prompts already started, then waiting prompts whose blocks fit in P's KV pool (a prompt that
does not fit blocks the ones behind it, as vLLM's FCFS policy does). A prompt whose last chunk
ran is *KV ready* at the end of that step; P keeps its blocks until the hand-off is over
(:meth:`PrefillEngine.release`). Work put on P's loop by the connector (a push WRITE posted
inline) runs at the start of the next step.

D (:class:`DecodeEngine`): each step first admits waiting requests (FCFS, prompt + output
blocks must fit); admitting puts the connector's per-request work on the loop (pull on vLLM:
allocate, build descriptors, post the READ; push: allocate and register), which delays the
whole step (with ``async_overlap``, only by what the forward pass does not hide). A request
whose KV landed during a step is noticed when that step ends and decodes
from the next one (its first step computes the last prompt token and yields token 1); a loop
idle when KV lands notices it ``idle_wake_s`` later. Every step gives each running request one
token; a request that has its ``output_len`` tokens leaves and frees its blocks.

D alone (``local``, :meth:`DecodeEngine.submit` of a request whose ``mode`` is ``local``): D
prefills the request itself. Admitted like any other (its blocks, FCFS), it then takes chunks of
the step's token budget (P's ``max_batched_tokens`` less one token per decoding request, as
vLLM's chunked prefill mixes prefill chunks into decode steps; at most ``max_num_seqs``
requests prefill or decode at once), costed with the profile's *prefill* per-token and
attention terms on top of the decode step (plus P's ``step_base_s`` when nothing decodes), so
its prefill slows every decoding request's step. Its prompt tokens D holds already
(``cached_len``) are not computed. The step that runs its last chunk yields its first token;
it decodes from the next step. No connector work, no transfer.

KV blocks are conserved: ``free + held == capacity`` at every step (checked; a breach is a
:class:`~kvbridge.tools.simulate.events.SimulationError`). A step's cost is wall time on a dedicated
core, or CPU work on the engine's pinned :class:`~kvbridge.tools.simulate.cpu.Task` when the engine
shares the host (``cpu``): then it lasts as long as its share of the core takes. Not
thread-safe (one event loop).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvbridge.tools.simulate.cpu import Task
from kvbridge.tools.simulate.events import EventLoop, SimulationError
from kvbridge.tools.simulate.profile import DecodeCost, ModelShape, PrefillCost
from kvbridge.tools.simulate.workload import RequestSpec

__all__ = ["SimRequest", "PrefillEngine", "DecodeEngine"]

Hook = Callable[[float, "SimRequest"], None]
"""A callback of the engines: ``hook(t, request)``, the way :meth:`EventLoop.at` calls."""


def _chunks(reqs: Iterable[SimRequest], budget: int) -> list[tuple[SimRequest, int]]:
    """Chunked prefill: each request's next chunk, in order, until ``budget`` tokens are used."""
    out: list[tuple[SimRequest, int]] = []
    for r in reqs:
        if budget <= 0:
            break
        n = min(r.compute_len - r.prefilled, budget)
        out.append((r, n))
        budget -= n
    return out


@dataclass(eq=False)
class SimRequest:
    """One request's state and timestamps (seconds; None until it happens)."""

    id: int
    spec: RequestSpec
    compute_len: int
    """Prompt tokens the prefilling engine computes (P's, or D's for ``local``: the rest hit
    its prefix cache; at least one token)."""
    mode: str = ""
    reason: str = ""
    p: int = -1
    d: int = -1
    prefilled: int = 0
    generated: int = 0
    p_blocks: int = 0
    d_blocks: int = 0
    ndesc: int = 0
    registered: float | None = None
    t_p_recv: float | None = None
    t_kv_ready: float | None = None
    t_d_recv: float | None = None
    t_d_admit: float | None = None
    t_posted: float | None = None
    t_landed: float | None = None
    t_ready: float | None = None
    t_first: float | None = None
    t_finish: float | None = None
    t_p_free: float | None = None
    t_admitted: float | None = None
    """The proxy let the request through its in-flight limit (== arrival at the proxy without)."""
    t_seen_first: float | None = None
    """The client parsed the first token (with a CPU model; else t_first + proxy.stream_s)."""
    t_seen_last: float | None = None
    seen: int = 0
    finishes: int = 0
    t_proxy: float | None = None
    """The request reached the proxy (where the proxy's TTFT clock starts)."""
    moved: int = -1
    """Prompt tokens the hand-off moves (-1: the whole prompt; the planner's partial receive
    moves only the tokens D lacks)."""
    plan: object | None = None
    """``plan`` mode: the :class:`~kvbridge.proxy.planner.Plan` the request was dispatched by."""

    @property
    def cached_len(self) -> int:
        return self.spec.prompt_len - self.compute_len


class _Pool:
    """A KV pool counted in blocks."""

    def __init__(self, name: str, capacity_tokens: int, block_size: int) -> None:
        self.name = name
        self.total = capacity_tokens // block_size
        self.free = self.total
        self.held = 0

    def take(self, n: int) -> None:
        self.free -= n
        self.held += n
        self.check()

    def give(self, n: int) -> None:
        self.free += n
        self.held -= n
        self.check()

    def check(self) -> None:
        if self.free < 0 or self.held < 0 or self.free + self.held != self.total:
            raise SimulationError(f"{self.name}: KV blocks not conserved (free {self.free}, "
                                  f"held {self.held}, capacity {self.total})")


class PrefillEngine:
    """One P engine's loop (see the module docstring)."""

    def __init__(self, loop: EventLoop, index: int, cost: PrefillCost, shape: ModelShape,
                 on_kv_ready: Hook) -> None:
        self.loop, self.index, self.cost, self.shape = loop, index, cost, shape
        self.on_kv_ready = on_kv_ready
        self.kv = _Pool(f"P{index}", cost.kv_capacity_tokens, shape.block_size)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.jobs: list[tuple[float, Hook, SimRequest]] = []
        self.busy = False
        self.busy_s = 0.0
        self.steps = 0
        self.cpu: Task | None = None

    def submit(self, r: SimRequest, t: float) -> None:
        """A prompt reaches P's scheduler."""
        if self.shape.blocks(r.spec.prompt_len) > self.kv.total:
            raise SimulationError(f"a {r.spec.prompt_len}-token prompt needs more blocks than "
                                  f"P's KV pool holds ({self.kv.total})")
        r.t_p_recv = t
        self.waiting.append(r)
        self._kick(t)

    def on_loop(self, cost: float, fn: Hook, r: SimRequest, t: float) -> None:
        """Run ``fn(t, r)`` on P's loop: at the start of the next step, after ``cost`` seconds."""
        self.jobs.append((cost, fn, r))
        self._kick(t)

    def release(self, r: SimRequest, t: float) -> None:
        """The hand-off is over: P frees the prompt's blocks."""
        self.kv.give(r.p_blocks)
        r.p_blocks = 0
        r.t_p_free = t
        self._kick(t)

    def _kick(self, t: float) -> None:
        if not self.busy:
            self._start(t)

    def _start(self, t: float) -> None:
        onloop = 0.0
        for cost, fn, r in self.jobs:
            onloop += cost
            self.loop.at(t + onloop, fn, r)
        self.jobs = []
        batch = _chunks(self.running, self.cost.max_batched_tokens)
        budget = self.cost.max_batched_tokens - sum(n for _, n in batch)
        while self.waiting and budget > 0:
            r = self.waiting[0]
            need = self.shape.blocks(r.spec.prompt_len)
            if need > self.kv.free:
                break
            self.waiting.popleft()
            self.kv.take(need)
            r.p_blocks = need
            self.running.append(r)
            n = min(r.compute_len, budget)
            batch.append((r, n))
            budget -= n
        if not batch and onloop == 0.0:
            self.busy = False
            return
        tokens = sum(n for _, n in batch)
        attn = sum(n * (r.cached_len + r.prefilled) + n * n / 2 for r, n in batch)
        dt = onloop + (self.cost.step_time(tokens, attn) if batch else 0.0)
        self.busy = True
        self.busy_s += dt
        self.steps += 1
        if self.cpu is not None:
            self.cpu.submit(t, dt, self._end, batch)
        else:
            self.loop.at(t + dt, self._end, batch)

    def _end(self, t: float, batch: list[tuple[SimRequest, int]]) -> None:
        for r, n in batch:
            r.prefilled += n
            if r.prefilled >= r.compute_len:
                self.running.remove(r)
                r.t_kv_ready = t
                self.on_kv_ready(t, r)
        self._start(t)


class DecodeEngine:
    """One D engine's loop (see the module docstring). ``admit(t, r)`` is called for each
    request admitted at a step start and returns the seconds of connector work it puts on the
    loop; ``on_loop_done(t, r)`` runs when that work ends; ``on_finish(t, r)`` when the last
    token is out."""

    def __init__(self, loop: EventLoop, index: int, cost: DecodeCost, shape: ModelShape,
                 admit: Callable[[float, SimRequest], float], on_loop_done: Hook,
                 on_finish: Hook, on_token: Hook | None = None,
                 prefill: PrefillCost | None = None) -> None:
        self.loop, self.index, self.cost, self.shape = loop, index, cost, shape
        self.admit, self.on_loop_done, self.on_finish = admit, on_loop_done, on_finish
        self.on_token = on_token
        self.on_first: Hook | None = None
        """Called with the first token of every request (the planner learns from it)."""
        self.prefill = prefill
        """What D's own prefill costs (``local`` requests); None: D takes no local request."""
        self.prefilling: list[SimRequest] = []
        self.cpu: Task | None = None
        self.kv = _Pool(f"D{index}", cost.kv_capacity_tokens, shape.block_size)
        self.waiting: deque[SimRequest] = deque()
        self.awaiting: set[SimRequest] = set()
        self.landed: list[SimRequest] = []
        self.ready: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.context = 0
        self.busy = False
        self.busy_s = 0.0
        self.onloop_s = 0.0
        self.steps = 0

    def submit(self, r: SimRequest, t: float) -> None:
        """A request reaches D's scheduler (pull: after P; push: at dispatch)."""
        if self.shape.blocks(r.spec.prompt_len + r.spec.output_len) > self.kv.total:
            raise SimulationError(f"a {r.spec.prompt_len}+{r.spec.output_len}-token request "
                                  f"needs more blocks than D's KV pool holds ({self.kv.total})")
        if r.mode == "local" and self.prefill is None:
            raise SimulationError(f"D{self.index} has no prefill cost for a local request")
        r.t_d_recv = t
        self.waiting.append(r)
        if not self.busy:
            self._start(t)

    def kv_landed(self, r: SimRequest, t: float) -> None:
        """The request's KV is all in D's blocks (transfer done, D told)."""
        if r not in self.awaiting:
            raise SimulationError(f"request {r.id}: KV landed on D{self.index} twice or unasked")
        self.awaiting.discard(r)
        r.t_landed = t
        if self.busy:
            self.landed.append(r)
        else:
            self.ready.append(r)
            self.loop.at(t + self.cost.idle_wake_s, self._wake)

    def _wake(self, t: float) -> None:
        if not self.busy:
            self._start(t)

    def _start(self, t: float) -> None:
        onloop = 0.0
        while self.waiting:
            r = self.waiting[0]
            need = self.shape.blocks(r.spec.prompt_len + r.spec.output_len)
            local = r.mode == "local"
            if need > self.kv.free or (local and len(self.running) + len(self.prefilling)
                                       >= self.cost.max_num_seqs):
                break
            self.waiting.popleft()
            self.kv.take(need)
            r.d_blocks = need
            r.t_d_admit = t
            cost = self.admit(t, r)
            onloop += cost
            if local:
                r.t_ready = t
                self.prefilling.append(r)
                continue
            self.awaiting.add(r)
            self.loop.at(t + onloop, self.on_loop_done, r)
        while self.ready and len(self.running) < self.cost.max_num_seqs:
            r = self.ready.popleft()
            r.t_ready = t
            self.running.append(r)
            self.context += r.spec.prompt_len
        chunks = self._chunks()
        if not self.running and not chunks and onloop == 0.0:
            self.busy = False
            return
        forward = self.cost.step_time(len(self.running), self.context)
        forward += self._prefill_time(chunks)
        dt = max(onloop, forward) if self.cost.async_overlap else onloop + forward
        self.busy = True
        self.busy_s += dt
        self.onloop_s += onloop
        self.steps += 1
        if self.cpu is not None:
            self.cpu.submit(t, dt, self._end, chunks)
        else:
            self.loop.at(t + dt, self._end, chunks)

    def _chunks(self) -> list[tuple[SimRequest, int]]:
        """This step's prefill chunks of local requests, FCFS within the token budget left
        after one token per decoding request."""
        if not self.prefilling or self.prefill is None:
            return []
        return _chunks(self.prefilling, self.prefill.max_batched_tokens - len(self.running))

    def _prefill_time(self, chunks: list[tuple[SimRequest, int]]) -> float:
        """What the chunks add to the step: P's per-token and attention costs, and P's fixed
        step cost only when no decode runs in the step (else the decode step pays it)."""
        if not chunks or self.prefill is None:
            return 0.0
        tokens = sum(n for _, n in chunks)
        attn = sum(n * (r.cached_len + r.prefilled) + n * n / 2 for r, n in chunks)
        full = self.prefill.step_time(tokens, attn)
        return full if not self.running else full - self.prefill.step_base_s

    def _end(self, t: float, chunks: list[tuple[SimRequest, int]]) -> None:
        done: list[SimRequest] = []
        for r, n in chunks:
            r.prefilled += n
            if r.prefilled >= r.compute_len:
                self.prefilling.remove(r)
                done.append(r)
        still: list[SimRequest] = []
        for r in self.running:
            if self._token(t, r):
                still.append(r)
        for r in done:  # the last chunk's step yields the first token
            self.context += r.spec.prompt_len
            if self._token(t, r):
                still.append(r)
        self.running = still
        self.ready.extend(self.landed)
        self.landed = []
        self._start(t)

    def _token(self, t: float, r: SimRequest) -> bool:
        """``r`` got a token at ``t``; whether it goes on decoding (else it left, its blocks
        freed)."""
        r.generated += 1
        self.context += 1
        if r.generated == 1:
            r.t_first = t
            if self.on_first is not None:
                self.on_first(t, r)
        if self.on_token is not None:
            self.on_token(t, r)
        if r.generated < r.spec.output_len:
            return True
        self.context -= r.spec.prompt_len + r.generated
        self.kv.give(r.d_blocks)
        r.d_blocks = 0
        r.t_finish = t
        r.finishes += 1
        self.on_finish(t, r)
        return False
