"""A P/D fleet behind the kvbridge proxy: routing, and what each hand-off mode does where.

Routing is the proxy's own code (:mod:`kvbridge.proxy.routing`): the same :class:`Pool` picks
(least requests in flight, round-robin ties) and :func:`decide` (headroom pushes while the
least-loaded D has fewer than ``push_headroom`` requests in flight, else pulls). In-flight counts
move when the real proxy moves them: a P leg from dispatch to P's answer, a D leg from dispatch
to the end of its stream.

Per request (times from the :class:`~kvbridge.tools.simulate.profile.Profile`):

pull
    client → proxy → P (``client_s + request_s + per_prompt_token_s * prompt``); P prefills;
    P's answer reaches the proxy (``answer_s``), which picks the least-loaded D *now* and sends
    it the request (``request_s + per_prompt_token_s * prompt``). When D admits it, D allocates,
    builds descriptors and posts the READ (``pull.setup_s + pull.per_desc_s * descriptors``):
    on D's engine loop (``pull.on_d_loop``: the step, and every decoding request, waits) or on
    its connector thread (FIFO). The READ then holds P's and D's NICs; when it lands D decodes
    and P frees its blocks ``pull.done_s`` later.
push
    the proxy picks D first and sends both legs at once. D admits at once (allocation and
    registration on its loop, ``push.register_s``) and the registration reaches P
    ``push.register_latency_s`` later. When P's KV is ready *and* the registration is there,
    P posts the WRITE (``push.setup_s + push.per_desc_s * descriptors``) from its background
    thread (FIFO) or inline on its loop; the WRITE holds the NICs; D learns it landed
    ``push.notify_s`` later; P frees its blocks when the WRITE is done.

local (D alone)
    client → proxy → the least-loaded D, which prefills the request itself (chunks mixed into its
    decode steps, :mod:`kvbridge.tools.simulate.engines`) and decodes it. No P, no hand-off.
auto (``plan`` is its other name, as in the proxy)
    the proxy's own planner (:class:`kvbridge.proxy.planner.Planner`) chooses local, push or
    pull per request from the same :class:`~kvbridge.proxy.planner.Features` the proxy builds
    (tokens to compute, tokens to move, tokens D holds, requests in flight on the engine that
    would prefill: the least-loaded D for local, the least-loaded P for a hand-off), the request
    goes down that path, and D's first token teaches the planner the request's TTFT as the proxy
    measures it (proxy receive → first token out: D's first token + ``proxy.stream_s``). P and D
    are placed least-loaded: the simulated engines have no per-engine prefix state to rank by.
    With a TPOT SLO (:attr:`PlannerSettings.tpot_slo_ms`) the proxy's TPOT guard applies
    (:meth:`Planner.stalls`): each D's TPOT is measured from its closed streams as the proxy
    measures it (first → last token, :func:`~kvbridge.proxy.planner.smoothed_tpot` over its
    streams), and a prefill that would push one of the streams placed on D past the SLO is
    not left to D alone.

In pull, push and headroom a transfer moves the whole prompt's KV (a prefix hit on P saves P's
compute, not the hand-off). In local and auto, ``prefix_hit`` is the share of every prompt that
*each* engine, P and D, holds already (a shared system prompt, say): D alone computes only the
rest, and a planned hand-off moves only the rest (the connector's partial receive).
Descriptors per rank: ``layers * kv_planes * runs``, ``runs`` from the profile's fragmentation.

The proxy admits at most ``proxy.<mode>_max_in_flight`` requests of a mode per D engine between
its admission and the client's last token; later ones wait FIFO. With a ``cpu`` section the
host's cores are shared (:mod:`kvbridge.tools.simulate.cpu`): engines pinned, every hop (client,
proxy, API servers) and every streamed token costs CPU on its floating process, each engine's
per-request work beyond its steps runs next to them, and TTFT/TPOT are taken when the client has
parsed the token.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from kvbridge.host.placement import fleet_cores
from kvbridge.proxy.planner import (
    Features,
    Path,
    Plan,
    Planner,
    PlannerSettings,
    Stream,
    smoothed_tpot,
)
from kvbridge.proxy.routing import Engine, Pool, ProxyMode, Role, decide
from kvbridge.tools.simulate.cpu import CpuPool, Task
from kvbridge.tools.simulate.engines import DecodeEngine, Hook, PrefillEngine, SimRequest
from kvbridge.tools.simulate.events import EventLoop, Nic, Server, SimulationError, reserve
from kvbridge.tools.simulate.profile import CpuCost, Profile
from kvbridge.tools.simulate.workload import RequestSpec

__all__ = ["ALIASES", "MODES", "Fleet", "canonical_mode", "simulate"]

MODES: tuple[str, ...] = ("pull", "push", "auto", "headroom", "local")
"""The proxy's modes: ``auto`` is the planner, ``headroom`` push or pull by D's load."""
ALIASES: dict[str, str] = {"plan": "auto"}
"""Other names of a mode, as the proxy takes them."""
"""The modes the simulator runs (the proxy's ``--mode``)."""
NO_P_MODES: tuple[str, ...] = ("local", "auto")
"""Modes that can run without a P engine (the planner then only has D alone to choose)."""


def canonical_mode(mode: str) -> str:
    """``plan`` → ``auto``; any other name as it is."""
    return ALIASES.get(mode, mode)


class Fleet:
    """``prefills`` P and ``decodes`` D engines serving in ``mode`` (one of :data:`MODES`);
    ``planner``: the settings of auto mode's planner (default: the proxy's defaults).

    Raises :class:`SimulationError` for an unknown mode (naming ``--mode``), no D, no P in a
    mode that needs one, or a ``prefix_hit`` outside [0, 1)."""

    def __init__(self, profile: Profile, prefills: int, decodes: int, mode: str,
                 prefix_hit: float = 0.0, fragmentation: float | None = None,
                 push_headroom: int | None = None,
                 planner: PlannerSettings | None = None) -> None:
        mode = canonical_mode(mode)
        if mode not in MODES:
            raise SimulationError(f"--mode: the simulator runs {', '.join(MODES)}; not "
                                  f"{mode!r}")
        if decodes < 1 or prefills < (0 if mode in NO_P_MODES else 1):
            raise SimulationError("a fleet needs at least one D engine, and one P engine "
                                  f"unless it runs {' or '.join(NO_P_MODES)} (got "
                                  f"{prefills}P{decodes}D in {mode})")
        if not 0.0 <= prefix_hit < 1.0:
            raise SimulationError(f"prefix_hit must be in [0, 1), got {prefix_hit!r}")
        self.profile = profile
        self.mode = ProxyMode(mode)
        self.planner = Planner(planner) if self.mode is ProxyMode.AUTO else None
        self.d_holds = mode in NO_P_MODES
        """D holds the ``prefix_hit`` share of every prompt (local, auto: module docstring)."""
        self.prefix_hit = prefix_hit
        self.fragmentation = profile.fragmentation if fragmentation is None else fragmentation
        self.headroom = profile.proxy.push_headroom if push_headroom is None else push_headroom
        self.loop = EventLoop()
        shape = profile.model
        self.prefills = [PrefillEngine(self.loop, i, profile.prefill, shape, self._kv_ready)
                         for i in range(prefills)]
        self.decodes = [DecodeEngine(self.loop, i, profile.decode, shape, self._d_admit,
                                     self._d_loop_done, self._finished,
                                     prefill=profile.prefill)
                        for i in range(decodes)]
        #: the planner's queue feature: prompt tokens sent to each engine (by URL) to prefill
        #: whose first token has not come yet; per request id, its share
        self._pending: dict[str, float] = {}
        self._pending_of: dict[int, tuple[str, float]] = {}
        #: the TPOT guard's measure: per D engine URL, its streams' TPOT (ms, smoothed)
        self.tpot: dict[str, float] = {}
        #: per D engine URL: the requests placed there whose stream has not closed
        self._placed: dict[str, dict[int, SimRequest]] = {}
        if self.planner is not None:
            for d in self.decodes:
                d.on_first = self._observe
        self.ppool = Pool(Role.PREFILL, [f"sim-p{i}:1" for i in range(prefills)],
                          empty_ok=True)  # local and auto may run without a P
        self.dpool = Pool(Role.DECODE, [f"sim-d{i}:1" for i in range(decodes)])
        self.p_threads = [Server() for _ in range(prefills)]
        self.d_threads = [Server() for _ in range(decodes)]
        self.p_nics = [Nic() for _ in range(prefills)]
        self.d_nics = [Nic() for _ in range(decodes)]
        self.requests: list[SimRequest] = []
        px = profile.proxy
        # per D engine: a fleet of n D engines admits n times as many (see ProxyCost)
        self.limits = {"pull": px.pull_max_in_flight * decodes,
                       "push": px.push_max_in_flight * decodes, "local": 0}
        self.in_flight = {"pull": 0, "push": 0, "local": 0}
        self.gate_queue: dict[str, deque[SimRequest]] = {m: deque() for m in self.in_flight}
        self.cpu: CpuPool | None = None
        self.tasks: dict[str, Task] = {}
        if profile.cpu is not None:
            self._share_cores(profile.cpu)

    def _share_cores(self, c: CpuCost) -> None:
        """Engines pinned as ``kvbridge bench serve --fleet`` pins them
        (:func:`kvbridge.host.placement.fleet_cores`: P and D engines on disjoint cores; 1P1D and
        2P2D on two cores: every P on core 0, every D on core 1; without a P, the D engines
        round-robin over every core); the front ends float."""
        self.cpu = CpuPool(self.loop, c.cores, c.background)
        if self.prefills:
            p_cores, d_cores = fleet_cores(range(c.cores), len(self.prefills),
                                           len(self.decodes))
        else:
            p_cores, d_cores = [], [i % c.cores for i in range(len(self.decodes))]
        pinned: list[tuple[str, PrefillEngine | DecodeEngine, int]] = [
            *(("P", e, p_cores[i]) for i, e in enumerate(self.prefills)),
            *(("D", e, d_cores[i]) for i, e in enumerate(self.decodes))]
        for role, e, core in pinned:
            e.cpu = self.cpu.task(f"{role}{e.index} engine", core=core, spin_s=c.engine_spin_s)
            self.tasks[f"{role}{e.index} connector"] = self.cpu.task(
                f"{role}{e.index} connector", core=core)
        self.tasks |= {"client": self.cpu.task("client"), "proxy": self.cpu.task("proxy")}
        for e in self.prefills:
            self.tasks[f"P{e.index}"] = self.cpu.task(f"P{e.index} API server")
        for d in self.decodes:
            self.tasks[f"D{d.index}"] = self.cpu.task(f"D{d.index} API server")
            d.on_token = self._token

    def _hop(self, t: float, task: str, work: float, delay: float, fn: Hook,
             r: SimRequest) -> None:
        """``fn(r)`` after process ``task`` did ``work`` CPU seconds for ``r`` (when the host's
        cores are modelled) and ``delay`` more seconds passed."""
        if self.cpu is None:
            self.loop.at(t + delay, fn, r)
        else:
            self.tasks[task].submit(t, work, self._later, delay, fn, r)

    def _later(self, t: float, delay: float, fn: Hook, r: SimRequest) -> None:
        self.loop.at(t + delay, fn, r)

    # -- proxy ------------------------------------------------------------------------------

    def run(self, specs: Sequence[RequestSpec]) -> list[SimRequest]:
        """Serve ``specs`` to the end; the requests with their timestamps."""
        for i, spec in enumerate(specs):
            compute = max(1, round(spec.prompt_len * (1.0 - self.prefix_hit)))
            r = SimRequest(i, spec, compute_len=min(compute, spec.prompt_len))
            self.requests.append(r)
            self.loop.at(spec.arrival, self._arrive, r)
        self.loop.run()
        return self.requests

    def _leg_s(self, r: SimRequest) -> float:
        px = self.profile.proxy
        return px.request_s + px.per_prompt_token_s * r.spec.prompt_len

    def _arrive(self, t: float, r: SimRequest) -> None:
        """The client sends ``r``; it reaches the proxy ``client_s`` later."""
        cpu = self.profile.cpu
        self._hop(t, "client", cpu.client_request_s if cpu else 0.0,
                  self.profile.proxy.client_s, self._at_proxy, r)

    def _at_proxy(self, t: float, r: SimRequest) -> None:
        r.t_proxy = t
        if self.planner is not None:
            d = self._local_d()
            streams = [Stream(q.spec.output_len, started=q.t_first is not None)
                       for q in self._placed.get(d.url, {}).values()]
            r.plan = plan = self.planner.choose(self._features(r, d),
                                                d_tpot_ms=self.tpot.get(d.url), streams=streams)
            r.mode, r.reason = plan.path.value, plan.why
            if plan.path is not Path.LOCAL:
                r.moved = round(plan.features[plan.path].move)
        else:
            decision = decide(self.mode, self.dpool, self.headroom)
            r.mode, r.reason = decision.mode.value, decision.reason
        limit = self.limits[r.mode]
        if limit and self.in_flight[r.mode] >= limit:
            self.gate_queue[r.mode].append(r)
            return
        self._admit(t, r)

    def _admit(self, t: float, r: SimRequest) -> None:
        """Past the in-flight limit: the proxy places the request and sends its legs."""
        self.in_flight[r.mode] += 1
        r.t_admitted = t
        cpu = self.profile.cpu
        work = cpu.proxy_request_s if cpu else 0.0
        if r.mode == "local":
            d = self.dpool.pick(t)
            d.acquire()
            self._place(r, d)
            self._prefilling(r, d.url)
            self._hop(t, "proxy", work, self._leg_s(r), self._d_api, r)
            return
        if r.mode == "push":
            d = self.dpool.pick(t)
            d.acquire()
            self._place(r, d)
            self._hop(t, "proxy", work, self._leg_s(r), self._d_api, r)
        else:
            work /= 2  # the other half goes with the D leg, once P answered
        p = self.ppool.pick(t)
        p.acquire()
        r.p = self._index(self.ppool, p)
        self._prefilling(r, p.url)
        self._hop(t, "proxy", 0.0 if r.mode == "push" else work, self._leg_s(r), self._p_api,
                  r)

    def _place(self, r: SimRequest, d: Engine) -> None:
        """``r`` decodes on ``d``: one of the streams the TPOT guard weighs there until it
        closes (at D's measured TPOT, as the proxy takes a stream it has not measured)."""
        r.d = self._index(self.dpool, d)
        self._placed.setdefault(d.url, {})[r.id] = r

    def _prefilling(self, r: SimRequest, url: str) -> None:
        if self.planner is not None:
            self._pending[url] = self._pending.get(url, 0.0) + r.compute_len
            self._pending_of[r.id] = (url, float(r.compute_len))

    # -- plan --------------------------------------------------------------------------------

    def _local_d(self) -> Engine:
        """The D the planner weighs D alone on: the least loaded."""
        return min(self.dpool.engines, key=lambda e: e.in_flight)

    def _features(self, r: SimRequest, d: Engine) -> dict[Path, Features]:
        """Each possible path's features, as :meth:`kvbridge.proxy.planning.Planning.plan`
        builds them: local on ``d``; push and pull with the least-loaded P, when the fleet
        has one. Every engine holds the same leading share of the prompt."""
        prompt = r.spec.prompt_len
        held = float(prompt - r.compute_len)
        out = {Path.LOCAL: Features(float(r.compute_len), 0.0, held,
                                    self._pending.get(d.url, 0.0), decodes=d.in_flight)}
        if self.ppool.engines:
            p_queue = min(self._pending.get(e.url, 0.0) for e in self.ppool.engines)
            out[Path.PUSH] = out[Path.PULL] = Features(float(r.compute_len), prompt - held,
                                                       held, p_queue)
        return out

    def _observe(self, t: float, r: SimRequest) -> None:
        """D's first token of ``r``: the planner learns the TTFT the proxy would measure."""
        url, tokens = self._pending_of.pop(r.id, ("", 0.0))
        if url:
            self._pending[url] = max(0.0, self._pending.get(url, 0.0) - tokens)
        if self.planner is None or not isinstance(r.plan, Plan) or r.t_proxy is None:
            return
        ttft_ms = (t + self.profile.proxy.stream_s - r.t_proxy) * 1000.0
        self.planner.observe(r.plan, Path(r.mode), ttft_ms)

    # -- legs ----------------------------------------------------------------------------------

    def _p_api(self, t: float, r: SimRequest) -> None:
        cpu = self.profile.cpu
        self._hop(t, f"P{r.p}", cpu.p_api_request_s if cpu else 0.0, 0.0, self._to_p, r)

    def _d_api(self, t: float, r: SimRequest) -> None:
        cpu = self.profile.cpu
        self._hop(t, f"D{r.d}", cpu.d_api_request_s if cpu else 0.0, 0.0, self._to_d, r)

    @staticmethod
    def _index(pool: Pool, e: Engine) -> int:
        return pool.engines.index(e)

    def _to_p(self, t: float, r: SimRequest) -> None:
        self.prefills[r.p].submit(r, t)

    def _to_d(self, t: float, r: SimRequest) -> None:
        self.decodes[r.d].submit(r, t)

    def _kv_ready(self, t: float, r: SimRequest) -> None:
        """P's prompt is computed (P's answer goes back to the proxy)."""
        self.loop.at(t + self.profile.proxy.answer_s, self._p_answered, r)
        if self.profile.cpu is not None:
            self.tasks[f"P{r.p} connector"].submit(t, self.profile.cpu.p_engine_request_s,
                                                   _nothing, r)
        if r.mode == "push" and r.registered is not None:
            self._post_write(t, r)

    def _p_answered(self, t: float, r: SimRequest) -> None:
        self.ppool.engines[r.p].release()
        if r.mode == "pull":
            d = self.dpool.pick(t)  # late placement: the least-loaded D now that P is done
            d.acquire()
            self._place(r, d)
            cpu = self.profile.cpu
            self._hop(t, "proxy", cpu.proxy_request_s / 2 if cpu else 0.0, self._leg_s(r),
                      self._d_api, r)

    # -- D side ------------------------------------------------------------------------------

    def _d_admit(self, t: float, r: SimRequest) -> float:
        """D admitted ``r``: the seconds of connector work this puts on D's loop."""
        if self.profile.cpu is not None:
            self.tasks[f"D{r.d} connector"].submit(t, self.profile.cpu.d_engine_request_s,
                                                   _nothing, r)
        if r.mode == "local":
            return 0.0
        shape = self.profile.model
        r.ndesc = shape.descriptors(self._moved(r), self.fragmentation)
        if r.mode == "push":
            return self.profile.push.register_s
        pull = self.profile.pull
        setup = pull.setup_s + pull.per_desc_s * r.ndesc
        if pull.on_d_loop:
            return setup
        done = self.d_threads[r.d].run(t, setup)
        self.loop.at(done, self._post_read, r)
        return 0.0

    def _d_loop_done(self, t: float, r: SimRequest) -> None:
        if r.mode == "push":
            self.loop.at(t + self.profile.push.register_latency_s, self._registered, r)
        elif self.profile.pull.on_d_loop:
            self._post_read(t, r)

    @staticmethod
    def _moved(r: SimRequest) -> int:
        """Prompt tokens the hand-off moves."""
        return r.spec.prompt_len if r.moved < 0 else r.moved

    def _post_read(self, t: float, r: SimRequest) -> None:
        r.t_posted = t
        link, shape = self.profile.link, self.profile.model
        service = link.service("read", shape.rank_bytes(self._moved(r)), r.ndesc)
        done = reserve(self.p_nics[r.p], self.d_nics[r.d], t, service, link.latency_s)
        self.loop.at(done, self._read_done, r)

    def _read_done(self, t: float, r: SimRequest) -> None:
        self.decodes[r.d].kv_landed(r, t)
        self.loop.at(t + self.profile.pull.done_s, self._p_free, r)

    # -- P side (push) -------------------------------------------------------------------------

    def _registered(self, t: float, r: SimRequest) -> None:
        r.registered = t
        if r.t_kv_ready is not None:  # P finished before D registered: push on arrival
            self._post_write(t, r)

    def _post_write(self, t: float, r: SimRequest) -> None:
        push = self.profile.push
        cost = push.setup_s + push.per_desc_s * r.ndesc
        if push.post_on_p_thread:
            self.loop.at(self.p_threads[r.p].run(t, cost), self._write, r)
        else:
            self.prefills[r.p].on_loop(cost, self._write, r, t)

    def _write(self, t: float, r: SimRequest) -> None:
        r.t_posted = t
        link, shape = self.profile.link, self.profile.model
        service = link.service("write", shape.rank_bytes(self._moved(r)), r.ndesc)
        done = reserve(self.p_nics[r.p], self.d_nics[r.d], t, service, link.latency_s)
        self.loop.at(done, self._p_free, r)
        self.loop.at(done + self.profile.push.notify_s, self._write_landed, r)

    def _write_landed(self, t: float, r: SimRequest) -> None:
        self.decodes[r.d].kv_landed(r, t)

    def _p_free(self, t: float, r: SimRequest) -> None:
        self.prefills[r.p].release(r, t)

    def _finished(self, t: float, r: SimRequest) -> None:
        if r.finishes != 1:
            raise SimulationError(f"request {r.id} finished {r.finishes} times")
        if self.cpu is None:  # else the stream closes when the client has the last token
            self.loop.at(t + self.profile.proxy.stream_s, self._stream_closed, r)

    def _token(self, t: float, r: SimRequest) -> None:
        """D produced a token for ``r``: D's API server, the proxy and the client handle it."""
        cpu = self.profile.cpu
        assert cpu is not None
        if r.generated == 1:
            self.tasks[f"D{r.d} connector"].submit(t, cpu.d_engine_stream_s, _nothing, r)
        self.tasks[f"D{r.d}"].submit(t, cpu.d_api_token_s, self._relay, r)

    def _relay(self, t: float, r: SimRequest) -> None:
        cpu = self.profile.cpu
        assert cpu is not None
        self._hop(t, "proxy", cpu.proxy_token_s, self.profile.proxy.stream_s, self._to_client,
                  r)

    def _to_client(self, t: float, r: SimRequest) -> None:
        cpu = self.profile.cpu
        assert cpu is not None
        self.tasks["client"].submit(t, cpu.client_token_s, self._seen, r)

    def _seen(self, t: float, r: SimRequest) -> None:
        r.seen += 1
        if r.t_seen_first is None:
            r.t_seen_first = t
        r.t_seen_last = t
        if r.seen == r.spec.output_len:
            self._stream_closed(t, r)

    def _stream_closed(self, t: float, r: SimRequest) -> None:
        d = self.dpool.engines[r.d]
        d.release()
        self._placed.get(d.url, {}).pop(r.id, None)
        if self.planner is not None and r.spec.output_len >= 3:
            # the proxy's TPOT measure: first → last token it relayed, per token after the first
            first = r.t_seen_first if r.t_seen_first is not None else r.t_first
            last = r.t_seen_last if r.t_seen_last is not None else r.t_finish
            if first is not None and last is not None and last > first:
                tpot = 1000.0 * (last - first) / (r.spec.output_len - 1)
                self.tpot[d.url] = smoothed_tpot(self.tpot.get(d.url), tpot)
        self.in_flight[r.mode] -= 1
        waiting = self.gate_queue[r.mode]
        if waiting:
            self._admit(t, waiting.popleft())


def _nothing(t: float, r: SimRequest) -> None:
    """A CPU job that only takes its share of a core (nothing waits for it)."""


def simulate(profile: Profile, specs: Sequence[RequestSpec], mode: str, prefills: int = 1,
             decodes: int = 1, prefix_hit: float = 0.0, fragmentation: float | None = None,
             push_headroom: int | None = None,
             planner: PlannerSettings | None = None) -> Fleet:
    """Run one scenario to the end; the fleet (its requests, engines and counters; in plan
    mode ``fleet.planner`` as it ended, each request's ``mode`` the path it took)."""
    fleet = Fleet(profile, prefills, decodes, mode, prefix_hit, fragmentation, push_headroom,
                  planner)
    fleet.run(specs)
    return fleet
