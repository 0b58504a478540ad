"""A small client of running engines: OpenAI ``/v1/completions`` over HTTP, and kvbridge's stats.

Contract: :func:`complete` and :func:`stream_complete` send one greedy completion (token ids
asked back with ``return_token_ids``) using only the standard library, so this module imports
without vLLM or any HTTP package; :func:`probe`, :func:`reset_prefix_cache`,
:func:`stats_reply`, :func:`engine_stats` and :func:`wait_stats` ask a KVBridgeConnector engine
for its control addresses, drop vLLM's prefix cache, and read a rank's counters and timings over
its control channel. Every call blocks, has a timeout, raises
:class:`~kvbridge.tools.engines.EngineError` on HTTP, network or protocol errors, and is
thread-safe (one connection per call). The engines themselves are started by
:mod:`kvbridge.tools.engines`.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbridge import params
from kvbridge.tools.engines import EngineError

__all__ = [
    "StreamResult",
    "complete",
    "engine_stats",
    "output_text",
    "output_token_ids",
    "probe",
    "reset_prefix_cache",
    "stats_reply",
    "stream_complete",
    "wait_stats",
]


def _request_body(
    prompt: Sequence[int] | str,
    max_tokens: int,
    model: str,
    kv_transfer_params: Mapping[str, Any] | None,
    stream: bool,
    extra: Mapping[str, Any] | None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt if isinstance(prompt, str) else list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "return_token_ids": True,
        "stream": stream,
    }
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = dict(kv_transfer_params)
    if extra:
        body.update(extra)
    return body


def _post(
    url: str, body: Mapping[str, Any], timeout: float, headers: Mapping[str, str] | None
) -> Any:
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(
        url.rstrip("/") + "/v1/completions",
        data=json.dumps(body).encode(),
        headers=hdrs,
        method="POST",
    )
    try:
        return urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        detail = e.read()[:2000].decode("utf-8", "replace")
        raise EngineError(f"POST {req.full_url} -> HTTP {e.code}: {detail}", e.code,
                          detail) from e
    except (urllib.error.URLError, OSError) as e:
        raise EngineError(f"POST {req.full_url} failed: {e}") from e


def complete(
    url: str,
    prompt_token_ids: Sequence[int] | str,
    max_tokens: int,
    kv_transfer_params: Mapping[str, Any] | None = None,
    stream: bool = False,
    extra: Mapping[str, Any] | None = None,
    *,
    model: str = "tiny",
    timeout: float = 120.0,
    headers: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """POST a greedy ``/v1/completions`` request to *url* and return the response JSON.

    The request asks for ``return_token_ids`` so the output token ids come back in
    ``choices[0].token_ids`` (read them with :func:`output_token_ids`). *extra* is merged into
    the body last (e.g. ``{"ignore_eos": True}``). With ``stream=True`` the stream is consumed
    and folded into one response-shaped dict, plus a ``"timing"`` entry (see
    :class:`StreamResult`). Blocking; raises EngineError on HTTP or network errors.
    """
    if stream:
        return stream_complete(
            url, prompt_token_ids, max_tokens, kv_transfer_params, extra,
            model=model, timeout=timeout, headers=headers,
        ).as_response()  # fmt: skip
    body = _request_body(prompt_token_ids, max_tokens, model, kv_transfer_params, False, extra)
    with _post(url, body, timeout, headers) as r:
        data = json.loads(r.read())
    if not isinstance(data, dict):
        raise EngineError(f"unexpected response from {url}: {data!r:.200}")
    return data


@dataclass
class StreamResult:
    """What a streamed completion produced, with client-side timings (seconds)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ttft: float | None = None
    """Time from sending the request to the first chunk carrying output."""
    token_times: list[float] = field(default_factory=list)
    """Arrival time of each output token, relative to sending (tokens of one chunk share it)."""
    total: float = 0.0
    chunks: int = 0

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first, or None with fewer than 2 tokens."""
        if self.ttft is None or len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    def as_response(self) -> dict[str, Any]:
        """The result in the shape of a non-streamed response, with a ``timing`` entry."""
        return {
            "choices": [
                {"text": self.text, "token_ids": self.token_ids,
                 "finish_reason": self.finish_reason, "index": 0}
            ],
            "kv_transfer_params": self.kv_transfer_params,
            "timing": {"ttft": self.ttft, "tpot": self.tpot, "total": self.total,
                       "token_times": self.token_times},
        }  # fmt: skip


def stream_complete(
    url: str,
    prompt_token_ids: Sequence[int] | str,
    max_tokens: int,
    kv_transfer_params: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    *,
    model: str = "tiny",
    timeout: float = 120.0,
    headers: Mapping[str, str] | None = None,
) -> StreamResult:
    """Stream a greedy completion and record time to first token and per-token arrival times.

    *timeout* bounds each socket read (a stalled stream raises EngineError) and, overall, the
    whole request. Blocking; raises EngineError on HTTP, network or protocol errors.
    """
    body = _request_body(prompt_token_ids, max_tokens, model, kv_transfer_params, True, extra)
    res = StreamResult()
    t0 = time.perf_counter()
    try:
        with _post(url, body, timeout, headers) as r:
            for raw in r:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    # Keep reading to the end of the body: closing now would cut the server
                    # off before its last chunk terminator (a reset on its side).
                    continue
                now = time.perf_counter() - t0
                if now > timeout:
                    raise EngineError(f"stream from {url} exceeded {timeout:.0f} s")
                chunk = json.loads(payload)
                if "error" in chunk:
                    raise EngineError(f"stream from {url} reported an error: {chunk['error']}")
                res.chunks += 1
                if chunk.get("kv_transfer_params") is not None:
                    res.kv_transfer_params = chunk["kv_transfer_params"]
                for choice in chunk.get("choices") or []:
                    ids = choice.get("token_ids") or []
                    text = choice.get("text") or ""
                    if (ids or text) and res.ttft is None:
                        res.ttft = now
                    res.token_ids.extend(int(i) for i in ids)
                    res.token_times.extend([now] * len(ids))
                    res.text += text
                    if choice.get("finish_reason") is not None:
                        res.finish_reason = choice["finish_reason"]
    except (OSError, ValueError) as e:  # socket timeouts, resets, bad JSON
        raise EngineError(f"stream from {url} failed: {e}") from e
    res.total = time.perf_counter() - t0
    return res


def output_token_ids(response: Mapping[str, Any]) -> list[int] | None:
    """``choices[0].token_ids`` of a completion response, or None if the server omitted them."""
    choices = response.get("choices") or []
    if not choices:
        return None
    ids = choices[0].get("token_ids")
    return [int(i) for i in ids] if ids is not None else None


def output_text(response: Mapping[str, Any]) -> str:
    """``choices[0].text`` of a completion response ("" if absent)."""
    choices = response.get("choices") or []
    return str(choices[0].get("text") or "") if choices else ""


def probe(url: str, timeout: float = 30.0) -> Any:
    """The :class:`kvbridge.params.TransferParams` a KVBridgeConnector engine answers to a probe
    (its control addresses): ``params.push_decode_request(probe(p_url), tid)`` is a push D leg."""
    answer = complete(url, [1], 1, params.probe_request(), timeout=timeout)
    return params.parse(answer.get("kv_transfer_params"))


def reset_prefix_cache(url: str, timeout: float = 30.0, *, external: bool = False) -> None:
    """``POST /reset_prefix_cache`` (vLLM serves it when ``VLLM_SERVER_DEV_MODE=1``): the next
    request finds nothing in vLLM's own prefix cache, so any reuse comes from a connector.

    vLLM refuses the reset (``{"success": false}``) while blocks are still held — a finished
    request whose blocks a connector is still copying out, for instance — so this retries until
    it succeeds, and raises :class:`EngineError` if it has not within ``timeout``: a reset that
    silently failed would let vLLM's own cache serve what a test means to load from a tier.

    ``external``: reset the connector's cache too (``?reset_external=true``), as vLLM's
    clients do after a weight update; kvbridge then moves its model identity on."""
    query = "?reset_external=true" if external else ""
    req = urllib.request.Request(url.rstrip("/") + "/reset_prefix_cache" + query, data=b"",
                                 method="POST")
    deadline = time.monotonic() + timeout
    pause = 0.05
    while True:
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                body = resp.read()
        except urllib.error.HTTPError as e:
            raise EngineError(f"POST {req.full_url} -> HTTP {e.code} (is "
                              "VLLM_SERVER_DEV_MODE=1 set?)", e.code) from e
        except (urllib.error.URLError, OSError) as e:
            raise EngineError(f"POST {req.full_url} failed: {e}") from e
        try:
            answer = json.loads(body or b"{}")
        except ValueError:
            answer = {}
        if not isinstance(answer, dict) or answer.get("success", True) is not False:
            return
        if time.monotonic() + pause > deadline:
            raise EngineError(f"POST {req.full_url}: vLLM refused the reset for {timeout:.0f} s "
                              "(blocks still held)")
        time.sleep(pause)
        pause = min(pause * 2, 1.0)


def stats_reply(address: str, timeout: float = 30.0) -> Any:
    """The :class:`~kvbridge.messages.StatsReply` (counters, timings) of the KVBridgeConnector
    rank whose control channel is ``address``, asked with the secret local engines use
    (``KVBRIDGE_SECRET``, else the per-user secret: :func:`kvbridge.trust.for_tools`)."""
    # Imported here to keep `kvbridge --help` fast: the control channel's client pulls zmq.
    from kvbridge.messages import StatsQuery, StatsReply
    from kvbridge.testing.clients import engine_client

    client = engine_client(timeout)
    try:
        reply = client.request(address, StatsQuery())
    finally:
        client.close()
    if not isinstance(reply, StatsReply):
        raise EngineError(f"stats from {address}: unexpected reply {type(reply).__name__}")
    return reply


def engine_stats(address: str, timeout: float = 30.0) -> dict[str, int]:
    """The counters of the KVBridgeConnector rank whose control channel is ``address``."""
    return dict(stats_reply(address, timeout).stats)


def wait_stats(address: str, key: str, at_least: int, timeout: float = 30.0) -> dict[str, int]:
    """:func:`engine_stats` once counter ``key`` reached ``at_least`` (or ``timeout`` passed):
    for counters moved by background work, such as offload stores written behind."""
    deadline = time.monotonic() + timeout
    stats = engine_stats(address)
    while stats.get(key, 0) < at_least and time.monotonic() < deadline:
        time.sleep(0.2)
        stats = engine_stats(address)
    return stats
