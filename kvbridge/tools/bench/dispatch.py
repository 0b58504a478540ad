"""One request of the benches' workload, driven leg by leg as each connector's proxy would.

Contract: :class:`Pair` is a started (P, D) engine pair with what the drivers need;
:func:`dispatch` runs one request of a mode on it and :func:`via_proxy` one through a kvbridge
proxy, each returning a :class:`~kvbridge.tools.bench.e2e_report.RequestRecord` and never
raising (a failed request is a result). vLLM's NIXL connectors get their stock protocols
(:func:`vllm_pull_params`, :func:`vllm_push_params`); kvbridge gets the proxy's own request
bodies and, for ``headroom``, the proxy's own decision (:class:`DecodeLoad` over
:func:`kvbridge.proxy.routing.decide`). Blocking; thread-safe where the e2e bench sends waves
of requests at once (``Pair.load`` is shared under a lock). :func:`connect`,
:func:`control_addresses` and :func:`control_stats` reach the kvbridge engines' control
channels for their timings.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvbridge.params import probe_request
from kvbridge.proxy.routing import (
    Pool,
    ProxyMode,
    Role,
    decide,
    new_transfer_id,
    parse_probe,
    prefill_body,
    push_decode_params,
)
from kvbridge.tools.bench.e2e_report import BenchSettings, RequestRecord
from kvbridge.tools.bench.fleet import VLLM_PUSH_P_ENGINE, side_channel_port
from kvbridge.tools.client import StreamResult, complete, stats_reply, stream_complete
from kvbridge.tools.engines import EngineError, VllmServer

__all__ = ["GREEDY", "DecodeLoad", "Pair", "connect", "control_addresses", "control_stats",
           "dispatch", "kvbridge_prefill_params", "via_proxy", "vllm_pull_params",
           "vllm_push_params"]

GREEDY = {"ignore_eos": True}
"""Extra body of every bench request: greedy (the client's default) and all ``max_tokens``."""


class DecodeLoad:
    """Requests in flight at D, seen the way the proxy sees them: one
    :class:`~kvbridge.proxy.routing.Pool` of the pair's D, so that ``headroom`` decides with the
    proxy's own :func:`~kvbridge.proxy.routing.decide` (the dispatcher's threads share it, under
    a lock)."""

    def __init__(self, d_url: str = "http://127.0.0.1:0") -> None:
        self._lock = threading.Lock()
        self.pool = Pool(Role.DECODE, [d_url])

    def choose(self, mode: str, headroom: int) -> tuple[str, bool]:
        """``(mode to run, reserved)``: ``headroom`` becomes what the proxy would pick now; a push
        it picked is counted at once (``reserved``), so that concurrent decisions see it."""
        if mode != "headroom":
            return mode, False
        with self._lock:
            chosen = decide(ProxyMode.HEADROOM, self.pool, headroom).mode.value
            if chosen == "push":
                self.pool.engines[0].acquire()
            return chosen, chosen == "push"

    @contextlib.contextmanager
    def hold(self, reserved: bool = False) -> Iterator[None]:
        """Count a request at D for the block (*reserved*: already counted by :meth:`choose`)."""
        engine = self.pool.engines[0]
        if not reserved:
            with self._lock:
                engine.acquire()
        try:
            yield
        finally:
            with self._lock:
                engine.release()


@dataclass
class Pair:
    """A started engine pair and what the dispatchers need to know about it."""

    config: str
    p: VllmServer
    d: VllmServer
    settings: BenchSettings
    legs: cf.ThreadPoolExecutor
    p_ctl: str | None = None
    d_ctl: str | None = None
    probe: Any = None  # kvbridge.proxy.routing.ProbeInfo of P (kvbridge pairs)
    load: DecodeLoad = field(default_factory=DecodeLoad)

    @property
    def kvbridge(self) -> bool:
        return self.config.startswith("kvbridge")


def _stream_d(pair: Pair, url: str, prompt: list[int], params: Mapping[str, Any] | None,
              t0: float, rec: RequestRecord, headers: Mapping[str, str] | None = None) -> None:
    t_send = time.perf_counter()
    if rec.t0_wall is None:
        rec.t0_wall = time.time() - (t_send - t0)
    res: StreamResult = stream_complete(url, prompt, pair.settings.max_tokens, params, GREEDY,
                                        timeout=pair.settings.request_timeout, headers=headers)
    if res.ttft is None:
        raise EngineError(f"D stream from {url} produced no token")
    rec.ttft = (t_send - t0) + res.ttft
    rec.tpot = res.tpot
    rec.total = (t_send - t0) + res.total
    rec.token_ids = res.token_ids
    if len(res.token_ids) != pair.settings.max_tokens:
        raise EngineError(f"D returned {len(res.token_ids)} tokens, expected "
                          f"{pair.settings.max_tokens} (finish_reason {res.finish_reason})")
    rec.ok = True


def _p_leg(pair: Pair, prompt: list[int], params: Mapping[str, Any],
           headers: Mapping[str, str] | None = None) -> dict[str, Any]:
    return complete(pair.p.url, prompt, 1, params, timeout=pair.settings.request_timeout,
                    headers=headers)


def vllm_pull_params() -> dict[str, Any]:
    """P's ``kv_transfer_params`` in vLLM's stock NixlConnector protocol (the P leg, max_tokens=1);
    D then gets whatever ``kv_transfer_params`` P answers."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}


def vllm_push_params(rid: str, p_side_channel_port: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(P's, D's) ``kv_transfer_params`` of one request in vLLM's stock NixlPushConnector
    protocol: both legs are sent concurrently with ``X-Request-Id: rid``; D is told P's engine id
    (:data:`VLLM_PUSH_P_ENGINE`) and side-channel port, and P's request id for *rid*."""
    transfer_id = "xfer-" + rid
    p_params = {**vllm_pull_params(), "transfer_id": transfer_id}
    d_params = {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": VLLM_PUSH_P_ENGINE, "remote_host": "localhost",
                "remote_port": p_side_channel_port, "tp_size": 1, "pp_size": 1,
                "remote_request_id": f"cmpl-{rid}-0", "transfer_id": transfer_id}
    return p_params, d_params


def kvbridge_prefill_params(transfer_id: str, mode: str) -> dict[str, Any]:
    """The P leg's ``kv_transfer_params`` the kvbridge proxy would send in *mode*."""
    params: dict[str, Any] = prefill_body({"prompt": []}, transfer_id,
                                          ProxyMode(mode))["kv_transfer_params"]
    return params


def _pull(pair: Pair, prompt: list[int], p_params: Mapping[str, Any],
          rec: RequestRecord, extra: Mapping[str, Any] | None = None) -> None:
    t0 = time.perf_counter()
    resp = _p_leg(pair, prompt, {**p_params, **(extra or {})})
    d_params = resp.get("kv_transfer_params")
    if not isinstance(d_params, dict):
        raise EngineError(f"P returned no kv_transfer_params: {str(resp)[:200]}")
    d_params = {**d_params, **(extra or {})}
    with pair.load.hold():
        _stream_d(pair, pair.d.url, prompt, d_params, t0, rec)


def _concurrent_legs(pair: Pair, prompt: list[int], p_params: Mapping[str, Any],
                     d_params: Mapping[str, Any], rec: RequestRecord,
                     headers: Mapping[str, str] | None = None) -> None:
    t0 = time.perf_counter()
    p_fut = pair.legs.submit(_p_leg, pair, prompt, p_params, headers)
    try:
        _stream_d(pair, pair.d.url, prompt, d_params, t0, rec, headers)
    finally:
        # Bounded by the P leg's own timeout; its failure fails the request even if D answered.
        p_fut.result(timeout=pair.settings.request_timeout + 10)


def dispatch(pair: Pair, mode: str, prompt: list[int], index: int,
             extra: Mapping[str, Any] | None = None) -> RequestRecord:
    """Run one request of *mode* on *pair* and return its record (never raises). ``extra``:
    keys added to both legs' ``kv_transfer_params`` (kvbridge pairs only)."""
    rec = RequestRecord(index=index, mode=mode, prompt=list(prompt))
    try:
        if pair.config == "vllm-nixl-pull":
            _pull(pair, prompt, vllm_pull_params(), rec)
        elif pair.config == "vllm-nixl-push":
            rid = uuid.uuid4().hex
            p_params, d_params = vllm_push_params(rid, side_channel_port(pair.p))
            rec.transfer_id = p_params["transfer_id"]
            _concurrent_legs(pair, prompt, p_params, d_params, rec, {"X-Request-Id": rid})
        else:
            rec.transfer_id = new_transfer_id()
            chosen, reserved = pair.load.choose(mode, pair.settings.push_headroom)
            rec.mode = chosen
            if chosen == "pull":
                _pull(pair, prompt, kvbridge_prefill_params(rec.transfer_id, "pull"), rec, extra)
            else:
                with pair.load.hold(reserved):
                    _concurrent_legs(
                        pair, prompt,
                        {**kvbridge_prefill_params(rec.transfer_id, "push"), **(extra or {})},
                        {**push_decode_params(pair.probe, rec.transfer_id), **(extra or {})}, rec)
    except Exception as exc:  # noqa: BLE001 - a failed request is a result, not a crash
        rec.ok = False
        rec.error = f"{type(exc).__name__}: {exc}"[:500]
    return rec


def via_proxy(pair: Pair, url: str, mode: str, prompt: list[int], index: int) -> RequestRecord:
    """One streamed request through a kvbridge proxy at *url* (never raises)."""
    rec = RequestRecord(index=index, mode=mode, prompt=list(prompt))
    try:
        _stream_d(pair, url, prompt, None, time.perf_counter(), rec)
    except Exception as exc:  # noqa: BLE001
        rec.ok = False
        rec.error = f"{type(exc).__name__}: {exc}"[:500]
    return rec


# -- phases --------------------------------------------------------------------------------------


def control_stats(address: str) -> Any:
    """One engine rank's :class:`~kvbridge.messages.StatsReply` (counters and timings)."""
    return stats_reply(address, 10.0)


def control_addresses(p_url: str, d_url: str, timeout: float) -> tuple[str, str, Any]:
    """Two started kvbridge engines: (P's control address, D's, P's parsed probe answer).
    Raises EngineError when an engine does not answer."""
    p_probe = _control_probe(p_url, timeout)
    d_probe = _control_probe(d_url, timeout)
    return (f"tcp://{p_probe['remote_host']}:{p_probe['remote_port']}",
            f"tcp://{d_probe['remote_host']}:{d_probe['remote_port']}", parse_probe(p_probe))


def connect(pair: Pair) -> None:
    """A started kvbridge pair: learn P's probe answer (for push dispatch) and both control
    addresses (for the engines' timings). Raises EngineError when an engine does not answer."""
    pair.p_ctl, pair.d_ctl, pair.probe = control_addresses(pair.p.url, pair.d.url,
                                                           pair.settings.request_timeout)


def _control_probe(url: str, timeout: float) -> dict[str, Any]:
    params = complete(url, [1], 1, probe_request(), timeout=timeout)["kv_transfer_params"]
    if not isinstance(params, dict) or "remote_port" not in params:
        raise EngineError(f"{url} did not answer the kvbridge probe: {params!r}")
    return params

