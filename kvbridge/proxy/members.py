"""The engines one proxy routes to: who they are, their load, and whether they take new work.

:class:`Engine` is one upstream vLLM engine as the proxy sees it; :class:`Pool` the engines of one
:class:`Role` with least-loaded picking. Besides rotation (an engine a failure or its health checks
took out, used only when every engine of its role is out), every engine has an
:class:`Admission`, the operator's word on it (``/admin`` of :mod:`kvbridge.proxy.admin`):

- ``joining``: added to a running proxy; gets no request until its ``/health`` (and, for a P
  the proxy probes, its handshake) passed (:meth:`kvbridge.proxy.pool.Fleet.add`);
- ``active``: picked like any engine;
- ``draining``: gets no new request; what it already serves runs to its end. It is *drained*
  (:attr:`Engine.state`) once the proxy has nothing open on it: no request, and for a P no
  hand-off whose decode leg has not ended (its pull leases are claimed or given up).

A pick never returns an engine that is not ``active``: when no engine of a role is,
:meth:`Pool.pick` raises :class:`NoEngine` (the proxy answers 503 with ``Retry-After``) —
nothing is refused that another engine could take, and nothing is sent to one that is leaving.

Plain data, no I/O. Used from the proxy's one event loop; not thread-safe (the loop never awaits
between a pick and the matching :meth:`Engine.acquire`, so two requests cannot both see the same
free engine).
"""

from __future__ import annotations

import enum
import math
import re
import time
import urllib.parse
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from kvbridge.errors import ConfigError
from kvbridge.params import TransferParams

__all__ = ["Admission", "Engine", "EngineState", "NoEngine", "Pool", "ProbeInfo", "Role",
           "control_addresses", "normalize_url", "parse_engine_url"]


class Role(enum.StrEnum):
    """What an engine does for the proxy."""

    PREFILL = "prefill"
    DECODE = "decode"




@dataclass(frozen=True)
class ProbeInfo:
    """An engine's control addresses, as its connector answered a probe (parsed params)."""

    params: TransferParams

    @property
    def engine_id(self) -> str:
        return self.params.remote_engine_id or "?"

    @property
    def host(self) -> str:
        return self.params.remote_host or "?"

    @property
    def port(self) -> int:
        return self.params.remote_port or 0

    @property
    def tp_size(self) -> int:
        return self.params.tp_size

    @property
    def version(self) -> str:
        return self.params.kvbridge_version or "?"

    @property
    def generation(self) -> str | None:
        """Rank 0's generation; a restarted engine answers a new one (None: not reported)."""
        return self.params.kvbridge_generation

    def addresses(self) -> list[str]:
        """Every rank's control address (rank order)."""
        return control_addresses(self.params)


def control_addresses(answer: TransferParams) -> list[str]:
    """The control addresses named by ``answer`` (``kvbridge_peers``, else rank 0's host:port)."""
    out = []
    for rank in range(max(1, len(answer.kvbridge_peers or ()))):
        peer = answer.peer(rank)
        if peer is not None:
            out.append(peer.address)
    return out


class Admission(enum.StrEnum):
    """Whether an engine takes new requests, as the operator said (see the module docstring)."""

    JOINING = "joining"
    ACTIVE = "active"
    DRAINING = "draining"


class EngineState(enum.StrEnum):
    """What ``GET /admin/engines`` shows: admission, rotation and load together."""

    JOINING = "joining"
    ACTIVE = "active"
    DRAINING = "draining"
    DRAINED = "drained"
    """Draining, and the proxy has nothing open on it: safe to stop."""
    DEAD = "dead"
    """Out of rotation: refused connections or failed health checks."""


class NoEngine(Exception):
    """No engine of a role takes new requests (all draining, joining or removed)."""

    def __init__(self, role: Role, engines: Sequence[Engine]) -> None:
        counts: dict[str, int] = {}
        for e in engines:
            counts[e.admission.value] = counts.get(e.admission.value, 0) + 1
        what = ", ".join(f"{n} {a}" for a, n in sorted(counts.items())) or "none configured"
        super().__init__(f"no {role.value} engine takes new requests ({what})")
        self.role = role


@dataclass
class Engine:
    """One upstream vLLM engine and its live load as the proxy sees it.

    ``in_flight`` counts the proxy's open requests to it (the routing signal). An engine is *in
    rotation* unless it was taken out: by a connection-level failure (:meth:`mark_down`, for
    ``cooldown_s``, or until a health check passes when ``cooldown_s`` is infinite) or by failed
    health checks (:meth:`check_failed`). An engine out of rotation is only used when every
    engine of its role is out, so one dead backend does not slow every request down.
    """

    url: str
    role: Role
    in_flight: int = 0
    total: int = 0
    errors: int = 0
    down_until: float = 0.0
    down_since: float = 0.0
    last_error: str = ""
    failed_checks: int = 0
    probe: ProbeInfo | None = None
    admission: Admission = Admission.ACTIVE
    handoffs: int = 0
    since: float = 0.0
    """When ``admission`` last changed (monotonic)."""

    @property
    def accepting(self) -> bool:
        """Whether routing may give it a new request (rotation aside)."""
        return self.admission is Admission.ACTIVE

    @property
    def state(self) -> EngineState:
        """Admission, rotation and load in one word (:class:`EngineState`)."""
        if not self.is_up():
            return EngineState.DEAD
        if self.admission is Admission.DRAINING:
            busy = self.in_flight or self.handoffs
            return EngineState.DRAINING if busy else EngineState.DRAINED
        return EngineState(self.admission.value)

    def admit(self, admission: Admission) -> None:
        """Set the operator's word on this engine."""
        if admission is not self.admission:
            self.admission = admission
            self.since = time.monotonic()

    def hold(self) -> None:
        """Count one hand-off this engine serves beyond its open requests (call :meth:`unhold`
        exactly once for each)."""
        self.handoffs += 1

    def unhold(self) -> None:
        self.handoffs = max(0, self.handoffs - 1)

    def acquire(self) -> None:
        """Count one more open request to this engine."""
        self.in_flight += 1
        self.total += 1

    def release(self) -> None:
        """Count one request to this engine as finished (call exactly once per acquire)."""
        self.in_flight = max(0, self.in_flight - 1)

    def mark_down(self, reason: str, cooldown_s: float, now: float | None = None) -> None:
        """Record a connection-level failure; routing avoids the engine for ``cooldown_s``
        (``math.inf``: until :meth:`check_passed` puts it back)."""
        now = time.monotonic() if now is None else now
        self.errors += 1
        self.last_error = reason
        if self.is_up(now):
            self.down_since = now
        self.down_until = now + cooldown_s

    def mark_up(self) -> None:
        self.down_until = 0.0

    def is_up(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) >= self.down_until

    def check_passed(self, started: float, now: float | None = None) -> bool:
        """A health check begun at ``started`` answered 200. Puts the engine back in rotation
        unless it was taken out after the check began (a death the check did not see); True
        when it came back."""
        self.failed_checks = 0
        if self.is_up(now) or self.down_since > started:
            return False
        self.mark_up()
        return True

    def check_failed(self, reason: str, refused: bool, threshold: int,
                     now: float | None = None) -> bool:
        """A health check failed. A refused connection (nothing listens: the process is gone)
        takes the engine out at once, other failures (timeouts, non-200) after ``threshold`` in
        a row; it stays out until a check passes. True when this check took it out."""
        self.failed_checks += 1
        if not (refused or self.failed_checks >= threshold):
            return False
        was_up = self.is_up(now)
        now = time.monotonic() if now is None else now
        self.last_error = reason
        if was_up:
            self.down_since = now
        self.down_until = math.inf
        return was_up


class Pool:
    """The engines of one role, with least-loaded picking and round-robin tie-breaks.

    Membership may change while the proxy runs (:meth:`add`, :meth:`remove`); :meth:`remove`
    never takes a role's last engine. A pool starts empty only when ``empty_ok`` (discovery
    will fill it, :mod:`kvbridge.proxy.discovery`): until then every pick raises
    :class:`NoEngine`.
    """

    def __init__(self, role: Role, urls: Sequence[str], empty_ok: bool = False) -> None:
        if not urls and not empty_ok:
            raise ConfigError(f"at least one {role.value} engine URL is required")
        self.role = role
        self.engines = [Engine(normalize_url(u), role) for u in urls]
        if len({e.url for e in self.engines}) != len(self.engines):
            raise ConfigError(f"a {role.value} engine URL is listed twice")
        self._next = 0

    def _accepting(self) -> list[Engine]:
        return [e for e in self.engines if e.accepting]

    def require(self) -> None:
        """Raise :class:`NoEngine` unless some engine of this role takes new requests."""
        if not self._accepting():
            raise NoEngine(self.role, self.engines)

    def pick(self, now: float | None = None, avoid: Collection[str] = (),
             only: Callable[[Engine], bool] | None = None,
             rank: Callable[[Engine], float] | None = None) -> Engine:
        """The in-rotation engine with the fewest in-flight requests; ties go round-robin.

        Only ``active`` engines are candidates; with none, :class:`NoEngine`. Of those, the ones
        ``only`` accepts (a D with KV credit for the request) are preferred while there is one.
        Engines whose URL is in ``avoid`` (those a retried request already tried) are passed
        over while another in-rotation engine is left. When every candidate is out of rotation
        the least-loaded one is returned anyway: the caller then fails fast with a clear error
        instead of refusing without trying. ``rank`` (the planner's estimate for the engine) orders
        the candidates instead of their in-flight counts; lower is better.
        """
        accepting = self._accepting()
        if not accepting:
            raise NoEngine(self.role, self.engines)
        if only is not None:
            accepting = [e for e in accepting if only(e)] or accepting
        up = [e for e in accepting if e.is_up(now)]
        fresh = [e for e in up if e.url not in avoid]
        candidates = fresh or up or accepting
        n = len(self.engines)
        order = {id(e): (i - self._next) % n for i, e in enumerate(self.engines)}
        best = min(candidates, key=lambda e: (e.in_flight if rank is None else rank(e),
                                              order[id(e)]))
        self._next = (self.engines.index(best) + 1) % n
        return best

    def has_untried(self, tried: Collection[str], now: float | None = None) -> bool:
        """Whether an active, in-rotation engine whose URL is not in ``tried`` is left."""
        return any(e.accepting and e.is_up(now) and e.url not in tried for e in self.engines)

    def least_in_flight(self, now: float | None = None) -> int:
        """The smallest in-flight count among active up engines (all active ones when none is
        up; 0 when none is active: the pick then says why)."""
        accepting = self._accepting()
        up = [e for e in accepting if e.is_up(now)] or accepting
        return min((e.in_flight for e in up), default=0)

    def by_url(self, url: str) -> Engine | None:
        url = normalize_url(url)
        return next((e for e in self.engines if e.url == url), None)

    def add(self, url: str, admission: Admission = Admission.JOINING) -> Engine:
        """A new engine of this role (``joining`` unless told); ConfigError if it is listed."""
        url = normalize_url(url)
        if self.by_url(url) is not None:
            raise ConfigError(f"{url} is already a {self.role.value} engine of this proxy")
        e = Engine(url, self.role, admission=admission, since=time.monotonic())
        self.engines.append(e)
        return e

    def remove(self, url: str) -> Engine:
        """Take the engine at ``url`` out of this pool; ConfigError if it is not in it or is
        the last one (a role never has no engine)."""
        e = self.by_url(url)
        if e is None:
            raise ConfigError(f"{normalize_url(url)} is not a {self.role.value} engine of this "
                              "proxy")
        if len(self.engines) == 1:
            raise ConfigError(f"{e.url} is the last {self.role.value} engine; add another first")
        self.engines.remove(e)
        self._next %= len(self.engines)
        return e


def normalize_url(url: str) -> str:
    """``host:port`` or ``http://host:port/`` → ``http://host:port``."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url


_HOST = re.compile(r"^[A-Za-z0-9.\-]{1,253}$|^\[[0-9A-Fa-f:.]{2,45}\]$")


def parse_engine_url(value: object, param: str = "url") -> str:
    """An engine base URL (``http[s]://host:port``, ``host:port`` means http) from untrusted
    input, as ``scheme://host:port``; :class:`ConfigError` naming ``param`` otherwise (not a
    string, over 300 characters, no port, a path, query, fragment or user part, odd host)."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"'{param}' must be an engine URL such as http://10.0.0.7:8100")
    if len(value) > 300:
        raise ConfigError(f"'{param}' is {len(value)} characters long; at most 300")
    text = value.strip().rstrip("/")
    parsed = urllib.parse.urlsplit(text if "://" in text else "http://" + text)
    try:
        port = parsed.port
    except ValueError:
        port = None
    host = parsed.netloc.rsplit(":", 1)[0] if port is not None else parsed.netloc
    if (parsed.scheme not in ("http", "https") or port is None or not _HOST.match(host)
            or parsed.path or parsed.query or parsed.fragment or "@" in parsed.netloc):
        raise ConfigError(f"'{param}' must be http[s]://host:port with nothing after the port, "
                          f"got {value[:100]!r}")
    return f"{parsed.scheme}://{parsed.netloc}"
