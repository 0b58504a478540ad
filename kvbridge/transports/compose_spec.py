"""What a compose transport is made of and what it tells its peers.

* :func:`parse_members` turns ``backend_options.members`` into :class:`MemberSpec` entries
  (transports and offload tiers, in order), naming the bad entry in a :class:`ConfigError`;
  listing names imports no backend.
* :class:`ComposeMetadata` is the strict, bounded msgpack envelope a compose transport hands its
  peers (its agent name and one blob per member); :func:`encode_metadata` writes it and
  :func:`decode_metadata` reads a peer's, raising :class:`MessageError` for anything malformed.

Pure functions and frozen data: thread-safe, non-blocking. The transport itself is
:mod:`kvbridge.transports.compose`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from kvbridge import registry
from kvbridge.errors import ConfigError, MessageError

__all__ = ["MAX_MEMBERS", "ComposeMetadata", "MemberSpec", "decode_metadata", "encode_metadata",
           "parse_members"]

#: Most members one compose transport may have (and a peer's envelope may list).
MAX_MEMBERS = 8
_MAX_NAME = 64
_MAX_BLOB = 8 << 20
_MAX_ENVELOPE = MAX_MEMBERS * _MAX_BLOB
VERSION = 1


@dataclass(frozen=True)
class MemberSpec:
    """One configured member: its entry-point name, whether it is a transport or a tier, and its
    own options."""

    name: str
    kind: Literal["transport", "tier"]
    options: dict[str, Any] = field(default_factory=dict)


def parse_members(raw: Any, where: str = "backend_options.members") -> list[MemberSpec]:
    """Parse a ``members`` list: names or ``{"name": …, options…}`` objects, in order.

    A member is a transport when ``kvbridge.backends`` has the name, else a tier when
    ``kvbridge.tiers`` has it; ``"kind": "transport" | "tier"`` decides explicitly. Raises
    :class:`ConfigError` naming the entry (``where[i]``) for anything else: not a list, empty,
    too many, a bad or unknown name, ``compose`` itself, a duplicate, no transport member.
    Listing names imports no backend.
    """
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{where}: the compose backend needs a non-empty list of members, "
                          f"e.g. [\"shm\", \"nixl\"], got {raw!r}")
    if len(raw) > MAX_MEMBERS:
        raise ConfigError(f"{where}: at most {MAX_MEMBERS} members, got {len(raw)}")
    transports, tiers = set(registry.available()), set(registry.available_tiers())
    specs: list[MemberSpec] = []
    for i, item in enumerate(raw):
        what = f"{where}[{i}]"
        if isinstance(item, str):
            item = {"name": item}
        if not isinstance(item, Mapping) or not isinstance(item.get("name"), str):
            raise ConfigError(f"{what}: expected a member name or an object with a 'name'")
        name = item["name"]
        if name == "compose":
            raise ConfigError(f"{what}: a compose backend cannot contain compose")
        asked = item.get("kind")
        kind: Literal["transport", "tier"] | None
        if asked is None:
            kind = "transport" if name in transports else "tier" if name in tiers else None
        else:
            kind = "transport" if asked == "transport" else "tier" if asked == "tier" else None
        if kind is None or name not in (transports if kind == "transport" else tiers):
            known = ", ".join(sorted((transports - {"compose"}) | tiers))
            raise ConfigError(f"{what}: unknown member {name!r} (installed transports and "
                              f"tiers: {known})")
        if any(s.name == name for s in specs):
            raise ConfigError(f"{what}: member {name!r} listed twice")
        options = {k: v for k, v in item.items() if k not in ("name", "kind")}
        specs.append(MemberSpec(name, kind, options))
    if not any(s.kind == "transport" for s in specs):
        raise ConfigError(f"{where}: no transport member (only tiers: "
                          f"{', '.join(s.name for s in specs)}); add shm, nixl or mooncake, or "
                          "use the offload setting alone")
    return specs


class ComposeMetadata(msgspec.Struct, forbid_unknown_fields=True):
    """What a compose transport tells its peers: its agent name and each member's metadata."""

    v: int
    agent: str
    members: list[tuple[str, bytes]]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ComposeMetadata)


def encode_metadata(agent: str, members: list[tuple[str, bytes]]) -> bytes:
    """The envelope of ``agent``'s member metadata, in member order."""
    return _encoder.encode(ComposeMetadata(VERSION, agent, members))


def decode_metadata(blob: bytes) -> ComposeMetadata:
    """A peer's envelope, checked (version, name and member bounds), else
    :class:`MessageError`."""
    if not isinstance(blob, bytes) or not blob:
        raise MessageError("compose peer metadata is empty")
    if len(blob) > _MAX_ENVELOPE:
        raise MessageError(f"compose peer metadata is {len(blob)} bytes (at most {_MAX_ENVELOPE})")
    try:
        meta = _decoder.decode(blob)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MessageError(f"malformed compose peer metadata: {exc}") from exc
    if meta.v != VERSION:
        raise MessageError(f"compose peer metadata field 'v' is {meta.v}, expected {VERSION}")
    if not 1 <= len(meta.agent) <= 256:
        raise MessageError("compose peer metadata field 'agent' must have 1 to 256 characters")
    if not 1 <= len(meta.members) <= MAX_MEMBERS:
        raise MessageError(f"compose peer metadata field 'members' must list 1 to {MAX_MEMBERS} "
                           f"members, got {len(meta.members)}")
    names = [n for n, _ in meta.members]
    if len(set(names)) != len(names) or any(not 1 <= len(n) <= _MAX_NAME for n in names):
        raise MessageError("compose peer metadata field 'members' has a duplicate or bad name")
    if any(len(b) > _MAX_BLOB for _, b in meta.members):
        raise MessageError(f"compose peer metadata: a member blob exceeds {_MAX_BLOB} bytes")
    return meta
