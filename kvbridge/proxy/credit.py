"""KvCredit by KV credit: send a request on only when some decode engine has the KV it will need.

A decode engine (D) whose KV cache is full cannot take a hand-off: a push registration or a
pulled prompt waits for blocks that only other requests' ends can free, and under bursts of
long prompts with long outputs every D can end up holding KV for requests that cannot grow —
vLLM then preempts and recomputes, or, with hand-offs pinned on both sides, waits. The proxy
prevents that by construction: it admits a request only when one D has *credit* for all of it.

- A D's **capacity** is its KV cache in blocks (``num_gpu_blocks`` and ``block_size`` of vLLM's
  ``vllm:cache_config_info`` on its ``/metrics``) and its ``max_model_len`` (``/v1/models``), read
  by :meth:`kvbridge.proxy.pool.Fleet.learn_capacity` when the proxy starts, when an engine joins
  and when one comes back into rotation; times ``kv_credit_fraction`` (1/N when N proxies share
  the engines). A D whose capacity is unknown (no such series: not vLLM) is never limited.
- A request **needs** the blocks of its prompt plus ``max_tokens`` (vLLM's default when absent:
  the rest of ``max_model_len``), capped at ``max_model_len``: the most it can ever hold, so an
  admitted request never waits for KV another admitted request holds. The prompt is counted in
  tokens when it is token ids, else in UTF-8 bytes (no tokenizer here: a token is at least one
  byte for byte-level tokenizers), plus 16 per chat message for the template.
- A D's **credit** is its capacity minus what its admitted requests need (:class:`Reservation`).
  A request is admitted on the D with the most credit that fits it (a pull may later be placed on
  another that fits: :meth:`Reservation.move`), and its reservation is released when the client's
  request ends, however it ends.
- When none fits, ``kv_admission`` says what happens: ``reject`` — 503 with ``Retry-After``
  (``type`` ``no_kv_credit``); ``queue`` — wait (every release wakes the waiters to re-check), at
  most ``kv_queue`` requests for at most ``kv_queue_s`` each, then the same 503. A request that
  needs more than any D's whole capacity is admitted alone on an idle D (never refused for what
  vLLM itself would serve). ``off`` (the default) admits everything.

Contract: used from the proxy's one event loop; not thread-safe. :meth:`KvCredit.admit` is the
only coroutine; it never holds a reservation on exit unless it returned it.
"""

from __future__ import annotations

import asyncio
import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.proxy.members import Engine, Pool

__all__ = ["KvCredit", "KvAdmission", "Capacity", "NoCredit", "Reservation", "need_tokens",
           "read_capacity"]

CHAT_MESSAGE_TOKENS = 16
"""Tokens counted per chat message for its template (role markers, separators)."""


class KvAdmission(enum.StrEnum):
    OFF = "off"
    REJECT = "reject"
    QUEUE = "queue"


@dataclass(frozen=True)
class Capacity:
    """A decode engine's KV cache as the proxy may commit it."""

    blocks: int
    block_size: int
    max_model_len: int

    def blocks_for(self, tokens: int) -> int:
        tokens = min(max(tokens, 1), self.max_model_len)
        return min(self.blocks, math.ceil(tokens / self.block_size))


def _prompt_tokens(body: Mapping[str, Any]) -> int:
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if prompt and isinstance(prompt[0], list):  # one token-id prompt in a list
            prompt = prompt[0]
        if all(isinstance(t, int) for t in prompt):
            return len(prompt)
        prompt = prompt[0] if len(prompt) == 1 else " ".join(map(str, prompt))
    if isinstance(prompt, str):
        return len(prompt.encode("utf-8", "replace"))
    total = 0
    for message in body.get("messages") or ():
        if isinstance(message, Mapping):
            content = message.get("content")
            text = content if isinstance(content, str) else str(content or "")
            total += len(text.encode("utf-8", "replace")) + CHAT_MESSAGE_TOKENS
    return total


def need_tokens(body: Mapping[str, Any], max_model_len: int) -> int:
    """The most tokens of KV ``body`` can hold: its prompt and every token it may generate."""
    prompt = _prompt_tokens(body)
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    out = limit if isinstance(limit, int) and limit > 0 else max_model_len - prompt
    return min(max_model_len, prompt + max(out, 0))


def read_capacity(metrics: str, models: Any) -> Capacity | None:
    """A vLLM engine's KV capacity from its ``/metrics`` text (``vllm:cache_config_info``'s
    ``num_gpu_blocks`` and ``block_size`` labels) and ``/v1/models`` answer (``max_model_len``);
    None when either is missing or malformed. Never raises."""
    # imported here: settings import this module, and the pure parts need no proxy extra
    from prometheus_client.parser import text_string_to_metric_families

    blocks = size = 0
    try:
        for family in text_string_to_metric_families(metrics):
            if family.name not in ("vllm:cache_config_info", "vllm:cache_config"):
                continue
            for sample in family.samples:
                blocks = max(blocks, int(sample.labels.get("num_gpu_blocks") or 0))
                size = size or int(sample.labels.get("block_size") or 0)
        data = models.get("data") if isinstance(models, Mapping) else None
        first = data[0] if isinstance(data, list) and data else {}
        max_len = int(first.get("max_model_len") or 0) if isinstance(first, Mapping) else 0
    except (ValueError, TypeError, AttributeError):
        return None
    if blocks <= 0 or size <= 0 or max_len <= 0:
        return None
    return Capacity(blocks, size, max_len)


class NoCredit(Exception):
    """No decode engine has KV credit for the request (within the queue's bound)."""


@dataclass
class Reservation:
    """A request's claim on one D's credit, from admission until the request ends."""

    engine: Engine | None
    tokens: int
    blocks: int = 0
    _admission: KvCredit | None = None

    def move(self, engine: Engine) -> None:
        """The request went to ``engine`` (a pull's late placement, a retry): the claim follows."""
        if self._admission is not None and engine is not self.engine:
            self._admission._move(self, engine)

    def release(self) -> None:
        """The request ended; idempotent."""
        if self._admission is not None:
            self._admission._release(self)


class KvCredit:
    """KV credit of one proxy's decode engines (see the module docstring)."""

    def __init__(self, decodes: Pool, mode: KvAdmission, fraction: float = 1.0,
                 queue: int = 64, queue_s: float = 30.0) -> None:
        if not 0 < fraction <= 16:
            raise ConfigError(f"--kv-credit-fraction must be in (0, 16], got {fraction}")
        if queue < 0 or queue_s < 0:
            raise ConfigError("--kv-queue and --kv-queue-s must be >= 0")
        self.decodes = decodes
        self.mode = mode
        self.fraction = fraction
        self.queue = queue
        self.queue_s = queue_s
        self.capacity: dict[str, Capacity] = {}
        self.reserved: dict[str, int] = {}
        self._waiting = 0
        self._freed = asyncio.Event()

    # ---------------------------------------------------------------- capacity

    def set_capacity(self, url: str, capacity: Capacity | None) -> None:
        """What :meth:`Fleet.learn_capacity` read of the D at ``url`` (None: unknown)."""
        if capacity is None:
            self.capacity.pop(url, None)
        else:
            blocks = max(1, int(capacity.blocks * self.fraction))
            self.capacity[url] = Capacity(blocks, capacity.block_size, capacity.max_model_len)
        self._wake()

    def _wake(self) -> None:
        """Wake every waiter (each re-checks; the next waiters wait on a new event)."""
        freed, self._freed = self._freed, asyncio.Event()
        freed.set()

    def credit(self, e: Engine) -> int | None:
        """Blocks ``e`` may still be given (None: unlimited, its capacity is unknown)."""
        cap = self.capacity.get(e.url)
        return None if cap is None else cap.blocks - self.reserved.get(e.url, 0)

    def _blocks(self, e: Engine, tokens: int) -> int:
        cap = self.capacity.get(e.url)
        return 0 if cap is None else cap.blocks_for(tokens)

    def fits(self, e: Engine, r: Reservation | None = None) -> bool:
        """Whether ``e`` has credit for ``r`` (its own claim on ``e`` counted as free)."""
        credit = self.credit(e)
        if credit is None or r is None:
            return True
        own = r.blocks if r.engine is e else 0
        need = self._blocks(e, r.tokens)
        # a request bigger than the whole engine goes alone, on an idle one
        return need <= credit + own or self.reserved.get(e.url, 0) == own

    # ---------------------------------------------------------------- admission

    def _candidates(self, r: Reservation) -> Sequence[Engine]:
        return [e for e in self.decodes.engines
                if e.accepting and e.is_up() and self.fits(e, r)]

    def _take(self, r: Reservation) -> bool:
        found = self._candidates(r)
        if not found:
            return False
        best = max(found, key=lambda e: (self.credit(e) is None, self.credit(e) or 0,
                                         -e.in_flight))
        self._claim(r, best)
        return True

    async def admit(self, body: Mapping[str, Any]) -> Reservation:
        """A reservation for ``body`` on the D with most credit; waits or raises
        :class:`NoCredit` per ``mode`` when none fits."""
        if self.mode is KvAdmission.OFF or not self.capacity:
            return Reservation(None, 0)
        max_len = max(c.max_model_len for c in self.capacity.values())
        r = Reservation(None, need_tokens(body, max_len), _admission=self)
        if self._take(r):
            return r
        if self.mode is KvAdmission.REJECT or self._waiting >= self.queue:
            raise NoCredit(self._why(r, queued=False))
        self._waiting += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.queue_s
        try:
            while True:
                freed = self._freed  # taken before the check: no release is missed
                if self._take(r):
                    return r
                left = deadline - loop.time()
                if left <= 0:
                    raise NoCredit(self._why(r, queued=True))
                try:
                    await asyncio.wait_for(freed.wait(), min(left, 1.0))
                except TimeoutError:
                    pass  # re-check: an engine may have come back into rotation
        finally:
            self._waiting -= 1

    def _why(self, r: Reservation, queued: bool) -> str:
        best = max((c for e in self.decodes.engines if (c := self.credit(e)) is not None),
                   default=0)
        waited = f" after waiting {self.queue_s:g}s" if queued else ""
        return (f"no decode engine has KV for this request{waited}: it may hold {r.tokens} "
                f"tokens; the most any engine has free is {best} blocks")

    # ---------------------------------------------------------------- book-keeping

    def _claim(self, r: Reservation, e: Engine) -> None:
        r.engine = e
        r.blocks = self._blocks(e, r.tokens)
        self.reserved[e.url] = self.reserved.get(e.url, 0) + r.blocks

    def _unclaim(self, r: Reservation) -> None:
        if r.engine is not None:
            left = self.reserved.get(r.engine.url, 0) - r.blocks
            if left > 0:
                self.reserved[r.engine.url] = left
            else:
                self.reserved.pop(r.engine.url, None)
        r.engine, r.blocks = None, 0

    def _move(self, r: Reservation, e: Engine) -> None:
        self._unclaim(r)
        self._claim(r, e)
        self._wake()

    def _release(self, r: Reservation) -> None:
        self._unclaim(r)
        r._admission = None
        self._wake()

    def queued(self) -> int:
        """Requests waiting for credit now."""
        return self._waiting
