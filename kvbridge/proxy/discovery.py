"""Discovery: the proxy finds its engines by DNS or in a file it watches, while it serves.

A :class:`Source` answers, each round, the engine URLs it wants per role: :class:`DnsSource`
(``--prefill-dns`` / ``--decode-dns NAME[:PORT]``: every A/AAAA address NAME resolves to, such as
a headless Service's ready pods, as ``http://ADDRESS:PORT``) and :class:`FileSource`
(``--engines-file``: ``{"prefill": [URL…], "decode": [URL…]}``, re-read when its size or mtime
changes). :class:`Discovery` runs a round every ``--discovery-interval`` seconds and applies the
difference to the :class:`~kvbridge.proxy.pool.Fleet` as :func:`plan` computes it:

- a URL that appears is added (:meth:`Fleet.add`: it gets requests once its ``/health`` and, for
  a P of a pushing proxy, its probe passed);
- a URL discovery added that disappears is drained (:meth:`Fleet.drain`), then removed
  (:meth:`Fleet.remove`) in a later round once it holds nothing; one that comes back before
  that is resumed (only if discovery drained it: an operator's ``/admin`` drain stands);
- engines of the command line (``--prefill``/``--decode``) and those added through ``/admin``
  are never drained or removed by discovery; a role's last engine is never removed.

No flapping: a role changes only in a round where every source that names it answered with at
least one URL. A failed source (DNS error or timeout, a file that is unreadable, too large,
malformed, with an unknown key or a bad URL) or an empty answer changes nothing for the roles it
names; the error is logged once per distinct message and counted
(``kvbridge_proxy_discovery_errors_total{source}``, once per failed round). So scaling a role
to zero through discovery is impossible by design: drain through ``/admin`` instead.

Everything a source answers is hostile: a DNS answer must be IP addresses (at most
:data:`MAX_ENGINES`), the file a regular file of at most :data:`MAX_FILE_BYTES` whose every URL
passes :func:`~kvbridge.proxy.members.parse_engine_url`; anything else fails the whole answer.

Contract: runs on the proxy's event loop, not thread-safe. A resolution is bounded by
``min(5 s, interval)`` (the resolver's thread may outlive it: ``getaddrinfo`` cannot be
cancelled); the file is read in a worker thread. :meth:`Discovery.run` never raises (until
cancelled).
"""

from __future__ import annotations

import asyncio
import enum
import ipaddress
import json
import logging
import os
import socket
import stat
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvbridge.errors import ConfigError
from kvbridge.proxy.members import Admission, Engine, Role, normalize_url, parse_engine_url
from kvbridge.proxy.metrics import ProxyMetrics
from kvbridge.proxy.pool import Fleet
from kvbridge.proxy.settings import ProxySettings, parse_dns_target

__all__ = ["Action", "Change", "Current", "Discovery", "DiscoveryError", "DnsSource",
           "FileSource", "MAX_ENGINES", "MAX_FILE_BYTES", "Plan", "Resolver", "Source",
           "from_settings", "plan", "system_resolver"]

log = logging.getLogger("kvbridge.proxy.discovery")

#: the most engines one answer (a DNS name, a role of the file) may name
MAX_ENGINES = 256
#: the largest engines file read
MAX_FILE_BYTES = 1 << 20

Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
"""``(name, port)`` → the addresses ``name`` resolves to (strings; checked by the caller)."""


class DiscoveryError(Exception):
    """A source could not answer this round; the message says why."""


class Change(enum.StrEnum):
    """What a round did to one engine (``discovery_changes_total``'s ``change``)."""

    ADDED = "added"
    DRAINED = "drained"
    REMOVED = "removed"
    RESUMED = "resumed"


class Source(Protocol):
    """Where engines are found. ``kind`` labels its errors (``dns``, ``file``)."""

    kind: str
    name: str

    async def fetch(self) -> dict[Role, frozenset[str]]:
        """The normalized engine URLs per role this source names now (a role it does not name
        is absent); :class:`DiscoveryError` when it cannot answer."""
        ...


# ------------------------------------------------------------------------------ planning


@dataclass(frozen=True)
class Current:
    """What :func:`plan` needs of one engine of the fleet."""

    url: str
    role: Role
    admission: Admission
    busy: bool

    @classmethod
    def of(cls, e: Engine) -> Current:
        return cls(e.url, e.role, e.admission, bool(e.in_flight or e.handoffs))


@dataclass(frozen=True)
class Action:
    change: Change
    role: Role
    url: str


@dataclass
class Plan:
    """The changes one round makes, and the engines kept although they left (last of a role)."""

    actions: list[Action] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)


def plan(desired: Mapping[Role, frozenset[str]], current: Sequence[Current],
         owned: Collection[str], drained: Collection[str]) -> Plan:
    """The changes that make the fleet match ``desired`` (pure).

    ``desired`` holds only the roles whose sources all answered (an empty set changes nothing);
    ``owned`` are the URLs discovery added, the only ones it drains or removes; ``drained`` those
    it drained itself, the only ones it resumes. An owned engine that left is drained, and
    removed once drained and not busy, unless it is its role's last engine.
    """
    out = Plan()
    every = {c.url for c in current}
    for role in Role:
        want = desired.get(role, frozenset())
        if not want:
            continue
        mine = [c for c in current if c.role is role]
        for url in sorted(want - every):
            out.actions.append(Action(Change.ADDED, role, url))
        left = len(mine) + sum(1 for a in out.actions if a.role is role)
        for c in mine:
            if c.url not in owned:
                continue
            if c.url in want:
                if c.admission is Admission.DRAINING and c.url in drained:
                    out.actions.append(Action(Change.RESUMED, role, c.url))
            elif c.admission is not Admission.DRAINING:
                out.actions.append(Action(Change.DRAINED, role, c.url))
            elif not c.busy:
                if left > 1:
                    out.actions.append(Action(Change.REMOVED, role, c.url))
                    left -= 1
                else:
                    out.kept.append(c.url)
    return out


# ------------------------------------------------------------------------------ sources


async def system_resolver(name: str, port: int) -> Sequence[str]:
    """The system resolver's A/AAAA answer (``loop.getaddrinfo``): every address, in order."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


class DnsSource:
    """One role's engines: every address ``target`` (``NAME[:PORT]``) resolves to, on PORT."""

    kind = "dns"

    def __init__(self, role: Role, target: str, flag: str, timeout_s: float,
                 resolver: Resolver | None = None) -> None:
        self.role = role
        self.host, self.port = parse_dns_target(target, flag)
        self.name = f"{flag} {target}"
        self.timeout_s = timeout_s
        self.resolver = resolver or system_resolver

    async def fetch(self) -> dict[Role, frozenset[str]]:
        try:
            answer = await asyncio.wait_for(self.resolver(self.host, self.port), self.timeout_s)
        except TimeoutError:
            raise DiscoveryError(f"resolving {self.host} took over {self.timeout_s:g} s") from None
        except (OSError, UnicodeError, ValueError) as exc:
            raise DiscoveryError(f"resolving {self.host}: {exc}") from None
        if isinstance(answer, str | bytes) or not isinstance(answer, Sequence):
            raise DiscoveryError(f"resolving {self.host}: the resolver answered "
                                 f"{type(answer).__name__}, not a list of addresses")
        urls = set()
        for raw in answer[:MAX_ENGINES * 4 + 1]:  # IPv4 and IPv6, TCP and its kin, per engine
            try:
                if not isinstance(raw, str):
                    raise ValueError(raw)
                ip = ipaddress.ip_address(raw.split("%", 1)[0])
            except ValueError:
                raise DiscoveryError(f"resolving {self.host}: {str(raw)[:80]!r} is no IP "
                                     "address") from None
            host = f"[{ip.compressed}]" if ip.version == 6 else ip.compressed
            urls.add(f"http://{host}:{self.port}")
        if len(urls) > MAX_ENGINES or len(answer) > MAX_ENGINES * 4:
            raise DiscoveryError(f"resolving {self.host}: over {MAX_ENGINES} addresses")
        return {self.role: frozenset(urls)}


class FileSource:
    """Both roles' engines from a JSON file, re-read when its size, mtime or inode change."""

    kind = "file"

    def __init__(self, path: str) -> None:
        self.path = path
        self.name = f"--engines-file {path}"
        self._seen: tuple[int, int, int, int] | None = None
        self._answer: dict[Role, frozenset[str]] | None = None
        self._error: str | None = None

    async def fetch(self) -> dict[Role, frozenset[str]]:
        try:
            st = await asyncio.to_thread(os.stat, self.path)
        except OSError as exc:
            self._seen = None
            raise DiscoveryError(f"cannot read {self.path}: {exc.strerror or exc}") from None
        key = (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns)
        if key != self._seen:
            self._seen = key
            try:
                self._answer, self._error = parse_engines(await asyncio.to_thread(self._read),
                                                          self.path), None
            except DiscoveryError as exc:
                self._answer, self._error = None, str(exc)
        if self._error is not None or self._answer is None:
            raise DiscoveryError(self._error or f"{self.path} was not read")
        return dict(self._answer)

    def _read(self) -> bytes:
        """At most MAX_FILE_BYTES + 1 bytes of a regular file (a FIFO would block: refused)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise DiscoveryError(f"cannot read {self.path}: {exc.strerror or exc}") from None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise DiscoveryError(f"{self.path} is not a regular file")
            data = f.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise DiscoveryError(f"{self.path} is over {MAX_FILE_BYTES} bytes")
        return data


def parse_engines(data: bytes, where: str) -> dict[Role, frozenset[str]]:
    """The engines file's content → normalized URLs per role named; :class:`DiscoveryError`
    naming the key (or ``role[i]``) at fault."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise DiscoveryError(f"{where} is not JSON: {str(exc)[:120]}") from None
    if not isinstance(doc, dict):
        raise DiscoveryError(f'{where} must hold a JSON object such as {{"prefill": '
                             f'["http://10.0.0.7:8000"], "decode": [...]}}')
    unknown = sorted(str(k)[:64] for k in doc if k not in ("prefill", "decode"))
    if unknown:
        raise DiscoveryError(f"{where}: unknown key(s) {', '.join(map(repr, unknown[:5]))}; "
                             "the keys are prefill and decode")
    out: dict[Role, frozenset[str]] = {}
    for role in Role:
        if role.value not in doc:
            continue
        urls = doc[role.value]
        if not isinstance(urls, list) or len(urls) > MAX_ENGINES:
            raise DiscoveryError(f"{where}: '{role.value}' must be a list of at most "
                                 f"{MAX_ENGINES} engine URLs")
        try:
            out[role] = frozenset(normalize_url(parse_engine_url(u, f"{role.value}[{i}]"))
                                  for i, u in enumerate(urls))
        except ConfigError as exc:
            raise DiscoveryError(f"{where}: {exc}") from None
    both = out.get(Role.PREFILL, frozenset()) & out.get(Role.DECODE, frozenset())
    if both:
        raise DiscoveryError(f"{where}: {sorted(both)[0]} is listed as prefill and decode")
    return out


# ------------------------------------------------------------------------------ the loop


class Discovery:
    """Applies what the sources answer to the fleet, every ``interval_s`` (module docstring)."""

    def __init__(self, fleet: Fleet, metrics: ProxyMetrics, sources: Sequence[Source],
                 interval_s: float) -> None:
        self.fleet = fleet
        self.metrics = metrics
        self.sources = list(sources)
        self.interval_s = interval_s
        self.owned: set[str] = set()
        self.drained: set[str] = set()
        self._said: dict[str, str] = {}

    def _once(self, key: str, message: str | None, level: int = logging.WARNING) -> None:
        """Log ``message`` unless it is what was last said under ``key`` (None: forget)."""
        if message is None:
            if self._said.pop(key, None) is not None and key.startswith("source:"):
                log.warning("%s answers again", key[7:])
            return
        if self._said.get(key) != message:
            self._said[key] = message
            log.log(level, "%s", message)

    async def round(self) -> Plan:
        """Ask every source at once, then apply the plan; returns it."""
        answers = await asyncio.gather(*(s.fetch() for s in self.sources), return_exceptions=True)
        desired: dict[Role, set[str]] = {}
        blocked: set[Role] = set()
        for src, ans in zip(self.sources, answers, strict=True):
            if isinstance(ans, BaseException):
                if not isinstance(ans, DiscoveryError):
                    if isinstance(ans, asyncio.CancelledError):
                        raise ans
                    ans = DiscoveryError(f"{type(ans).__name__}: {ans}")
                self.metrics.discovery_error(src.kind)
                self._once("source:" + src.name, f"discovery: {src.name}: {ans}; engines of "
                           "this source unchanged")
                blocked.update(_roles_of(src))
                continue
            self._once("source:" + src.name, None)
            for role, urls in ans.items():
                if not urls:
                    self._once("empty:" + src.name + role.value, f"discovery: {src.name} names "
                               f"no {role.value} engine; {role.value} engines unchanged")
                    blocked.add(role)
                else:
                    self._once("empty:" + src.name + role.value, None)
                desired.setdefault(role, set()).update(urls)
        want = {r: frozenset(u) for r, u in desired.items() if r not in blocked}
        current = [Current.of(e) for e in self.fleet.engines]
        urls_now = {c.url for c in current}
        self.owned &= urls_now
        self.drained &= urls_now
        p = plan(want, current, self.owned, self.drained)
        for a in p.actions:
            self._apply(a)
        for url in p.kept:
            self._once("kept:" + url, f"discovery: {url} left, but it is the last engine of its "
                       "role: kept (draining) until another one joins")
        for url in [k[5:] for k in self._said if k.startswith("kept:")]:
            if url not in p.kept:
                self._once("kept:" + url, None)
        return p

    def _apply(self, a: Action) -> None:
        try:
            if a.change is Change.ADDED:
                self.fleet.add(a.role, a.url)
                self.owned.add(a.url)
            elif a.change is Change.DRAINED:
                self.fleet.drain(a.url)
                self.drained.add(a.url)
            elif a.change is Change.RESUMED:
                self.fleet.resume(a.url)
                self.drained.discard(a.url)
            else:
                self.fleet.remove(a.url)
                self.owned.discard(a.url)
                self.drained.discard(a.url)
        except ConfigError as exc:
            self._once(f"{a.change}:{a.url}", f"discovery: cannot mark {a.url} {a.change}: {exc}")
            return
        self._once(f"{a.change}:{a.url}", None)
        self.metrics.discovery_change(a.role.value, a.change.value)
        log.info("discovery: %s engine %s %s", a.role.value, a.url, a.change.value)

    async def run(self) -> None:
        """A round now, then one every ``interval_s``; never raises until cancelled."""
        while True:
            started = time.monotonic()
            try:
                await self.round()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - discovery must never kill the proxy
                log.exception("discovery round failed; engines unchanged")
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))


def _roles_of(src: Source) -> Iterable[Role]:
    role = getattr(src, "role", None)
    return (role,) if isinstance(role, Role) else tuple(Role)


def from_settings(settings: ProxySettings, fleet: Fleet, metrics: ProxyMetrics,
                  resolver: Resolver | None = None) -> Discovery | None:
    """The discovery ``settings`` ask for (None: no ``--*-dns`` and no ``--engines-file``)."""
    timeout = min(5.0, settings.discovery_interval_s)
    sources: list[Source] = []
    for role, target in ((Role.PREFILL, settings.prefill_dns),
                         (Role.DECODE, settings.decode_dns)):
        if target is not None:
            sources.append(DnsSource(role, target, f"--{role.value}-dns", timeout, resolver))
    if settings.engines_file is not None:
        sources.append(FileSource(settings.engines_file))
    if not sources:
        return None
    return Discovery(fleet, metrics, sources, settings.discovery_interval_s)
