"""Routing policy of the disaggregation proxy: which engine, which mode, which parameters.

Everything here is plain Python over plain data (no HTTP, no I/O, no transports), so the policy is
tested as pure functions. :mod:`kvbridge.proxy.dispatch` (and the rest of the proxy) calls it
from one asyncio event loop; nothing here is thread-safe and nothing needs to be, because the
loop never awaits between a pick and the matching :meth:`Engine.acquire`, so two requests cannot
both see the same free engine.

Every ``kv_transfer_params`` the proxy sends is built by :mod:`kvbridge.params` and every one it
receives (a probe answer, a P answer) is parsed by :func:`kvbridge.params.parse`: a malformed
answer raises :class:`~kvbridge.errors.ParamsError` naming the key (docs/proxy.md).

- pull: P gets a one-token copy with ``do_remote_decode``; the least-loaded D is picked *after*
  prefill and gets P's returned params as P gave them, once parsed and checked.
- push: D is picked *first*; P and D are dispatched concurrently with one ``transfer_id``; D's
  params name P's control address, learnt beforehand by a probe (:func:`probe_body`).
- auto (``plan`` is its other name): the planner (:mod:`kvbridge.proxy.planner`) chooses local,
  push or pull per request.
- headroom: push when some D has headroom (in-flight below ``push_headroom``), else pull (what
  ``auto`` was before the planner).
- local: D alone, no P: the request goes to a D without ``kv_transfer_params``.
- any request may name its own mode in the ``X-KVBridge-Mode`` header (:func:`requested_mode`);
- any request may ask the engines to keep no flight record of its hand-off in the
  ``X-KVBridge-Record`` header (:func:`requested_record`).
- fleets (xPyD): every role is a :class:`Pool`; picks skip engines out of rotation
  (:meth:`Engine.mark_down`, health checks) and, for a retry, engines the request already
  tried. :func:`plan_retry` says whether and how a failed dispatch is retried.

One client request is one hand-off: a batched ``prompt`` or ``n > 1`` would make vLLM run several
requests under one ``transfer_id``, so :func:`validate_request` refuses them (HTTP 400 naming the
field), as it refuses a client-supplied ``kv_transfer_params`` (the proxy owns them).
"""

from __future__ import annotations

import copy
import enum
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvbridge import params
from kvbridge.config import TransferMode
from kvbridge.errors import ParamsError
from kvbridge.params import TransferParams
from kvbridge.proxy.members import (
    Engine,
    Pool,
    ProbeInfo,
    Role,
    control_addresses,
    normalize_url,
)

__all__ = [
    "Role",
    "ProxyMode",
    "MODE_HEADER",
    "requested_mode",
    "RECORD_HEADER",
    "requested_record",
    "ProbeInfo",
    "Engine",
    "Pool",
    "Decision",
    "Cause",
    "Retry",
    "RequestProblem",
    "PrefillRefused",
    "decide",
    "plan_retry",
    "RETRYABLE",
    "new_transfer_id",
    "prefill_body",
    "decode_body",
    "push_decode_params",
    "pull_decode_params",
    "probe_body",
    "parse_probe",
    "read_prefill_answer",
    "validate_request",
    "PROBE_KEYS",
    "control_addresses",
    "normalize_url",
]

PROBE_KEYS = ("remote_engine_id", "remote_host", "remote_port")
"""Keys a probe answer must carry; they are what D needs to reach P in push mode."""


class ProxyMode(enum.StrEnum):
    """How the proxy serves a request: ``pull`` or ``push`` (a hand-off in that mode), ``auto``
    (the planner chooses local, push or pull per request, :mod:`kvbridge.proxy.planner`),
    ``headroom`` (push or pull by the decode engines' load: :func:`decide`) or ``local`` (D
    alone: no P, no hand-off).

    ``plan`` is another name of ``auto``: ``ProxyMode("plan")`` and ``ProxyMode.PLAN`` are
    :attr:`AUTO`, so a ``--mode plan`` proxy and an ``X-KVBridge-Mode: plan`` request are the
    planner's and counted as ``configured="auto"``."""

    PULL = "pull"
    PUSH = "push"
    AUTO = "auto"
    HEADROOM = "headroom"
    LOCAL = "local"
    PLAN = "auto"  # an alias: the planner's name before it became auto

    @classmethod
    def _missing_(cls, value: object) -> ProxyMode | None:
        return cls.AUTO if value == "plan" else None

    @classmethod
    def names(cls) -> list[str]:
        """Every value ``--mode`` and :data:`MODE_HEADER` accept, ``plan`` included."""
        return [m.value for m in cls] + ["plan"]

    @property
    def transfer(self) -> TransferMode:
        """The connector's mode of a hand-off in this mode (pull or push)."""
        if self not in (ProxyMode.PULL, ProxyMode.PUSH):
            raise ValueError(f"a hand-off is pull or push, not {self.value}")
        return TransferMode(self.value)


#: The value of the per-request header that overrides the proxy's ``--mode``.
MODE_HEADER = "X-KVBridge-Mode"


def requested_mode(headers: Mapping[str, str]) -> ProxyMode | None:
    """The mode a request asks for in :data:`MODE_HEADER` (None: the proxy's ``--mode``); a value
    that is not a mode raises :class:`ValueError` naming the header and the modes."""
    raw = headers.get(MODE_HEADER)
    if raw is None:
        return None
    try:
        return ProxyMode(raw.strip().lower())
    except ValueError:
        raise ValueError(f"{MODE_HEADER} must be one of "
                         f"{', '.join(ProxyMode.names())}, got {raw[:40]!r}") from None


#: The per-request header that can leave a hand-off out of the engines' flight records.
RECORD_HEADER = "X-KVBridge-Record"
_RECORD_VALUES = {"1": True, "true": True, "yes": True, "on": True,
                  "0": False, "false": False, "no": False, "off": False}


def requested_record(headers: Mapping[str, str]) -> bool:
    """Whether the engines record the request's hand-off (:data:`RECORD_HEADER`; absent: yes);
    a value that is not a boolean raises :class:`ValueError` naming the header."""
    raw = headers.get(RECORD_HEADER)
    if raw is None:
        return True
    value = _RECORD_VALUES.get(raw.strip().lower())
    if value is None:
        raise ValueError(f"{RECORD_HEADER} must be 0 or 1 (or true, false, yes, no, on, off), "
                         f"got {raw[:40]!r}")
    return value


@dataclass(frozen=True)
class Decision:
    """The mode chosen for one request and why (the reason is a metric label)."""

    mode: ProxyMode
    reason: str = field(default="configured")


def decide(mode: ProxyMode, decodes: Pool, push_headroom: int) -> Decision:
    """Choose push, pull or local for one request (``auto`` is the planner's: not here).

    ``push``, ``pull`` and ``local`` are returned as configured. ``headroom`` pushes when the
    least-loaded D has fewer than ``push_headroom`` requests in flight (committing D early costs
    nothing when D is idle, and push takes coordination off the critical path); when every D is
    that busy it pulls, because placing the request on whichever D frees up first after prefill
    then pays.
    """
    if mode is ProxyMode.PUSH:
        return Decision(ProxyMode.PUSH)
    if mode is ProxyMode.PULL:
        return Decision(ProxyMode.PULL)
    if mode is ProxyMode.LOCAL:
        return Decision(ProxyMode.LOCAL)
    if mode is ProxyMode.AUTO:
        raise ValueError("auto mode is decided by the planner (kvbridge.proxy.planner)")
    if decodes.least_in_flight() < push_headroom:
        return Decision(ProxyMode.PUSH, "headroom")
    return Decision(ProxyMode.PULL, "busy")


class Cause(enum.StrEnum):
    """How one leg of a dispatch failed, as the retry policy sees it."""

    UNREACHABLE = "unreachable"
    """No connection was made: the engine never saw the request."""
    BROKEN = "broken"
    """The connection broke (reset, closed) before the answer was complete: the engine may
    have died, and may have acted on the request."""
    SERVER_ERROR = "server_error"
    """The engine answered 5xx."""
    TIMEOUT = "timeout"
    """No answer within the proxy's bound (``--timeout``): the bound is spent."""
    REFUSED = "refused"
    """The engine refused the request itself (4xx, ``kvbridge_error``)."""
    MALFORMED = "malformed"
    """The engine answered something that does not parse (a bug or a forged answer)."""


#: Causes a retry can cure: the engine, not the request, was the problem.
RETRYABLE: frozenset[Cause] = frozenset({Cause.UNREACHABLE, Cause.BROKEN, Cause.SERVER_ERROR})


@dataclass(frozen=True)
class Retry:
    """How a failed dispatch is tried again; ``reason`` is the ``retries_total`` label."""

    reason: str
    reuse_prefill: bool = False
    """pull: send P's answer to another D, with the same transfer_id (the failed D never saw
    it, so P's lease is unclaimed); otherwise a fresh dispatch with a fresh transfer_id."""


def plan_retry(mode: ProxyMode, role: Role, cause: Cause, *, retries: int, max_retries: int,
               other_prefill: bool, other_decode: bool) -> Retry | None:
    """Whether a dispatch in ``mode`` whose ``role`` leg failed with ``cause`` before any byte
    reached the client is retried, and how (None: the client gets the error).

    ``retries`` were made already, at most ``max_retries``. ``other_prefill`` /
    ``other_decode``: whether an in-rotation engine of that role is left that this request has
    not tried. A retry is made only for a cause the engine is to blame for
    (:data:`RETRYABLE`) and only where another engine can take it:

    - a P leg failed (push: the D leg was aborted with it): a fresh dispatch on another P;
    - pull, D unreachable: P's answer goes to another D (no second prefill, same transfer_id);
    - D failed after it got the request (a 5xx, a broken answer; D may have claimed P's
      lease, or P may have died under D's READ): a fresh dispatch on engines not tried yet,
      either role (P may be the one to blame).
    """
    if mode in (ProxyMode.AUTO, ProxyMode.HEADROOM):
        raise ValueError("plan_retry needs the concrete mode of the failed dispatch")
    if retries >= max_retries or cause not in RETRYABLE:
        return None
    if mode is ProxyMode.LOCAL:  # D alone: another D, if there is one
        return Retry("decode_failed") if other_decode else None
    if role is Role.PREFILL:
        return Retry("prefill_failed") if other_prefill else None
    if mode is ProxyMode.PULL and cause is Cause.UNREACHABLE:
        return Retry("decode_unreachable", reuse_prefill=True) if other_decode else None
    return Retry("decode_failed") if other_decode or other_prefill else None


def new_transfer_id() -> str:
    """A fresh transfer id; one per dispatch, also on retries."""
    return "xfer-" + uuid.uuid4().hex


@dataclass(frozen=True)
class RequestProblem:
    """Why a client request cannot be served: an OpenAI ``invalid_request_error``."""

    message: str
    param: str | None = None


def _is_token_ids(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _prompt_problem(prompt: object) -> RequestProblem | None:
    """One prompt: a string, token ids, or a one-element list of either. A batch is refused."""
    if isinstance(prompt, str) or _is_token_ids(prompt):
        return None
    if not isinstance(prompt, list):
        return RequestProblem("'prompt' must be a string or a list", "prompt")
    if all(isinstance(p, str) for p in prompt) or all(_is_token_ids(p) for p in prompt):
        if len(prompt) == 1:
            return None
        return RequestProblem(
            f"'prompt' is a batch of {len(prompt)} prompts; a disaggregated request carries one "
            "prompt (one KV hand-off): send one request per prompt",
            "prompt",
        )
    return RequestProblem(
        "'prompt' must be a string, a list of token ids, or a one-element list of those",
        "prompt",
    )


def validate_request(body: Any, chat: bool) -> RequestProblem | None:
    """Why an OpenAI request body cannot be served by the proxy, or None when it can."""
    if not isinstance(body, dict):
        return RequestProblem("request body must be a JSON object")
    key = "messages" if chat else "prompt"
    if key not in body or body[key] is None:
        return RequestProblem(f"missing required field {key!r}", key)
    if chat and not isinstance(body[key], list):
        return RequestProblem("'messages' must be a list", key)
    if not chat:
        problem = _prompt_problem(body[key])
        if problem is not None:
            return problem
    for name in ("max_tokens", "max_completion_tokens", "n"):
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            return RequestProblem(f"{name!r} must be an integer", name)
    n = body.get("n")
    if n is not None and n > 1:
        return RequestProblem(
            f"'n' is {n}; a disaggregated request samples one sequence (one KV hand-off): "
            "send n requests",
            "n",
        )
    if body.get("kv_transfer_params") is not None:
        return RequestProblem(
            "'kv_transfer_params' is set by the proxy; remove it from the request",
            "kv_transfer_params",
        )
    return None


def prefill_body(body: Mapping[str, Any], transfer_id: str, mode: ProxyMode) -> dict[str, Any]:
    """The one-token, non-streaming copy of ``body`` that P prefills (the original is untouched)."""
    transfer = mode.transfer  # a ValueError for auto, headroom or local
    out = copy.deepcopy(dict(body))
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out.pop("min_tokens", None)
    out.pop("min_completion_tokens", None)
    out["kv_transfer_params"] = params.prefill_request(transfer_id, transfer)
    return out


def push_decode_params(probe: ProbeInfo, transfer_id: str, tiers: bool = True
                       ) -> dict[str, Any]:
    """D's ``kv_transfer_params`` in push mode: where P is, and the shared transfer id
    (``tiers=False``: D's offload tiers serve nothing of it, ``kvbridge_tiers``)."""
    out = params.push_decode_request(probe.params, transfer_id)
    if not tiers:
        out["kvbridge_tiers"] = False
    return out


def pull_decode_params(answer: TransferParams,
                       raw: Mapping[str, Any] | None = None, tiers: bool = True
                       ) -> dict[str, Any]:
    """D's ``kv_transfer_params`` in pull mode: P's answer ``raw`` as P gave it, once
    :func:`read_prefill_answer` checked it as ``answer``, with the proxy's ``transfer_id``.

    Passed through, not re-serialised, so a D of another connector gets what its P meant: vLLM's
    per-group ``remote_block_ids`` (``[[...]]``) stays nested and keys kvbridge does not read (a
    stock NixlConnector's ``dcp_size`` …) stay; a fleet that mixes kvbridge and vLLM's own
    connectors during a migration routes through one proxy. Without ``raw``: ``answer``
    re-serialised. ``tiers=False``: D's offload tiers serve nothing of it
    (``kvbridge_tiers``)."""
    out = params.to_wire(answer) if raw is None else dict(raw)
    out["transfer_id"] = answer.transfer_id
    if not tiers:
        out["kvbridge_tiers"] = False
    return out


def decode_body(body: Mapping[str, Any], kv_params: Mapping[str, Any]) -> dict[str, Any]:
    """The client's request as D gets it: unchanged except for ``kv_transfer_params``."""
    out = dict(body)
    out["kv_transfer_params"] = dict(kv_params)
    return out


def probe_body(model: str) -> dict[str, Any]:
    """The request that makes an engine's connector report its control addresses."""
    return {
        "model": model,
        "prompt": [1],
        "max_tokens": 1,
        "kv_transfer_params": params.probe_request(),
    }


def parse_probe(raw: Any) -> ProbeInfo:
    """Read a probe answer's ``kv_transfer_params``; :class:`ParamsError` names the bad key."""
    if not isinstance(raw, Mapping):
        raise ParamsError(
            "kv_transfer_params",
            "the probe answer has none (is the engine running KVBridgeConnector?)",
        )
    answer = params.parse(raw)
    missing = [k for k in PROBE_KEYS if getattr(answer, k) is None]
    if missing:
        raise ParamsError(
            f"kv_transfer_params.{missing[0]}", "probe answer lacks {}".format(", ".join(missing))
        )
    return ProbeInfo(answer)


class PrefillRefused(Exception):
    """P answered ``kvbridge_error``: it prefilled without handing off (nothing is pinned).

    ``malformed`` when the error names a request field (the request was bad: HTTP 400).
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        match = _FIELD_ERROR.match(message)
        self.param = match.group(1) if match else None
        self.malformed = match is not None


_FIELD_ERROR = re.compile(r"^(kv_transfer_params(?:\.\w+)?|prompt|prompt_token_ids|messages|n): ")


def read_prefill_answer(raw: Any, transfer_id: str, mode: ProxyMode) -> TransferParams:
    """Check P's answer ``kv_transfer_params`` for the hand-off ``transfer_id`` in ``mode``.

    Raises :class:`ParamsError` (naming the key) for a malformed answer, one for another
    transfer, or a pull answer without ``do_remote_prefill`` and ``remote_block_ids``; raises
    :class:`PrefillRefused` when P reports ``kvbridge_error``. A pull answer without a
    ``transfer_id`` gets the proxy's (the proxy owns transfer ids). The cross-key rules that need
    the prompt (address, block count) are D's: :meth:`TransferParams.check_decode_leg`.
    """
    if not isinstance(raw, Mapping):
        raise ParamsError(
            "kv_transfer_params",
            "the prefill answer has none (is the engine running KVBridgeConnector as "
            "kv_producer?)",
        )
    answer = params.parse(raw)
    if answer.kvbridge_error is not None:
        raise PrefillRefused(answer.kvbridge_error)
    if answer.transfer_id is not None and answer.transfer_id != transfer_id:
        raise ParamsError(
            "kv_transfer_params.transfer_id",
            f"the prefill answer is for transfer {answer.transfer_id}, not {transfer_id}",
        )
    if mode is ProxyMode.PULL:
        if not answer.do_remote_prefill:
            raise ParamsError("kv_transfer_params.do_remote_prefill",
                              "a pull answer must set do_remote_prefill")
        if not (answer.remote_block_ids or answer.remote_block_groups):
            raise ParamsError("kv_transfer_params.remote_block_ids",
                              "a pull answer must name the prompt's blocks")
        if answer.transfer_id is None:
            answer = msgspec.structs.replace(answer, transfer_id=transfer_id)
    return answer
