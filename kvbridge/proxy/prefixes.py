"""Which prompt prefixes each engine has seen: the proxy's approximate prefix index.

The planner (:mod:`kvbridge.proxy.planner`) asks, for a request and an engine, how many of the
request's leading tokens that engine probably still holds (its prefix cache or its offload tiers),
so it can send a request whose history a decode engine holds to that engine, and skip the prefill
engine when nothing much is left to compute. No engine is asked: the index remembers what the proxy
itself sent where. It is approximate in both directions (an engine evicts what the index still
lists, and holds what another proxy sent it), which costs a worse estimate, never a wrong output:
whatever an engine really holds is found by the engine's own lookup.

A prompt is cut into *units* — :data:`UNIT_TOKENS` token ids, or :data:`UNIT_BYTES` bytes of a text
prompt or of a chat request's canonical JSON messages — and each unit is named by a chained
64-bit hash (blake2b keyed by the model name and the request's ``cache_salt``), so a unit's name
covers everything before it and two tenants' prompts never share a name: a request is never placed
by another tenant's prefix. Only whole units count; at most :data:`MAX_UNITS` per prompt are
hashed (a longer prompt is indexed by its first ones).

Bounded: each engine keeps the last ``capacity`` units it was sent (LRU). Not thread-safe: the
proxy's event loop owns it. Pure Python, no I/O.
"""

from __future__ import annotations

import collections
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_UNITS", "UNIT_BYTES", "UNIT_TOKENS", "Prompt", "PrefixIndex", "chain_tokens",
           "prompt_of", "unit_key"]

UNIT_TOKENS = 16
"""Token ids per unit of a token-id prompt (vLLM's smallest usual block size)."""
UNIT_BYTES = 64
"""Bytes per unit of a text prompt or chat request (about 16 tokens of English)."""
BYTES_PER_TOKEN = 4.0
"""The proxy has no tokenizer: a text prompt's token count is estimated as bytes / 4."""
MAX_UNITS = 8192
"""Most units hashed per prompt (131 072 tokens of token ids)."""
DEFAULT_CAPACITY = 1 << 16
"""Units remembered per engine unless told otherwise (about one million tokens)."""


@dataclass(frozen=True)
class Prompt:
    """One request's prompt as the planner sees it: its estimated token count and its chain of
    unit names (each names the prompt up to the end of its unit)."""

    tokens: float
    units: tuple[bytes, ...]
    unit_tokens: float
    """Tokens one unit stands for (:data:`UNIT_TOKENS`, or :data:`UNIT_BYTES` / 4 for text)."""
    token_ids: bool = False
    """Whether the units are of token ids (:func:`chain_tokens` names them alike): only such
    a prompt can be matched against the engines' KV events."""


def _chain(data: bytes, step: int, key: bytes) -> tuple[bytes, ...]:
    out: list[bytes] = []
    prev = b""
    for start in range(0, min(len(data) // step, MAX_UNITS) * step, step):
        prev = hashlib.blake2b(prev + data[start:start + step], digest_size=8, key=key).digest()
        out.append(prev)
    return tuple(out)


def _key(model: object, salt: object) -> bytes:
    text = json.dumps([str(model), None if salt is None else str(salt)])
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=32).digest()


def unit_key(model: str, salt: str | None) -> bytes:
    """The key that names the units of a request for ``model`` with ``cache_salt`` ``salt``
    (what :func:`prompt_of` keys a request body's units with)."""
    return _key(model, salt)


def chain_tokens(token_ids: Sequence[int], key: bytes, prev: bytes = b"") -> tuple[bytes, ...]:
    """The names of the whole :data:`UNIT_TOKENS`-token units of ``token_ids``, continuing the
    chain whose last unit is named ``prev`` (``b""``: the prompt's start), as
    :func:`prompt_of` names a token-id prompt's units: ``chain_tokens(ids[:32], k)`` then
    ``chain_tokens(ids[32:64], k, last)`` equals ``chain_tokens(ids[:64], k)``. A trailing
    part unit is not named; no :data:`MAX_UNITS` bound (the caller bounds ``token_ids``)."""
    step = UNIT_TOKENS * 8
    data = _token_ids_unbounded(token_ids)
    out: list[bytes] = []
    for start in range(0, len(data) // step * step, step):
        prev = hashlib.blake2b(prev + data[start:start + step], digest_size=8, key=key).digest()
        out.append(prev)
    return tuple(out)


def prompt_of(body: Mapping[str, Any], chat: bool) -> Prompt:
    """The :class:`Prompt` of a request body the proxy already validated
    (:func:`~kvbridge.proxy.routing.validate_request`): a string or token-id prompt (or a list
    of one), or chat ``messages``. Anything else (it cannot happen after validation) is an empty
    prompt, which the planner treats as short and cold."""
    key = _key(body.get("model"), body.get("cache_salt"))
    if chat:
        try:
            text = json.dumps(body.get("messages"), sort_keys=True, separators=(",", ":"),
                              ensure_ascii=False)
        except (TypeError, ValueError):
            return Prompt(0.0, (), UNIT_BYTES / BYTES_PER_TOKEN)
        return _text(text, key)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return _text(prompt, key)
    if isinstance(prompt, list):
        ids = _token_ids(prompt)
        return Prompt(float(len(prompt)), _chain(ids, UNIT_TOKENS * 8, key), float(UNIT_TOKENS),
                      token_ids=True)
    return Prompt(0.0, (), float(UNIT_TOKENS))


def _token_ids(prompt: Sequence[Any]) -> bytes:
    return _token_ids_unbounded(prompt[: MAX_UNITS * UNIT_TOKENS])


def _token_ids_unbounded(head: Sequence[Any]) -> bytes:
    return b"".join((t & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little") if isinstance(t, int) else
                    b"\xff" * 8 for t in head)


def _text(text: str, key: bytes) -> Prompt:
    data = text.encode("utf-8", "surrogatepass")
    return Prompt(len(data) / BYTES_PER_TOKEN, _chain(data, UNIT_BYTES, key),
                  UNIT_BYTES / BYTES_PER_TOKEN)


class PrefixIndex:
    """Per engine URL, the last ``capacity`` unit names sent to it (module docstring)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._held: dict[str, collections.OrderedDict[bytes, None]] = {}

    def held(self, url: str, prompt: Prompt) -> float:
        """Tokens of ``prompt``'s leading units the engine at ``url`` was sent (and the index
        still lists), capped at the prompt's tokens less one (vLLM always computes the last)."""
        units = self._held.get(url)
        if not units:
            return 0.0
        n = 0
        for name in prompt.units:
            if name not in units:
                break
            n += 1
        return max(0.0, min(n * prompt.unit_tokens, prompt.tokens - 1))

    def record(self, url: str, prompt: Prompt) -> None:
        """The engine at ``url`` computed or loaded ``prompt``: its units are the freshest."""
        units = self._held.setdefault(url, collections.OrderedDict())
        for name in prompt.units:
            units[name] = None
            units.move_to_end(name)
        while len(units) > self.capacity:
            units.popitem(last=False)

    def forget(self, url: str) -> None:
        """The engine left (or restarted): it holds nothing the index knows of."""
        self._held.pop(url, None)

    def size(self, url: str) -> int:
        """Units listed for ``url``."""
        return len(self._held.get(url, ()))
