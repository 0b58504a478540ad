"""Cost profiles: what each step of a P/D fleet costs, with where every number came from.

A profile is a JSON object (``kind: kvbridge-simulate-profile``) with one section per part of the
fleet (``model``, ``prefill``, ``decode``, ``link``, ``pull``, ``push``, ``proxy``), an optional
``scenario`` (the workload the profile was measured or published with), ``sources``: one
sentence per parameter saying where its value comes from, and optionally ``calibration`` (the
raw measurements a calibrated profile was derived from; kept for the record, not read). Times
are seconds, sizes bytes, bandwidths bytes per second, all per tensor-parallel rank where the
rank matters (ranks work in parallel, so one rank's time is the engine's time).

Profiles are read with :func:`load_profile` (a path, or the name of a profile shipped in
``kvbridge/tools/simulate/profiles/``). A profile file is input from a user: every key is checked
(unknown keys, wrong types, negative or non-finite values are a :class:`ConfigError` naming the
key), so a typo cannot silently fall back to a default.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kvbridge.errors import ConfigError

__all__ = [
    "PROFILE_KIND",
    "PROFILES_DIR",
    "ModelShape",
    "PrefillCost",
    "DecodeCost",
    "LinkCost",
    "PullCost",
    "PushCost",
    "ProxyCost",
    "CpuCost",
    "Scenario",
    "Profile",
    "builtin_profiles",
    "load_profile",
    "parse_profile",
    "profile_to_dict",
    "override",
]

PROFILE_KIND = "kvbridge-simulate-profile"
ARRIVALS: tuple[str, ...] = ("poisson", "uniform", "vllm")
PROFILES_DIR = Path(__file__).with_name("profiles")
_MAX_BYTES = 1 << 20


def _pos(**kw: Any) -> Any:
    """A field that must be > 0."""
    return field(metadata={"min": 0.0, "strict": True}, **kw)


@dataclass(frozen=True)
class ModelShape:
    """The KV cache geometry: what one token's KV weighs and how it is cut into descriptors."""

    name: str
    layers: int = _pos()
    kv_heads: int = _pos()
    head_dim: int = _pos()
    dtype_bytes: int = _pos()
    tp: int = _pos(default=1)
    """Tensor-parallel ranks per engine; each rank moves its share of the heads in parallel."""
    block_size: int = _pos(default=16)
    """Tokens per KV block (vLLM ``--block-size``)."""
    kv_planes: int = _pos(default=2)
    """Descriptor regions per layer: 2 when K and V are separate tensors (FlashAttention layout),
    1 when they share one (FlashInfer layout)."""

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer, all heads."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def rank_bytes(self, tokens: int) -> float:
        """KV bytes one rank moves for ``tokens`` tokens (heads split over the ranks)."""
        heads = max(1.0, self.kv_heads / self.tp)
        return 2.0 * self.layers * heads * self.head_dim * self.dtype_bytes * tokens

    def descriptors(self, tokens: int, fragmentation: float) -> int:
        """Descriptors one rank posts for ``tokens`` tokens: one per contiguous run of blocks per
        region; ``fragmentation`` 0 = one run, 1 = every block its own run."""
        blocks = self.blocks(tokens)
        runs = 1 + round(fragmentation * (blocks - 1)) if blocks else 0
        return self.layers * self.kv_planes * runs


@dataclass(frozen=True)
class PrefillCost:
    """One P engine step: ``step_base_s + per_token_s * new_tokens + per_token_ctx_s * attn``,
    ``attn`` being the sum over the step's new tokens of the context each one attends to."""

    step_base_s: float
    per_token_s: float
    per_token_ctx_s: float
    max_batched_tokens: int = _pos()
    """Chunked-prefill token budget per step (vLLM ``--max-num-batched-tokens``)."""
    kv_capacity_tokens: int = _pos()
    """P's KV pool in tokens; a prompt waits (FCFS) until its blocks fit."""

    def step_time(self, new_tokens: int, attn: float) -> float:
        return self.step_base_s + self.per_token_s * new_tokens + self.per_token_ctx_s * attn


@dataclass(frozen=True)
class DecodeCost:
    """One D engine step over a batch: ``step_base_s + per_seq_s * batch + per_ctx_token_s *
    sum(context)`` (weights are read once per step, each sequence's KV once per step)."""

    step_base_s: float
    per_seq_s: float
    per_ctx_token_s: float
    max_num_seqs: int = _pos()
    kv_capacity_tokens: int = _pos()
    """D's KV pool in tokens; a request is admitted (FCFS) when prompt + output blocks fit."""
    idle_wake_s: float = 0.0
    """An idle D loop notices a finished transfer this long after it lands."""
    async_overlap: bool = False
    """The connector's CPU work on the loop overlaps the accelerator's forward pass (vLLM's
    async scheduling on a GPU): a step costs ``max(connector work, forward)``, not the sum."""

    def step_time(self, batch: int, context_tokens: int) -> float:
        if batch == 0:
            return 0.0
        return self.step_base_s + self.per_seq_s * batch + self.per_ctx_token_s * context_tokens


@dataclass(frozen=True)
class LinkCost:
    """The P→D fabric, per rank: a transfer occupies P's and D's NIC for ``descriptors *
    per_desc + bytes / bandwidth``; the last byte lands ``latency_s`` later."""

    latency_s: float
    read_bandwidth: float = _pos()
    write_bandwidth: float = _pos()
    read_per_desc_s: float = 0.0
    write_per_desc_s: float = 0.0

    def service(self, op: str, nbytes: float, ndesc: int) -> float:
        if op == "read":
            return ndesc * self.read_per_desc_s + nbytes / self.read_bandwidth
        return ndesc * self.write_per_desc_s + nbytes / self.write_bandwidth


@dataclass(frozen=True)
class PullCost:
    """What a pull puts where: D allocates, prepares descriptors and posts the READ after P is
    done, either inline on D's engine loop (``on_d_loop``: vLLM's NixlConnector; the loop, and
    every decoding request, waits) or on a connector thread (kvbridge's transfer loop)."""

    on_d_loop: bool
    setup_s: float
    """Fixed cost per transfer before the READ (allocation, metadata, a claim round trip)."""
    per_desc_s: float
    """Per descriptor: index building + posting (NIXL ``make_prepped_xfer`` + ``postXfer``)."""
    done_s: float
    """D's DONE reaching P (P frees the blocks)."""


@dataclass(frozen=True)
class PushCost:
    """What a push puts where: D allocates and registers at once (on its loop, while P
    prefills); P's WRITE is posted the moment the KV is ready, from a background thread
    (``post_on_p_thread``) or inline on P's loop."""

    register_s: float
    """D's loop: allocate the blocks and send the registration."""
    register_latency_s: float
    """The registration's trip D → P."""
    post_on_p_thread: bool
    setup_s: float
    per_desc_s: float
    notify_s: float
    """P's DONE notification reaching D."""


@dataclass(frozen=True)
class ProxyCost:
    """The router and the engines' HTTP front ends."""

    client_s: float
    """Client → proxy."""
    request_s: float
    """Proxy → an engine's scheduler: one leg sent and accepted by the API server."""
    per_prompt_token_s: float
    """API-server work per prompt token on each leg (tokenising, validating)."""
    answer_s: float
    """P's answer back at the proxy (on pull's critical path)."""
    stream_s: float
    """D's token → the client (API server + proxy relay)."""
    push_headroom: int = 4
    """headroom: push while the least-loaded D has fewer requests in flight (kvbridge proxy)."""
    pull_max_in_flight: int = 0
    """At most this many pull requests per D engine of the fleet between the proxy's admission
    and the client's last token; later ones wait FIFO at the proxy (0: no limit). A limit
    observed in published 1P1D runs whose seat is not identified (see the profile's sources);
    that it scales with the D engines is an assumption."""
    push_max_in_flight: int = 0
    """As ``pull_max_in_flight``, for push requests."""


@dataclass(frozen=True)
class CpuCost:
    """The host's cores shared by the engines and the HTTP front ends
    (:mod:`kvbridge.tools.simulate.
    cpu`): engine k of P0..Px-1, D0..Dy-1 pinned to core k mod ``cores``, as ``kvbridge bench
    serve`` pins them, every front-end process floating. Per-request and per-token costs are
    CPU seconds of one process."""

    cores: int = _pos()
    client_request_s: float = 0.0
    """The load generator (``vllm bench serve``): building and sending one request."""
    client_token_s: float = 0.0
    """The load generator: receiving and parsing one streamed token."""
    proxy_request_s: float = 0.0
    """The proxy: one request's dispatch (pull: half on the P leg, half on the D leg)."""
    proxy_token_s: float = 0.0
    """The proxy: relaying one streamed token."""
    p_api_request_s: float = 0.0
    """P's API server: one request (parse, tokenize, hand to the engine, answer)."""
    d_api_request_s: float = 0.0
    """D's API server: one request."""
    d_api_token_s: float = 0.0
    """D's API server: one streamed token (detokenize, SSE)."""
    p_engine_request_s: float = 0.0
    """P's engine process beyond its steps, per request (connector threads, scheduling, output
    handling), on P's core next to its steps: it slows them, it is not on the request's path."""
    d_engine_request_s: float = 0.0
    """As ``p_engine_request_s``, for D before the request's first token (admitting, receiving
    the KV), from its admission."""
    d_engine_stream_s: float = 0.0
    """As ``d_engine_request_s``, after the first token (while the request decodes, and its
    end), from the first token: it slows D's decode steps."""
    engine_spin_s: float = 0.0
    """An engine loop keeps polling this long (wall seconds) after its last step before it
    sleeps (``KVBRIDGE_ENGINE_SPIN_MS``), taking its share of its core meanwhile."""
    background: float = 0.0
    """Other always-runnable processes on the host (floating), e.g. other jobs."""


@dataclass(frozen=True)
class Scenario:
    """The workload a profile was measured or published with (defaults for ``simulate``)."""

    rate: float = _pos()
    prompt_len: int = _pos()
    output_len: int = _pos()
    requests: int = _pos()
    prefills: int = _pos(default=1)
    decodes: int = _pos(default=1)
    prefix_hit: float = 0.0
    fragmentation: float | None = None
    arrival: str = "poisson"
    """poisson, uniform, or vllm (``vllm bench serve``'s arrivals for ``seed``)."""
    seed: int = 0


@dataclass(frozen=True)
class Profile:
    """A whole fleet's costs (see the module docstring)."""

    name: str
    description: str
    model: ModelShape
    prefill: PrefillCost
    decode: DecodeCost
    link: LinkCost
    pull: PullCost
    push: PushCost
    proxy: ProxyCost
    fragmentation: float
    """Fraction of block boundaries that break a contiguous run (0..1): how scattered the
    allocator leaves a request's blocks, hence how many descriptors a transfer posts."""
    scenario: Scenario | None = None
    sources: Mapping[str, str] = field(default_factory=dict)
    cpu: CpuCost | None = None
    """The host's cores as a shared resource; None: dedicated hosts, front ends are delays."""

    def replace(self, **changes: Any) -> Profile:
        return dataclasses.replace(self, **changes)


_T = TypeVar("_T")
_SECTIONS: dict[str, type[Any]] = {
    "model": ModelShape, "prefill": PrefillCost, "decode": DecodeCost, "link": LinkCost,
    "pull": PullCost, "push": PushCost, "proxy": ProxyCost,
}


def _number(value: Any, where: str, integral: bool, strict_min: bool) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where}: must be a number, got {type(value).__name__}")
    number: float | int = value
    if integral and not isinstance(number, int):
        if not float(number).is_integer():
            raise ConfigError(f"{where}: must be an integer, got {number!r}")
        number = int(number)
    if not math.isfinite(number) or number < 0 or (strict_min and number <= 0):
        raise ConfigError(f"{where}: must be {'> 0' if strict_min else '>= 0'} and finite, "
                          f"got {number!r}")
    return number


def _build(cls: type[_T], data: Any, where: str) -> _T:
    """``cls`` from a JSON object, every key checked (ConfigError naming ``where.key``)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: must be a JSON object")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown key (expected some of "
                          f"{', '.join(fields)})")
    values: dict[str, Any] = {}
    for name, f in fields.items():
        key = f"{where}.{name}"
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{key}: missing")
            continue
        value, kind = data[name], str(f.type)
        if value is None and "None" in kind:
            values[name] = None
        elif kind == "str":
            if not isinstance(value, str) or len(value) > 200:
                raise ConfigError(f"{key}: must be a string of at most 200 characters")
            values[name] = value
        elif kind == "bool":
            if not isinstance(value, bool):
                raise ConfigError(f"{key}: must be true or false")
            values[name] = value
        else:
            values[name] = _number(value, key, kind.startswith("int"),
                                   bool(f.metadata.get("strict")))
    for name in ("fragmentation", "prefix_hit"):
        if values.get(name) is not None and values[name] > 1:
            raise ConfigError(f"{where}.{name}: must be between 0 and 1, got {values[name]!r}")
    if values.get("arrival", "poisson") not in ARRIVALS:
        raise ConfigError(f"{where}.arrival: one of {', '.join(ARRIVALS)}, got "
                          f"{values['arrival']!r}")
    if values.get("cores", 1) > 1024:
        raise ConfigError(f"{where}.cores: at most 1024")
    return cls(**values)


def parse_profile(data: Any, origin: str = "profile") -> Profile:
    """A :class:`Profile` from a parsed JSON document (ConfigError naming the bad key)."""
    if not isinstance(data, Mapping) or data.get("kind") != PROFILE_KIND:
        raise ConfigError(f"{origin}: not a kvbridge simulate profile (kind must be "
                          f"{PROFILE_KIND!r})")
    known = {"kind", "version", "name", "description", "fragmentation", "scenario", "sources",
             "calibration", "cpu", *_SECTIONS}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{origin}: {unknown[0]}: unknown key")
    if data.get("version") != 1:
        raise ConfigError(f"{origin}: version: only version 1 is understood")
    sections = {name: _build(cls, data.get(name), f"{origin}: {name}")
                for name, cls in _SECTIONS.items()}
    frag = _number(data.get("fragmentation", 0.0), f"{origin}: fragmentation", False, False)
    if frag > 1:
        raise ConfigError(f"{origin}: fragmentation: must be between 0 and 1")
    scenario = data.get("scenario")
    cpu = data.get("cpu")
    sources = data.get("sources", {})
    if not isinstance(sources, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in sources.items()):
        raise ConfigError(f"{origin}: sources: must map parameter names to strings")
    name, description = data.get("name", ""), data.get("description", "")
    if not isinstance(name, str) or not name or not isinstance(description, str):
        raise ConfigError(f"{origin}: name and description must be strings (name non-empty)")
    return Profile(
        name=name, description=description, fragmentation=float(frag),
        scenario=None if scenario is None else _build(Scenario, scenario, f"{origin}: scenario"),
        cpu=None if cpu is None else _build(CpuCost, cpu, f"{origin}: cpu"),
        sources=dict(sources), **sections)


def builtin_profiles() -> dict[str, Path]:
    """The profiles shipped with kvbridge, by name (file stem)."""
    return {p.stem: p for p in sorted(PROFILES_DIR.glob("*.json"))}


def load_profile(name_or_path: str) -> Profile:
    """A shipped profile by name (``seeds``, ``host``) or a profile JSON file by path."""
    shipped = builtin_profiles()
    path = shipped.get(name_or_path) or Path(name_or_path)
    if name_or_path not in shipped and not path.is_file():
        raise ConfigError(f"--profile: {name_or_path!r} is neither a shipped profile "
                          f"({', '.join(shipped) or 'none'}) nor a file")
    try:
        if path.stat().st_size > _MAX_BYTES:
            raise ConfigError(f"--profile: {path} is larger than {_MAX_BYTES} bytes")
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"--profile: cannot read {path}: {exc}") from None
    except ValueError as exc:
        raise ConfigError(f"--profile: {path} is not JSON: {exc}") from None
    return parse_profile(data, str(path) if name_or_path not in shipped else name_or_path)


def profile_to_dict(profile: Profile) -> dict[str, Any]:
    """The JSON document of ``profile`` (inverse of :func:`parse_profile`)."""
    out: dict[str, Any] = {"kind": PROFILE_KIND, "version": 1, "name": profile.name,
                           "description": profile.description,
                           "fragmentation": profile.fragmentation}
    for name in _SECTIONS:
        out[name] = dataclasses.asdict(getattr(profile, name))
    if profile.scenario is not None:
        out["scenario"] = dataclasses.asdict(profile.scenario)
    if profile.cpu is not None:
        out["cpu"] = dataclasses.asdict(profile.cpu)
    out["sources"] = dict(profile.sources)
    return out


def override(profile: Profile, assignments: Sequence[str]) -> Profile:
    """``profile`` with ``SECTION.KEY=VALUE`` assignments applied (``--set``, for what-if runs):
    VALUE is JSON (``true``, ``0.7``, ``"x"``) or a bare string; the result is validated like a
    profile file, so a bad key or value is a ConfigError naming it."""
    doc = profile_to_dict(profile)
    for text in assignments:
        name, sep, raw = text.partition("=")
        section, dot, key = name.strip().partition(".")
        if not sep or not dot or section not in (*_SECTIONS, "scenario", "cpu") or not key:
            raise ConfigError(f"--set: expected SECTION.KEY=VALUE with SECTION one of "
                              f"{', '.join((*_SECTIONS, 'scenario', 'cpu'))}, got {text!r}")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        doc.setdefault(section, {})[key] = value
        doc["sources"][f"{section}.{key}"] = f"overridden on the command line (--set {text})"
    return parse_profile(doc, "--set")
