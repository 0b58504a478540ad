"""The seeded mixed workload of ``kvbridge bench mix``: one trace, replayed under every policy.

Contract: :func:`generate_trace` is pure (no I/O, no clock, no global random state): the same
arguments always give the same :class:`MixTrace`, request for request (token ids, class,
``max_tokens``, arrival offset). Prompts are token ids of the tiny model
(:data:`~kvbridge.tools.tiny_model.VOCAB_SIZE`, special ids left out) for a streamed, greedy
``/v1/completions``; nothing depends on what an engine answers, so every policy, and every rate,
replays the very same prompts. Each request is tagged with its class:

============  ==================================================================================
``short``     a cold prompt of 16–48 tokens
``long``      a cold prompt of 400–900 tokens
``chat``      one turn of a multi-turn conversation: turn k's prompt is turn k-1's prompt, then a
              fixed stand-in for turn k-1's reply (``max_tokens`` ids that depend only on the
              conversation and the turn), then 16–48 new user tokens; a conversation whose next
              turn would pass the length bound ends, and a new one starts
``system``    the one shared ~300-token system prompt, then a unique 8–32-token tail
``warm_d``    the whole prompt of one of the last :data:`WARM_WINDOW` earlier requests (of another
              class), then an 8–32-token new tail: a prefix D saw shortly before
``disk``      a prefix of :data:`DISK_PREFIX_LEN` tokens that D holds only in its disk tier, then
              an 8–32-token tail: every ``disk`` request has a prefix of its own
              (``tier_prefix`` tokens, :meth:`MixTrace.tier_prefixes`), which the replay puts
              into D's tier before the run and drops from vLLM's own prefix cache; generated
              only with a share (``kvbridge bench mix --disk-tier``), from a random stream of
              its own, so a trace without it is the same as before the class existed
============  ==================================================================================

Arrival offsets are a Poisson process: exponential gaps of mean 1 drawn from the seed, divided
by the rate; the classes come in exactly their shares (:func:`class_counts`) in a seeded
random order. So the same seed at another rate gives the same prompts in the same order, spaced
further apart or closer. Every prompt plus its ``max_tokens`` fits ``max_model_len``. Bad
arguments raise :class:`~kvbridge.errors.ConfigError` naming the command-line flag.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvbridge.errors import ConfigError
from kvbridge.tools.tiny_model import NUM_SPECIAL_TOKENS, VOCAB_SIZE

__all__ = ["CLASSES", "DEFAULT_SHARES", "DISK_PREFIX_LEN", "DISK_SHARES", "MAX_MODEL_LEN",
           "WARM_WINDOW", "MixRequest", "MixTrace", "class_counts", "generate_trace",
           "parse_shares"]

CLASSES: tuple[str, ...] = ("short", "long", "chat", "system", "warm_d", "disk")
DEFAULT_SHARES: Mapping[str, float] = {"short": 0.25, "long": 0.15, "chat": 0.25,
                                       "system": 0.20, "warm_d": 0.15}
DISK_SHARES: Mapping[str, float] = {**{k: 0.7 * v for k, v in DEFAULT_SHARES.items()},
                                    "disk": 0.3}
"""The shares with a disk tier (``--disk-tier`` without ``--shares``): 30 % ``disk``."""
DISK_PREFIX_LEN = 256
"""A ``disk`` request's prefix in D's tier: 8 whole blocks of 32 tokens (16 of the proxy's
16-token units)."""
MAX_MODEL_LEN = 1024
"""The engines' ``--max-model-len`` (:data:`kvbridge.tools.engines.BASE_ARGS`)."""
WARM_WINDOW = 8
"""A ``warm_d`` request repeats the prompt of one of this many latest requests."""

SHORT_LEN = (16, 48)
LONG_LEN = (400, 900)
SYSTEM_LEN = 300
TAIL_LEN = (8, 32)
CHAT_FIRST_LEN = (48, 128)
CHAT_USER_LEN = (16, 48)
CHAT_MAX_LEN = 900
"""A conversation's prompt never passes this many tokens."""
MAX_CONVERSATIONS = 4
"""Conversations open at once; a chat request continues one of them or opens another."""


@dataclass(frozen=True)
class MixRequest:
    """One request of the trace: ``prompt`` token ids, ``arrival_s`` after the replay starts."""

    index: int
    klass: str
    arrival_s: float
    prompt: tuple[int, ...]
    max_tokens: int
    conversation: int | None = None
    """chat: the conversation's number; its turn is ``turn`` (0 first)."""
    turn: int | None = None
    prefix_of: int | None = None
    """warm_d: the index of the earlier request whose prompt this one starts with."""
    tier_prefix: int = 0
    """disk: the first this many prompt tokens are put into D's disk tier before the replay."""


@dataclass(frozen=True)
class MixTrace:
    """The requests in arrival order, and what made them."""

    seed: int
    rate: float
    requests: tuple[MixRequest, ...]
    shares: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_SHARES))

    def counts(self) -> dict[str, int]:
        """Requests per class, in :data:`CLASSES` order (classes with none left out)."""
        c = Counter(r.klass for r in self.requests)
        return {k: c[k] for k in CLASSES if c[k]}

    def tier_prefixes(self) -> list[tuple[int, tuple[int, ...]]]:
        """(index, prefix) of every request whose prefix D's tier must hold before the replay."""
        return [(r.index, r.prompt[: r.tier_prefix]) for r in self.requests if r.tier_prefix]

    @property
    def duration_s(self) -> float:
        """The last arrival offset (0 for an empty trace)."""
        return self.requests[-1].arrival_s if self.requests else 0.0


def parse_shares(text: str) -> dict[str, float]:
    """``short=0.3,long=0.2,...`` (classes left out get 0) into normalised shares; ConfigError
    naming ``--shares`` for an unknown class, a bad number, a negative share or all zero."""
    raw: dict[str, float] = {k: 0.0 for k in CLASSES}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, num = part.partition("=")
        name = name.strip()
        if not sep or name not in raw:
            raise ConfigError(f"--shares: {part!r} is not CLASS=SHARE with CLASS one of "
                              f"{', '.join(CLASSES)}")
        try:
            raw[name] = float(num)
        except ValueError:
            raise ConfigError(f"--shares: {num.strip()!r} is not a number ({name})") from None
    return _normalised(raw)


def _normalised(shares: Mapping[str, float]) -> dict[str, float]:
    unknown = sorted(set(shares) - set(CLASSES))
    if unknown:
        raise ConfigError(f"--shares: unknown class(es) {', '.join(unknown)}; classes: "
                          f"{', '.join(CLASSES)}")
    if any(not v >= 0 for v in shares.values()):  # also NaN
        raise ConfigError("--shares: every share must be >= 0")
    total = sum(shares.values())
    if not total > 0 or total == float("inf"):
        raise ConfigError("--shares: the shares must add up to a positive number")
    return {k: float(shares.get(k, 0.0)) / total for k in CLASSES}


def _tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(NUM_SPECIAL_TOKENS, vocab_size) for _ in range(n)]


def _reply_stand_in(conversation: int, turn: int, n: int, vocab_size: int) -> list[int]:
    """The fixed ids that stand for turn ``turn``'s reply: no random state, no model output."""
    span = vocab_size - NUM_SPECIAL_TOKENS
    return [NUM_SPECIAL_TOKENS + (conversation * 131 + turn * 17 + j * 7) % span
            for j in range(n)]


class _Builder:
    """The state of one trace being drawn: open conversations, the latest prompts."""

    def __init__(self, rng: random.Random, vocab_size: int, max_tokens: tuple[int, int],
                 max_model_len: int, disk_rng: random.Random) -> None:
        self.rng = rng
        self.disk_rng = disk_rng
        self.vocab = vocab_size
        self.max_tokens = max_tokens
        self.limit = max_model_len - max_tokens[1]
        self.system = _tokens(rng, SYSTEM_LEN, vocab_size)
        self.open: list[tuple[int, int, list[int], int]] = []  # (conv, turn, prompt, max_tokens)
        self.conversations = 0
        self.recent: list[tuple[int, tuple[int, ...]]] = []  # (index, prompt), non-warm_d

    def _n(self, bounds: tuple[int, int]) -> int:
        return self.rng.randint(*bounds)

    def request(self, index: int, klass: str, arrival: float) -> MixRequest:
        if klass == "disk":  # its own random stream: the other classes' draws stay as they were
            mt = self.disk_rng.randint(*self.max_tokens)
            prompt = (_tokens(self.disk_rng, DISK_PREFIX_LEN, self.vocab)
                      + _tokens(self.disk_rng, self.disk_rng.randint(*TAIL_LEN), self.vocab))
            return MixRequest(index, klass, arrival, tuple(prompt), mt,
                              tier_prefix=DISK_PREFIX_LEN)
        mt = self._n(self.max_tokens)
        conv = turn = prefix_of = None
        if klass == "short":
            prompt = _tokens(self.rng, self._n(SHORT_LEN), self.vocab)
        elif klass == "long":
            prompt = _tokens(self.rng, min(self._n(LONG_LEN), self.limit), self.vocab)
        elif klass == "system":
            prompt = self.system + _tokens(self.rng, self._n(TAIL_LEN), self.vocab)
        elif klass == "chat":
            conv, turn, prompt = self._chat_turn(mt)
        else:  # warm_d
            prefix_of, prefix = self.rng.choice(self.recent[-WARM_WINDOW:])
            tail = _tokens(self.rng, self._n(TAIL_LEN), self.vocab)
            prompt = (list(prefix) + tail)[: self.limit]
        if klass != "warm_d":
            self.recent.append((index, tuple(prompt)))
        return MixRequest(index, klass, arrival, tuple(prompt), mt, conv, turn, prefix_of)

    def _chat_turn(self, mt: int) -> tuple[int, int, list[int]]:
        if self.open and (len(self.open) >= MAX_CONVERSATIONS or self.rng.random() < 0.7):
            slot = self.rng.randrange(len(self.open))
            conv, turn, prev, prev_mt = self.open[slot]
            prompt = (prev + _reply_stand_in(conv, turn, prev_mt, self.vocab)
                      + _tokens(self.rng, self._n(CHAT_USER_LEN), self.vocab))
            if len(prompt) <= min(CHAT_MAX_LEN, self.limit):
                self.open[slot] = (conv, turn + 1, prompt, mt)
                return conv, turn + 1, prompt
            del self.open[slot]  # the conversation is over: start another
        conv = self.conversations
        self.conversations += 1
        prompt = _tokens(self.rng, self._n(CHAT_FIRST_LEN), self.vocab)
        self.open.append((conv, 0, prompt, mt))
        if len(self.open) > MAX_CONVERSATIONS:
            self.open.pop(0)
        return conv, 0, prompt


def generate_trace(num_requests: int, rate: float, seed: int, *,
                   shares: Mapping[str, float] | None = None,
                   max_tokens: tuple[int, int] = (8, 16), vocab_size: int = VOCAB_SIZE,
                   max_model_len: int = MAX_MODEL_LEN) -> MixTrace:
    """The trace of ``num_requests`` requests at ``rate`` req/s from ``seed`` (module docstring).

    ``shares``: each class's expected share (normalised; default :data:`DEFAULT_SHARES`);
    ``max_tokens``: each request's ``max_tokens`` is drawn from this closed range. Each class
    gets :func:`class_counts` requests, in seeded random order; the first request is never
    ``warm_d`` (it has nothing to repeat).
    """
    if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 1:
        raise ConfigError(f"--num-requests must be an integer >= 1, got {num_requests!r}")
    if not rate > 0 or rate == float("inf"):
        raise ConfigError(f"--rates: a rate must be a positive number of req/s, got {rate!r}")
    lo, hi = max_tokens
    if not 2 <= lo <= hi <= 256:
        raise ConfigError(f"--max-tokens: need 2 <= low <= high <= 256, got {lo}..{hi}")
    if max_model_len - hi < SYSTEM_LEN + TAIL_LEN[1] + 64:
        raise ConfigError(f"--max-tokens: {hi} leaves too little of max_model_len "
                          f"{max_model_len} for the prompts")
    if not NUM_SPECIAL_TOKENS < vocab_size:
        raise ConfigError(f"vocab_size {vocab_size} leaves no ordinary token ids")
    norm = _normalised(DEFAULT_SHARES if shares is None else shares)
    rng = random.Random(seed)
    arrivals = random.Random(seed * 7919 + 1)  # the gaps apart: shares do not move arrivals
    builder = _Builder(rng, vocab_size, (lo, hi), max_model_len,
                       random.Random(seed * 104_729 + 7))
    if {k for k in CLASSES if norm[k] > 0} - {"disk"} == {"warm_d"}:
        raise ConfigError("--shares: warm_d alone has nothing to repeat (disk prompts are not "
                          "repeated); give another class a share")
    order = class_counts(num_requests, norm)
    classes = [k for k in CLASSES for _ in range(order[k])]
    rng.shuffle(classes)
    first = next((i for i, k in enumerate(classes) if k not in ("warm_d", "disk")), 0)
    classes[0], classes[first] = classes[first], classes[0]
    out: list[MixRequest] = []
    t = 0.0
    for i, klass in enumerate(classes):
        if i:
            t += arrivals.expovariate(1.0) / rate
        out.append(builder.request(i, klass, t))
    return MixTrace(seed, float(rate), tuple(out), norm)


def class_counts(num_requests: int, shares: Mapping[str, float]) -> dict[str, int]:
    """Requests per class: ``share x num_requests`` rounded by largest remainder (ties in
    :data:`CLASSES` order), so the counts add up to ``num_requests``; a class with a share
    gets at least one request while there are enough to go round, and a warm_d request always
    has something earlier to repeat (another class gets one when needed)."""
    exact = {k: shares.get(k, 0.0) * num_requests for k in CLASSES}
    counts = {k: int(v) for k, v in exact.items()}
    rest = sorted(CLASSES, key=lambda k: (-(exact[k] - counts[k]), CLASSES.index(k)))
    for k in rest[: num_requests - sum(counts.values())]:
        counts[k] += 1
    for k in CLASSES:  # a class with a share but no request takes one from the largest
        big = max(CLASSES, key=lambda c: counts[c])
        if shares.get(k, 0.0) > 0 and counts[k] == 0 and counts[big] > 1:
            counts[big] -= 1
            counts[k] += 1
    if counts["warm_d"] == num_requests:  # only possible with one request
        other = max((k for k in CLASSES if k != "warm_d"), key=lambda c: shares.get(c, 0.0))
        counts["warm_d"] -= 1
        counts[other] += 1
    return counts

