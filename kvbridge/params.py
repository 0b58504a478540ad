"""``kv_transfer_params``: the request-level wire format, parsed once at the boundary, typed.

Every party that reads or writes ``kv_transfer_params`` — the vLLM connector, the proxy, the
benches, the tests, an ASGI guard in front of vLLM — goes through this module, so there is one
definition of the keys, their types and their bounds. The keys are vLLM's own (stock P/D proxies
keep working) plus kvbridge's (``transfer_id``, ``transfer_mode``, ``kvbridge_*``).

Contract:

* :func:`parse` turns an untrusted value (a client's JSON object) into a frozen
  :class:`TransferParams` or raises :class:`ParamsError` whose ``field`` names the offending key
  (``kv_transfer_params.remote_port``) and whose message says what was wrong. It never raises
  anything else, whatever the input (wrong types, huge lists, deep nesting). Unknown keys are
  ignored (proxies add their own), known keys are strict: no string-to-int coercion.
* :meth:`TransferParams.check_decode_leg` adds the cross-key rules of a decode leg (an address,
  block ids for a pull) and raises :class:`ParamsError` the same way.
* The builders (:func:`prefill_request`, :func:`probe_request`, :func:`push_decode_request`,
  :func:`to_wire`) produce plain dicts ready for JSON.

Pure functions over plain data; thread-safe; no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import msgspec

from kvbridge.config import TransferMode
from kvbridge.errors import ParamsError

__all__ = [
    "MAX_BLOCK_IDS",
    "MAX_TP",
    "PeerRef",
    "TransferParams",
    "ParamsError",
    "parse",
    "parse_or_none",
    "to_wire",
    "prefill_request",
    "probe_request",
    "push_decode_request",
    "address_of",
]

#: Most block ids one request may name (a 1M-token prompt at block size 8).
MAX_BLOCK_IDS = 1 << 17
#: Largest tensor-parallel size accepted on the wire.
MAX_TP = 1024
#: Most KV-cache groups per-group block ids may name (as :data:`kvbridge.groups.MAX_GROUPS`).
MAX_BLOCK_GROUPS = 64

_PRINTABLE = r"^[!-~]+\Z"  # printable ASCII, no spaces: engine ids, request ids, generations
Ident = Annotated[str, msgspec.Meta(min_length=1, max_length=256, pattern=_PRINTABLE)]
TransferId = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=_PRINTABLE)]
Host = Annotated[
    str, msgspec.Meta(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9.:%_\[\]-]+\Z")
]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Address = Annotated[
    str,
    msgspec.Meta(max_length=300, pattern=r"^tcp://[A-Za-z0-9.:%_\[\]-]+:[0-9]{1,5}\Z"),
]
BlockId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 31) - 1)]
BlockIds = Annotated[list[BlockId], msgspec.Meta(max_length=MAX_BLOCK_IDS)]
TokenCount = Annotated[int, msgspec.Meta(ge=0, le=1 << 26)]
Size = Annotated[int, msgspec.Meta(ge=1, le=MAX_TP)]
Text = Annotated[str, msgspec.Meta(max_length=2048)]
#: A KV-events publisher an engine reports: ``tcp://HOST:PORT``, HOST a name or an address the
#: proxy can reach (no ``*`` wildcard: :meth:`TransferParams.__post_init__` also refuses
#: ``0.0.0.0``, ``::`` and port 0).
EventsAddress = Annotated[
    str,
    msgspec.Meta(max_length=300,
                 pattern=r"^tcp://(\[[0-9A-Za-z:.%_-]+\]|[A-Za-z0-9._-]+):[0-9]{1,5}\Z"),
]
#: A ZeroMQ topic of vLLM's KV events (printable ASCII, may be empty).
EventsTopic = Annotated[str, msgspec.Meta(max_length=128, pattern=r"^[ -~]*\Z")]


class PeerRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where one tensor-parallel rank of an engine listens, and which generation answered."""

    address: Address
    generation: Ident


class TransferParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The parsed ``kv_transfer_params`` of one request (see the module docstring)."""

    # -- vLLM's keys ----------------------------------------------------------------------
    do_remote_decode: bool = False
    """P leg: keep the KV for a decode engine (pull) or push it to one."""
    do_remote_prefill: bool = False
    """D leg: the prompt's KV comes from a prefill engine."""
    remote_engine_id: Ident | None = None
    remote_host: Host | None = None
    remote_port: Port | None = None
    remote_block_ids: BlockIds | None = None
    """Pull: P's block ids of the whole prompt, in prompt order."""
    remote_block_groups: Annotated[list[BlockIds],
                                   msgspec.Meta(max_length=MAX_BLOCK_GROUPS)] | None = None
    """Pull from a hybrid model: P's block table of the prompt per KV-cache group (the null
    block where a sliding window dropped one). On the wire this is ``remote_block_ids`` in
    vLLM's per-group form ``[[...], [...]]``; :func:`parse` and :func:`to_wire` convert."""
    remote_request_id: Ident | None = None
    remote_num_tokens: TokenCount | None = None
    """Pull: how many prompt tokens P computed; D refuses a prompt of another length."""
    tp_size: Size = 1
    pp_size: Size = 1
    # -- kvbridge's keys -------------------------------------------------------------------
    transfer_id: TransferId | None = None
    """One hand-off; chosen by the router, unique per dispatch."""
    transfer_mode: TransferMode | None = None
    kvbridge_layerwise: bool | None = None
    kvbridge_probe: bool = False
    """Ask the engine for its control addresses; nothing is computed or pinned."""
    kvbridge_version: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    kvbridge_generation: Ident | None = None
    """Rank 0's generation (a restarted engine has a new one)."""
    kvbridge_peers: Annotated[list[PeerRef], msgspec.Meta(max_length=MAX_TP)] | None = None
    """Every tensor-parallel rank's control address and generation, rank order."""
    kvbridge_block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] | None = None
    """Prefill's block size, the unit of ``remote_block_ids`` (absent: the decode engine's)."""
    kvbridge_identity: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{16}\Z")] | None = None
    """Prefill's model identity digest, weight reloads included (a decode engine of another
    identity refuses the hand-off and computes the prompt itself)."""
    kvbridge_record: bool | None = None
    """``false``: the engine keeps no flight record of this hand-off (no steps, no phase
    histograms, no span): for synthetic traffic that should not evict real requests' records
    from the ring, and to measure what recording costs on one engine pair. Absent or ``true``:
    recorded when the engine's ``flight_recorder`` is on."""
    kvbridge_error: Text | None = None
    """P → router: why this prefill could not be handed off (nothing is pinned)."""
    kvbridge_tiers: bool | None = None
    """D leg: ``false`` — this engine's offload tiers serve nothing of this request, the prefill
    engine sends every block D lacks in its prefix cache (the router's choice when reading them
    is slower than moving them); absent or ``true``: tiers serve what they hold."""
    kvbridge_kv_events: EventsAddress | None = None
    """Probe answer: where the engine publishes vLLM's KV events (its ZeroMQ PUB socket,
    ``tcp://HOST:PORT`` on the host it advertises); absent when it publishes none."""
    kvbridge_kv_events_topic: EventsTopic | None = None
    """Probe answer: the topic of those events (vLLM's ``kv_events_config.topic``; absent: "")."""

    def __post_init__(self) -> None:
        if self.kvbridge_kv_events is not None:
            host, _, port = self.kvbridge_kv_events[len("tcp://"):].rpartition(":")
            if host.strip("[]") in ("0.0.0.0", "::", "") or not 1 <= int(port) <= 65535:
                raise ValueError("kvbridge_kv_events must name a reachable host and a port in "
                                 f"[1, 65535], got {self.kvbridge_kv_events!r}")

    # -- derived ----------------------------------------------------------------------------

    def mode(self, default: TransferMode) -> TransferMode:
        """The requested mode, ``default`` when absent; ``auto`` on an engine means pull."""
        mode = self.transfer_mode or default
        return TransferMode.PULL if mode is TransferMode.AUTO else mode

    def peer(self, rank: int) -> PeerRef | None:
        """Rank ``rank``'s control address: from ``kvbridge_peers``, else ``remote_host`` and
        ``remote_port`` for rank 0. None when the params do not say."""
        if self.kvbridge_peers:
            return self.kvbridge_peers[rank] if rank < len(self.kvbridge_peers) else None
        if rank == 0 and self.remote_host and self.remote_port:
            host = self.remote_host
            if ":" in host and not host.startswith("["):
                host = f"[{host}]"
            return PeerRef(f"tcp://{host}:{self.remote_port}", self.kvbridge_generation or "*")
        return None

    def check_decode_leg(self, mode: TransferMode, prompt_tokens: int, block_size: int) -> None:
        """Cross-key rules of a decode leg; raises :class:`ParamsError` naming the key.

        ``block_size`` is this engine's, ``prompt_tokens`` the request's prompt length.
        Prefill's TP size and block size may differ from this engine's (heterogeneous TP and
        block size: the worker ranks map heads and blocks, or refuse what they cannot).
        """
        if self.peer(0) is None:
            raise ParamsError("kv_transfer_params.remote_host",
                              "a decode leg needs remote_host and remote_port (or kvbridge_peers)")
        if self.tp_size > 1 and self.kvbridge_peers is None:
            raise ParamsError("kv_transfer_params.kvbridge_peers",
                              f"a tensor-parallel ({self.tp_size}) prefill needs every rank's "
                              "address (send P's answer unchanged)")
        if self.kvbridge_peers is not None and len(self.kvbridge_peers) != self.tp_size:
            raise ParamsError("kv_transfer_params.kvbridge_peers",
                              f"names {len(self.kvbridge_peers)} ranks, tp_size is "
                              f"{self.tp_size}")
        if self.remote_num_tokens is not None and self.remote_num_tokens != prompt_tokens:
            raise ParamsError("kv_transfer_params.remote_num_tokens",
                              f"prefill computed {self.remote_num_tokens} tokens, this prompt "
                              f"has {prompt_tokens}")
        if mode is TransferMode.PULL and self.remote_block_groups is None:
            if not self.remote_block_ids:
                raise ParamsError("kv_transfer_params.remote_block_ids",
                                  "a pull needs remote_block_ids (send P's answer unchanged)")
            size = self.kvbridge_block_size or block_size
            need = -(-prompt_tokens // size)
            if len(self.remote_block_ids) != need:
                raise ParamsError("kv_transfer_params.remote_block_ids",
                                  f"names {len(self.remote_block_ids)} blocks, the prompt "
                                  f"({prompt_tokens} tokens, block size {size}) has {need}")
            if len(set(self.remote_block_ids)) != need:
                raise ParamsError("kv_transfer_params.remote_block_ids",
                                  "contains duplicate block ids")

    def check_block_groups(self, prompt_tokens: int, group_block_sizes: Sequence[int]) -> None:
        """A pull's block ids against this engine's KV-cache groups (``group_block_sizes``:
        each group's block size; empty for an engine without groups). Raises
        :class:`ParamsError` naming ``remote_block_ids`` when the prefill engine's groups cannot
        be this engine's (a hybrid model with vLLM's hybrid KV-cache manager on one side only),
        or a group's table is not the prompt's length (naming ``kvbridge_block_size`` when
        prefill's block size is not this engine's: hybrid models need equal block sizes)."""
        key = "kv_transfer_params.remote_block_ids"
        groups = self.remote_block_groups
        theirs = 1 if groups is None else len(groups)
        mine = max(len(group_block_sizes), 1)
        if theirs != mine:
            raise ParamsError(key, f"names {theirs} KV-cache group(s), this engine has {mine}: "
                                   "prefill and decode must run the same model with the same "
                                   "hybrid KV-cache manager setting")
        if groups is None:
            return
        theirs_size = self.kvbridge_block_size
        for g, (ids, size) in enumerate(zip(groups, group_block_sizes, strict=True)):
            need = -(-prompt_tokens // size)
            if len(ids) != need and theirs_size is not None and theirs_size != size:
                raise ParamsError("kv_transfer_params.kvbridge_block_size",
                                  f"prefill's block size is {theirs_size}, this engine's "
                                  f"{size}: this is a hybrid model ({mine} KV-cache groups), "
                                  "whose KV moves only between engines of one TP size and "
                                  "block size (docs/usage.md#hybrid-models)")
            if len(ids) != need:
                raise ParamsError(key, f"group {g} names {len(ids)} blocks, the prompt "
                                       f"({prompt_tokens} tokens, block size {size}) has {need}")


_PATH = re.compile(r" - at `\$\.?([^`]*)`$")


def _split_groups(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    """vLLM's per-group form ``remote_block_ids: [[...], ...]`` → ``remote_block_ids`` (one
    group) or ``remote_block_groups`` (several); a raw ``remote_block_groups`` key is ignored."""
    ids = raw.get("remote_block_ids")
    raw = {k: v for k, v in raw.items() if k != "remote_block_groups"}
    if not (isinstance(ids, list) and ids and isinstance(ids[0], list)):
        return raw
    if len(ids) == 1:
        return {**raw, "remote_block_ids": ids[0]}
    if len(ids) > MAX_BLOCK_GROUPS:
        raise ParamsError("kv_transfer_params.remote_block_ids",
                          f"names {len(ids)} KV-cache groups; at most {MAX_BLOCK_GROUPS}")
    total = sum(len(g) if isinstance(g, list) else 1 for g in ids)
    if total > MAX_BLOCK_IDS:
        raise ParamsError("kv_transfer_params.remote_block_ids",
                          f"names {total} block ids; at most {MAX_BLOCK_IDS}")
    out = {k: v for k, v in raw.items() if k != "remote_block_ids"}
    out["remote_block_groups"] = ids
    return out


def parse(raw: Any) -> TransferParams:
    """Parse an untrusted ``kv_transfer_params`` value; raises :class:`ParamsError` only."""
    if raw is None:
        return TransferParams()
    if not isinstance(raw, Mapping):
        raise ParamsError("kv_transfer_params", f"must be a JSON object, not {type(raw).__name__}")
    try:
        return msgspec.convert(_split_groups(raw), type=TransferParams, strict=True)
    except ParamsError:
        raise
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _PATH.search(text)
        key = match.group(1).split("[", 1)[0] if match else ""
        if not key and text.startswith("kvbridge_kv_events "):  # from __post_init__
            key = "kvbridge_kv_events"
        key = "remote_block_ids" if key == "remote_block_groups" else key
        where = f"kv_transfer_params.{key}" if key else "kv_transfer_params"
        raise ParamsError(where, _PATH.sub("", text)[:500]) from None
    except (RecursionError, TypeError, ValueError, OverflowError) as exc:
        raise ParamsError("kv_transfer_params", f"unreadable: {type(exc).__name__}") from None


def parse_or_none(raw: Any) -> tuple[TransferParams | None, ParamsError | None]:
    """``(params, None)`` or ``(None, error)``; for hooks that must never raise."""
    try:
        return parse(raw), None
    except ParamsError as exc:
        return None, exc


def to_wire(params: TransferParams) -> dict[str, Any]:
    """A JSON-ready dict of the non-default keys (per-group block ids as vLLM sends them:
    ``remote_block_ids: [[...], ...]``)."""
    out: dict[str, Any] = msgspec.to_builtins(params)
    groups = out.pop("remote_block_groups", None)
    if groups is not None:
        out["remote_block_ids"] = groups
    return out


def prefill_request(transfer_id: str, mode: TransferMode,
                    layerwise: bool | None = None) -> dict[str, Any]:
    """``kv_transfer_params`` of a P leg (``max_tokens`` 1 is the caller's)."""
    params = TransferParams(do_remote_decode=True, transfer_id=transfer_id, transfer_mode=mode,
                            kvbridge_layerwise=layerwise)
    return to_wire(params)


def probe_request() -> dict[str, Any]:
    """``kv_transfer_params`` asking an engine for its control addresses."""
    return to_wire(TransferParams(kvbridge_probe=True))


def push_decode_request(prefill: TransferParams, transfer_id: str,
                        layerwise: bool | None = None) -> dict[str, Any]:
    """``kv_transfer_params`` of a push D leg, from P's probe answer ``prefill``."""
    params = TransferParams(
        do_remote_prefill=True,
        remote_engine_id=prefill.remote_engine_id,
        remote_host=prefill.remote_host,
        remote_port=prefill.remote_port,
        tp_size=prefill.tp_size,
        transfer_id=transfer_id,
        transfer_mode=TransferMode.PUSH,
        kvbridge_layerwise=layerwise,
        kvbridge_generation=prefill.kvbridge_generation,
        kvbridge_peers=prefill.kvbridge_peers,
        kvbridge_block_size=prefill.kvbridge_block_size,
        kvbridge_identity=prefill.kvbridge_identity,
    )
    return to_wire(params)


def address_of(peers: Sequence[PeerRef] | None, rank: int) -> str | None:
    """Rank ``rank``'s address in ``peers``, or None."""
    if not peers or rank >= len(peers):
        return None
    return peers[rank].address
