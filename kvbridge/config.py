"""One typed configuration from defaults, ``kv_connector_extra_config`` and ``KVBRIDGE_*``.

Precedence (highest wins): environment variable ``KVBRIDGE_<KEY>`` > ``kv_connector_extra_config``
key > built-in default. :meth:`Config.describe` prints every value with where it came from;
``kvbridge config`` shows it and the connector logs it once at start-up.
"""

from __future__ import annotations

import difflib
import enum
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from kvbridge import registry
from kvbridge.errors import ConfigError
from kvbridge.offload.config import ENV_OFFLOAD, OffloadConfig, apply_env
from kvbridge.transports.compose_spec import MemberSpec, parse_members
from kvbridge.values import BOOL_WORDS, parse_bool

__all__ = ["Config", "Preset", "TransferMode", "ENV_PREFIX", "ENV_ONLY", "OTHER_ENV",
           "parse_bool"]

ENV_PREFIX = "KVBRIDGE_"

#: ``KVBRIDGE_*`` variables that are no configuration key but that kvbridge reads elsewhere
#: (docs/usage.md, "Other variables"): :meth:`Config.load` does not warn about them.
OTHER_ENV: Mapping[str, str] = {
    "KVBRIDGE_CACHE_DIR": "where the demo's tiny model is built (default ~/.cache/kvbridge)",
    "KVBRIDGE_MOONCAKE_MASTER": "the mooncake_master binary kvbridge's tools start",
    "KVBRIDGE_SALT_FROM_HEADER": "default of kvbridge proxy --salt-from-header",
    "KVBRIDGE_KV_ADMISSION": "default of kvbridge proxy --kv-admission",
    "KVBRIDGE_PROXY_URL": "the proxy kvbridge engines / drain / why talk to",
    "KVBRIDGE_REGISTER_ON_IMPORT": "register the connector names with vLLM when "
                                   "kvbridge.integrations.vllm is imported",
    "KVBRIDGE_TEST_PEER_LOG": "log level of the conformance suites' peer process",
}

#: keys only their ``KVBRIDGE_<KEY>`` variable sets, with why: a value in
#: ``kv_connector_extra_config`` is checked but not applied (a warning and the source say so)
ENV_ONLY: Mapping[str, str] = {
    "engine_spin_ms": "vLLM's workers read it before the connector exists",
}


class TransferMode(enum.StrEnum):
    """How one request's KV moves from P to D."""

    PULL = "pull"
    PUSH = "push"
    AUTO = "auto"


@dataclass(frozen=True)
class Preset:
    """What a backend-specific connector name fixes (:mod:`kvbridge.integrations.names`): a
    transport ``backend``, or an offload ``tier`` that is added to the configured tiers."""

    source: str
    backend: str | None = None
    tier: str | None = None


@dataclass(frozen=True)
class Config:
    """Effective kvbridge settings. Field docs double as the configuration reference."""

    backend: str = "shm"
    """Transport backend name (``kvbridge backends`` lists them)."""
    backend_options: dict[str, Any] = field(default_factory=dict)
    """Backend-specific options, e.g. ``{"backends": ["LIBFABRIC"]}`` for nixl."""
    mode: TransferMode = TransferMode.PULL
    """Default transfer mode for requests whose ``kv_transfer_params`` name none."""
    side_channel_host: str = "127.0.0.1"
    """Address the control channel binds to (and advertises, unless it is a wildcard or
    ``advertise_host`` is set). A wildcard (``0.0.0.0``, ``::``, empty) is never advertised."""
    advertise_host: str | None = None
    """Address peers and the router dial to reach this engine's control channel, when it is not
    ``side_channel_host`` (NAT, a wildcard bind). Unset with a wildcard ``side_channel_host``:
    the address of the interface on the default route; without one, start-up fails naming this
    option (kvbridge.advertise)."""
    side_channel_port: int = 0
    """Control-channel port of tp rank 0 (rank r uses port + r); 0 picks a free port."""
    model_identity: str | None = None
    """What names this engine's weights and tokenizer in the model identity, instead of their
    content digest (kvbridge.fingerprint): set the same value on engines whose checkpoints you
    know to be bit-identical but that are stored differently, or a release name you control.
    Engines of different identities never exchange KV nor share tier entries."""
    lease_s: float = 30.0
    """How long P keeps a request's blocks pinned without a heartbeat from D."""
    heartbeat_s: float = 2.0
    """How often D renews P's lease while a transfer is queued or running; a P that refuses
    connections is noticed within about one heartbeat."""
    push_timeout_s: float = 120.0
    """How long D waits for a pushed KV (registration to DONE) before failing the request."""
    prefill_wait_s: float = 10.0
    """P: how long a push registration waits for a prefill request that has not arrived here
    (once it arrived, ``push_timeout_s``); a D whose P leg was lost hears so this soon."""
    transfer_timeout_s: float = 60.0
    """Upper bound on one READ/WRITE; a timeout is a failure."""
    control_timeout_s: float = 5.0
    """Upper bound on one control-channel round trip."""
    stall_s: float = 10.0
    """D: how long a hand-off may make no progress before D gives it up (the load then fails
    the way vLLM's ``kv_load_failure_policy`` says, and P is told to release). Progress: the
    handshake with P finished, P answered the claim or registration, the READ finished (a READ
    of N bytes may take ``stall_s`` + N / 64 MiB/s). A push waiting for P's prefill is not
    stalled (``push_timeout_s`` bounds it)."""
    secret: str | None = None
    """Shared secret of the fleet: every control message, notification and shm handshake is
    HMAC-authenticated with it and replays are refused. Needed for a routable control address.
    Without one, engines on a loopback address use the per-user secret (``secret_file``)."""
    secret_file: str | None = None
    """Where the per-user secret of this host lives when no ``secret`` is set (created on
    first use, mode 0600, in a private directory; kvbridge.trust). Default:
    ``$XDG_RUNTIME_DIR/kvbridge/secret``, else ``~/.local/state/kvbridge/secret``, else
    ``/tmp/kvbridge-<uid>/secret``."""
    allow_insecure_control: bool = False
    """Run without any secret: no per-user secret, and a routable control address may be bound
    unauthenticated. Anyone who reaches the control address can then steer transfers (trusted
    networks only)."""
    replay_window_s: float = 30.0
    """With a secret: how far a message's timestamp may be from now (clock skew allowance)."""
    max_message_bytes: int = 4 << 20
    """Largest control message accepted."""
    max_pending: int = 4096
    """Push registrations P holds at once (all decode engines together) before it admits only
    fair shares: past this total, a registration is admitted only while its decode control
    address holds fewer than ``max_pending // addresses`` (at least 1; ``addresses`` holding
    registrations, its own included), so a flood cannot starve another decode engine. Hard
    bound: 2 × ``max_pending`` registrations in all."""
    max_pending_per_peer: int = 512
    """Most push registrations P holds for one decode control address (the address P dials and
    handshakes before writing) and for one control connection; at most 2 × ``max_pending`` in
    all (see ``max_pending``)."""
    max_peers: int = 1024
    """Most peers one engine rank keeps handshaken (least recently used are forgotten)."""
    gone_grace_s: float = 1.0
    """After a prefill engine is proven gone, how long D still keeps blocks it let it write."""
    checksum: bool = True
    """Digest every hand-off where its KV was computed and check it where it lands (XXH3-128
    per 256 KiB of each part, :mod:`kvbridge.scheduling.digests`); a mismatch fails the receive.
    Host-memory KV caches only: a CUDA KV cache is not digested. It covers the offload tiers
    too: on, every chunk is stored sealed with its XXH3-128 and checked on every load
    (:mod:`kvbridge.offload.seal`); off, chunks are stored and loaded unchecked. The setting is
    part of the tier keys, so engines sharing a tier (a disk, Mooncake Store, LMCache) with
    different settings never read each other's chunks: each misses the other's entries."""
    flight_recorder: bool = True
    """Keep each hand-off's timestamps on this engine (kvbridge.scheduling.recorder): what
    ``kvbridge why``, ``vllm:kvbridge_phase_seconds`` and the hand-off spans (with vLLM's
    ``--otlp-traces-endpoint``) are made of. Off: none of the three has this engine's part;
    the cost it saves is a few microseconds per hand-off step (docs/why.md)."""
    layerwise: bool = False
    """Push: WRITE each layer as soon as the forward pass has written it."""
    idle_wait_ms: float = 20.0
    """Longest an idle engine step sleeps while only waiting on transfers (0 disables)."""
    wake_on_arrival: bool = True
    """Wake the engine loop the moment a hand-off finishes or a request arrives, through one
    version-checked hook into vLLM's idle sleep (kvbridge.integrations.vllm_idle); off, or where
    the hook cannot be installed, an idle step polls with the idle_wait_ms back-off instead."""
    direct_arrival: bool = True
    """With wake_on_arrival: a rank whose receive succeeded tells the engine loop itself, which
    tells vLLM's scheduler before its next step; the request is then scheduled one engine-core
    <-> worker round trip (idle) or one engine step (busy) sooner. Off: vLLM learns of it from
    the worker's next step output."""
    huge_pages: bool = True
    """Back a CPU engine's KV cache with transparent huge pages at registration (where the
    kernel's THP mode is ``madvise``): ``process_vm_readv/writev`` — the shm transport, and
    UCX's CMA under NIXL — moves 1.5-1.7x faster from and into huge pages
    (kvbridge.host.hugepages). Only all-zero memory is released, so no byte changes; GPU KV caches
    are never touched."""
    map_kv_cache: bool = True
    """With the shm backend, move a CPU engine's KV cache onto a sealed memfd at registration
    (same addresses, same bytes) and hand it to same-host peers over the handshake socket, so
    they copy it with memcpy instead of cross-memory attach (kvbridge.transports.shm.memfd;
    docs/backends/shm.md). Needs the native copy loop built when kvbridge was installed;
    without it, transfers keep using cross-memory attach. GPU KV caches are never touched."""
    engine_spin_ms: float = -1.0
    """vLLM workers busy-spin this long after each step before sleeping (vLLM: 1000 ms).
    Negative keeps vLLM's default. A few ms stops idle engines from burning a core each on
    hosts with few cores, at ~0.1 ms extra latency per step after a pause. Read from the
    environment in every engine process (extra_config is not seen early enough)."""
    log_level: str = "INFO"
    """Level of the ``kvbridge`` loggers."""
    offload: dict[str, Any] = field(default_factory=dict)
    """Tiered offload and KV reuse: ``{"tiers": ["dram", {"name": "disk", "path": …}], …}``
    (docs/offload.md); ``KVBRIDGE_OFFLOAD_*`` variables override single entries. Empty: off."""

    sources: dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    #: problems that did not stop loading (unknown ``KVBRIDGE_*`` variables); logged at start-up
    warnings: tuple[str, ...] = field(default=(), compare=False, repr=False)

    # -------------------------------------------------------------------------------------------

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name not in ("sources", "warnings")]

    @classmethod
    def load(
        cls, extra: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
        preset: Preset | None = None,
    ) -> Config:
        """Merge defaults, ``extra`` (vLLM's ``kv_connector_extra_config``) and ``env``.

        Raises :class:`ConfigError` for an unknown extra_config key (with a suggestion) or a bad
        value. An unknown ``KVBRIDGE_*`` variable is only a warning (kept in :attr:`warnings`):
        fleets share environments across versions, and a newer variable must not stop an older
        engine. ``preset`` (a backend-specific connector name) fixes the backend — a ``backend``
        setting naming another one is a :class:`ConfigError` — or adds its offload tier.
        """
        env = os.environ if env is None else env
        known = cls.keys()
        values: dict[str, Any] = {}
        sources = {k: "default" for k in known}
        warnings: list[str] = []
        not_applied: dict[str, Any] = {}
        for key, raw in (extra or {}).items():
            if key not in known:
                raise ConfigError(_unknown(key, known, "kv_connector_extra_config key"))
            value = _coerce(key, raw, "kv_connector_extra_config")
            if key in ENV_ONLY:
                not_applied[key] = value
                continue
            values[key] = value
            sources[key] = "kv_connector_extra_config"

        tier = preset.tier if preset else None
        offload, used = apply_env(values.get("offload"), env, require=tier)
        if used or tier:
            values["offload"] = offload
            origin = ["env " + ", ".join(used)] if used else (
                [] if sources["offload"] == "default" else [sources["offload"]])
            sources["offload"] = " + ".join(origin + ([preset.source] if preset and tier
                                                      else []))
        for name, raw in env.items():
            if not name.startswith(ENV_PREFIX) or name.startswith(ENV_OFFLOAD):
                continue
            key = name[len(ENV_PREFIX) :].lower()
            if name in OTHER_ENV:
                continue
            if key not in known:
                warnings.append(_unknown(key, known, f"environment variable {name}") + "; ignored")
                continue
            values[key] = _coerce(key, raw, f"env {name}")
            sources[key] = f"env {name}"
        for key, value in not_applied.items():
            if key not in values:  # the environment did not set it either
                sources[key] = f"default (kv_connector_extra_config's {value} not applied)"
                warnings.append(f"{key} in kv_connector_extra_config is not applied: "
                                f"{ENV_ONLY[key]}; set {ENV_PREFIX}{key.upper()} in every "
                                "engine's environment instead")
        if preset and preset.backend:
            if "backend" in values and values["backend"] != preset.backend:
                raise ConfigError(
                    f"{preset.source} selects backend {preset.backend!r}, but "
                    f"{sources['backend']} sets backend {values['backend']!r}: remove that "
                    "setting, or use kv_connector KVBridgeConnector to choose the backend by "
                    "configuration")
            values["backend"] = preset.backend
            sources["backend"] = preset.source
        cfg = cls(**values, sources=sources, warnings=tuple(warnings))
        cfg._validate()
        return cfg

    def with_overrides(self, **kw: Any) -> Config:
        """A copy with ``kw`` applied (marked as source ``override``)."""
        src = dict(self.sources)
        src.update({k: "override" for k in kw})
        cfg = replace(self, **{k: _coerce(k, v, "override") for k, v in kw.items()}, sources=src)
        cfg._validate()
        return cfg

    def _validate(self) -> None:
        for key in ("lease_s", "heartbeat_s", "push_timeout_s", "transfer_timeout_s",
                    "control_timeout_s", "stall_s", "replay_window_s", "gone_grace_s",
                    "prefill_wait_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key} must be > 0, got {getattr(self, key)}")
        if self.heartbeat_s >= self.lease_s:
            raise ConfigError(
                f"heartbeat_s ({self.heartbeat_s}) must be shorter than lease_s ({self.lease_s})"
            )
        if not 0 <= self.side_channel_port < 65536:
            raise ConfigError(f"side_channel_port out of range: {self.side_channel_port}")
        if self.max_message_bytes < 65536:
            raise ConfigError("max_message_bytes must be at least 65536")
        for key in ("max_pending", "max_pending_per_peer", "max_peers"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.model_identity is not None and not (
                0 < len(self.model_identity) <= 256 and self.model_identity.isprintable()):
            raise ConfigError("model_identity must be 1 to 256 printable characters, got "
                              f"{self.model_identity!r:.80}")
        if self.backend == "compose":
            self.compose_members()
        self.offload_config()

    def check_loadable(self) -> None:
        """Import the backend, the compose members and the offload tiers this configuration
        names; raise :class:`BackendNotFound` or :class:`BackendUnavailable` (with the install
        hint) for the first that cannot load here. Constructs nothing."""

        registry.load_class(self.backend)
        for member in self.compose_members():
            if member.kind == "transport":
                registry.load_class(member.name)
        for tier in self.offload_config().tiers:
            registry.load_tier_class(tier.name)

    def compose_members(self) -> list[MemberSpec]:
        """``backend_options.members`` of the ``compose`` backend, parsed (empty otherwise)."""
        if self.backend != "compose":
            return []

        return parse_members(self.backend_options.get("members"))

    def offload_config(self) -> OffloadConfig:
        """The parsed :attr:`offload` (raises :class:`ConfigError` naming the key), with the
        tier members of a ``compose`` backend appended after the tiers it lists itself."""

        raw = dict(self.offload)
        tiers = [s for s in self.compose_members() if s.kind == "tier"]
        if tiers:
            listed = list(raw.get("tiers", []))
            names = {t if isinstance(t, str) else t.get("name") for t in listed
                     if isinstance(t, (str, dict))}
            raw["tiers"] = listed + [{"name": s.name, **s.options} for s in tiers
                                     if s.name not in names]
        return replace(OffloadConfig.parse(raw), sealed=self.checksum)

    def describe(self) -> list[tuple[str, str, str]]:
        """``(key, value, source)`` rows; the secret is masked."""
        rows = []
        for key in self.keys():
            value = getattr(self, key)
            if key == "secret" and value:
                shown = "***"
            elif isinstance(value, enum.Enum):
                shown = str(value.value)
            elif isinstance(value, dict):
                shown = json.dumps(value, sort_keys=True)
            else:
                shown = str(value)
            rows.append((key, shown, self.sources.get(key, "default")))
        return rows

    def summary(self) -> str:
        """One log line: ``key=value (source)`` for every non-default value, then the rest."""
        return ", ".join(f"{k}={v} ({s})" for k, v, s in self.describe())


def _unknown(key: str, known: list[str], what: str) -> str:
    near = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return f"unknown {what} {key!r}{hint} (known: {', '.join(known)})"


def _coerce(key: str, raw: Any, source: str = "") -> Any:
    """Convert ``raw`` (a string from the environment, or a JSON value) to ``key``'s type;
    :class:`ConfigError` naming the key, the value, where it came from and what it must be."""
    field_ = Config.__dataclass_fields__[key]
    kind, default = field_.type, field_.default
    if isinstance(default, enum.Enum):  # every enum setting: its values, not the class's name
        choices = [str(m.value) for m in type(default)]
        word = str(raw).strip().lower()
        if word not in choices:
            near = difflib.get_close_matches(word, choices, n=1)
            raise ConfigError(_bad(key, raw, source, f"expected one of {', '.join(choices)}"
                                   + (f" (did you mean {near[0]!r}?)" if near else "")))
        return type(default)(word)
    try:
        if key in ("backend_options", "offload"):
            value = json.loads(raw) if isinstance(raw, str) else raw
            if not isinstance(value, dict):
                raise TypeError("expected a JSON object")
            return dict(value)
        if kind == "bool":
            if isinstance(raw, bool):
                return raw
            return BOOL_WORDS[str(raw).strip().lower()]
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        if kind == "str | None":
            return None if raw in (None, "") else str(raw)
        if key == "log_level":
            return str(raw).upper()
        return str(raw)
    except KeyError:
        raise ConfigError(_bad(key, raw, source, "expected true or false (1/0, yes/no, on/off)")
                          ) from None
    except (TypeError, ValueError) as exc:
        why = f"expected {_KINDS[kind]} ({exc})" if kind in _KINDS else str(exc)
        raise ConfigError(_bad(key, raw, source, why)) from exc


_KINDS = {"int": "an integer", "float": "a number"}


def _bad(key: str, raw: Any, source: str, why: str) -> str:
    return f"bad value for {key}: {raw!r}" + (f" from {source}" if source else "") + f": {why}"
