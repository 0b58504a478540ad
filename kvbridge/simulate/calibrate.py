"""``kvbridge simulate calibrate``: measure this host's step costs on real engines → a profile.

Starts the engine pair of ``kvbridge bench e2e`` (the tiny model, P on core 0, D on core 1,
``--block-size 32``, KVBridgeConnector over ``--backend``), then measures, one thing at a time:

1. **P's prefill step** against prompt length: sequential one-token requests sent straight to P,
   each with a fresh prompt; the engine-side time is vLLM's ``vllm:request_prefill_time_seconds``
   (one step for these lengths), the client-side wall time minus it is the HTTP round trip.
   Least squares gives ``step_base_s + per_token_s * L + per_token_ctx_s * L^2/2``.
2. **D's decode step** against batch size and context: B concurrent streams through the kvbridge
   proxy in push mode, as ``kvbridge bench serve`` sends them (B = 1, 2, 4, 8 at one prompt
   length, and B = 4 at a longer one); the median of the streams' mean inter-token times is the
   step time of that batch *as a client sees it*, streaming path included. Least squares gives
   ``step_base_s + per_seq_s * B + per_ctx_token_s * sum(context)``.
3. **The hand-off**, through the real kvbridge proxy in pull and in push, sequential requests:
   the engines' own per-transfer timings (``StatsQuery``: P ``kv_ready``, ``write_posted``,
   ``write_done``; D ``recv_start``, ``recv_done``, ``first_step``) and the client's send and
   first-token times give each gap the profile needs (see :func:`derive`).

Everything runs from this process; engines are stopped at the end, also on error. Run it under
``nice`` on a shared host and on a quiet one: the load average is recorded in the profile.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvbridge.errors import ConfigError

__all__ = ["Measurements", "add_arguments", "cli_main", "derive", "measure"]

_PREFILL_LENS = (32, 128, 256, 512, 896)
_BATCHES = (1, 2, 4, 8)
_DECODE_PROMPT = 200
_LONG_PROMPT = 800
_DECODE_TOKENS = 48
_HANDOFF_PROMPT = 200
_HANDOFF_TOKENS = 16
_KV_CACHE_BYTES = 268435456  # kvbridge.testing.engines.BASE_ARGS --kv-cache-memory-bytes
_MAX_NUM_SEQS = 8  # BASE_ARGS --max-num-seqs


@dataclass
class Measurements:
    """Raw figures of one calibration run (seconds)."""

    prefill: dict[int, list[float]] = field(default_factory=dict)
    """prompt length → engine-side prefill times"""
    http_rtt: list[float] = field(default_factory=list)
    """direct P requests: client wall time minus the engine's prefill time"""
    decode: list[tuple[int, int, float]] = field(default_factory=list)
    """(batch, summed context tokens, mean step time) per stream"""
    gaps: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    """mode → gap name (``kv_ready->recv_done`` ...) → values"""
    ttft: dict[str, list[float]] = field(default_factory=dict)
    max_batched_tokens: int = 0
    loadavg: list[str] = field(default_factory=list)


def _metric(url: str, name: str) -> tuple[float, float]:
    from kvbridge.bench_e2e import prom_sum

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode("utf-8", "replace")
    return prom_sum(text, name + "_sum"), prom_sum(text, name + "_count")


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def _measure_prefill(url: str, reps: int, m: Measurements, say: Callable[[str], None]) -> None:
    from kvbridge.testing.engines import complete
    from kvbridge.testing.tiny_model import random_prompts

    name = "vllm:request_prefill_time_seconds"
    prompts = {n: random_prompts(reps + 1, n, seed=1000 + i)
               for i, n in enumerate(_PREFILL_LENS)}
    for j in range(reps + 1):  # lengths interleaved, so drifting host load hits them alike
        for length in _PREFILL_LENS:
            s0, c0 = _metric(url, name)
            t0 = time.perf_counter()
            complete(url, prompts[length][j], 1, timeout=120)
            wall = time.perf_counter() - t0
            s1, c1 = _metric(url, name)
            if c1 - c0 != 1 or j == 0:  # the first round warms up every shape
                continue
            m.prefill.setdefault(length, []).append(s1 - s0)
            m.http_rtt.append(wall - (s1 - s0))
    say("prefill (ms, medians): " + ", ".join(
        f"{n} tokens {statistics.median(v) * 1000:.1f}" for n, v in m.prefill.items()))


def _measure_decode(url: str, reps: int, m: Measurements, say: Callable[[str], None]) -> None:
    from kvbridge.testing.engines import stream_complete
    from kvbridge.testing.tiny_model import random_prompts

    shapes = [(b, _DECODE_PROMPT) for b in _BATCHES] + [(4, _LONG_PROMPT)]
    seed = 5000
    with ThreadPoolExecutor(max(_BATCHES)) as pool:
        for rep in range(max(2, reps // 2)):  # shapes interleaved, as for prefill
            for batch, plen in shapes:
                seed += 1
                prompts = random_prompts(batch, plen, seed=seed)
                futs = [pool.submit(stream_complete, url, p, _DECODE_TOKENS,
                                    extra={"ignore_eos": True}, timeout=120) for p in prompts]
                tpots = [t for t in (f.result().tpot for f in futs) if t is not None]
                if rep > 0 and tpots:  # the first round warms up every shape
                    m.decode.append((batch, batch * (plen + _DECODE_TOKENS // 2),
                                     statistics.median(tpots)))
    by_shape: dict[tuple[int, int], list[float]] = {}
    for b, c, t in m.decode:
        by_shape.setdefault((b, c), []).append(t)
    say("decode step (ms, medians): " + ", ".join(
        f"batch {b} context {c} {statistics.median(v) * 1000:.2f}"
        for (b, c), v in by_shape.items()))


def _control(url: str) -> str:
    from kvbridge.params import probe_request
    from kvbridge.testing.engines import complete

    params = complete(url, [1], 1, probe_request(), timeout=60)["kv_transfer_params"]
    return f"tcp://{params['remote_host']}:{params['remote_port']}"


def _timings(address: str) -> dict[str, dict[str, float]]:
    from kvbridge.control import ControlClient
    from kvbridge.messages import Codec, StatsQuery, StatsReply

    client = ControlClient(Codec(os.environ.get("KVBRIDGE_SECRET")), 10.0)
    try:
        reply = client.request(address, StatsQuery())
    finally:
        client.close()
    if not isinstance(reply, StatsReply):
        raise ConfigError(f"{address} did not answer a stats query")
    return {k: dict(v) for k, v in reply.timings.items()}


def _gap(a: Mapping[str, float], ea: str, b: Mapping[str, float], eb: str) -> float | None:
    return b[eb] - a[ea] if ea in a and eb in b else None


def _measure_handoff(p_url: str, d_url: str, urls: Mapping[str, str], reps: int,
                     m: Measurements, say: Callable[[str], None]) -> None:
    from kvbridge.testing.engines import stream_complete
    from kvbridge.testing.tiny_model import random_prompts

    p_ctl, d_ctl = _control(p_url), _control(d_url)
    for k, mode in enumerate(("pull", "push")):
        url = urls[mode]
        prompts = random_prompts(reps + 2, _HANDOFF_PROMPT, seed=9000 + k)
        for p in prompts[:2]:  # warm-up: handshakes, first transfers
            stream_complete(url, p, _HANDOFF_TOKENS, extra={"ignore_eos": True}, timeout=120)
        seen = set(_timings(d_ctl))
        sends: list[tuple[float, float]] = []
        for p in prompts[2:]:
            t_wall = time.time()
            res = stream_complete(url, p, _HANDOFF_TOKENS, extra={"ignore_eos": True},
                                  timeout=120)
            if res.ttft is not None:
                sends.append((t_wall, t_wall + res.ttft))
                m.ttft.setdefault(mode, []).append(res.ttft)
            time.sleep(0.05)
        pt, dt = _timings(p_ctl), _timings(d_ctl)
        # P records no kv_ready for pull transfers (only push producers are tracked):
        # order the new transfers by D's recv_start, which every mode records.
        fresh = sorted((t for t in dt if t not in seen and "recv_start" in dt[t]),
                       key=lambda t: dt[t]["recv_start"])
        gaps = m.gaps.setdefault(mode, {})
        for tid, (t_send, t_first) in zip(fresh, sends, strict=False):
            p_ev, d_ev = pt.get(tid, {}), dt[tid]
            c = {"send": t_send, "first_token": t_first}
            for name, value in (
                    ("send->kv_ready", _gap(c, "send", p_ev, "kv_ready")),
                    ("send->recv_start", _gap(c, "send", d_ev, "recv_start")),
                    ("kv_ready->recv_start", _gap(p_ev, "kv_ready", d_ev, "recv_start")),
                    ("recv_start->recv_done", _gap(d_ev, "recv_start", d_ev, "recv_done")),
                    ("kv_ready->write_posted", _gap(p_ev, "kv_ready", p_ev, "write_posted")),
                    ("write_posted->write_done",
                     _gap(p_ev, "write_posted", p_ev, "write_done")),
                    ("write_done->recv_done", _gap(p_ev, "write_done", d_ev, "recv_done")),
                    ("recv_done->first_step", _gap(d_ev, "recv_done", d_ev, "first_step")),
                    ("first_step->first_token",
                     _gap(d_ev, "first_step", c, "first_token"))):
                if value is not None:
                    gaps.setdefault(name, []).append(value)
        say(f"{mode}: " + ", ".join(f"{n} {statistics.median(v) * 1000:.1f}"
                                    for n, v in gaps.items()) + " (ms, medians)")


def _batched_tokens(log_path: Path | None) -> int:
    """vLLM's chunked-prefill budget, from the engine's start-up log (0: not found)."""
    import re

    if log_path is None:
        return 0
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return 0
    found = re.findall(r"max_num_batched_tokens[=: ]+(\d+)", text)
    return int(found[-1]) if found else 0


def measure(backend: str, reps: int, log_dir: Path, say: Callable[[str], None]) -> Measurements:
    """Start the engines (and proxies), take every measurement, stop everything."""
    from kvbridge.bench_e2e import engine_specs
    from kvbridge.testing.engines import start_servers
    from kvbridge.testing.proxies import ProxyThread
    from kvbridge.testing.tiny_model import build_tiny_model

    m = Measurements(loadavg=[_loadavg()])
    p, d = engine_specs(f"kvbridge-{backend}", build_tiny_model(), log_dir)
    proxies: ProxyThread | None = None
    try:
        say(f"starting the engine pair (logs in {log_dir})")
        start_servers([p, d], timeout=600)
        m.max_batched_tokens = _batched_tokens(p.log_path)
        _measure_prefill(p.url, reps, m, say)
        proxies = ProxyThread([p.url], [d.url], modes=("pull", "push")).start()
        _measure_decode(proxies.urls["push"], reps, m, say)
        _measure_handoff(p.url, d.url, proxies.urls, reps, m, say)
    finally:
        if proxies is not None:
            proxies.close()
        p.stop()
        d.stop()
    m.loadavg.append(_loadavg())
    return m


def _lstsq(rows: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """Non-negative least squares by clipping (coefficients the data cannot resolve are 0)."""
    a, b = np.asarray(rows, dtype=float), np.asarray(y, dtype=float)
    coef = np.linalg.lstsq(a, b, rcond=None)[0]
    for _ in range(len(coef)):
        neg = coef < 0
        if not neg.any():
            break
        keep = ~neg
        coef = np.zeros_like(coef)
        coef[keep] = np.linalg.lstsq(a[:, keep], b, rcond=None)[0]
    return [max(0.0, float(c)) for c in coef]


def _med(values: Sequence[float] | None, default: float = 0.0) -> float:
    return max(0.0, statistics.median(values)) if values else default


def derive(m: Measurements, base: Mapping[str, Any], backend: str, host: str) -> dict[str, Any]:
    """A profile document from the measurements; what is not measured stays as in ``base``."""
    doc: dict[str, Any] = json.loads(json.dumps(base))
    src: dict[str, str] = doc.setdefault("sources", {})
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    tag = (f"`kvbridge simulate calibrate --backend {backend}` on {host}, {when}, load "
           f"{m.loadavg[0]} -> {m.loadavg[-1]}")
    doc["description"] = f"this host (tiny model, KVBridgeConnector over {backend}), calibrated"
    rows, ys = [], []
    for length, values in m.prefill.items():
        for v in values:
            rows.append([1.0, length, length * length / 2])
            ys.append(v)
    base_s, per_tok, per_ctx = _lstsq(rows, ys)
    doc["prefill"].update(step_base_s=base_s, per_token_s=per_tok, per_token_ctx_s=per_ctx)
    for k in ("step_base_s", "per_token_s", "per_token_ctx_s"):
        src[f"prefill.{k}"] = (f"least squares over vLLM's request_prefill_time of sequential "
                               f"one-token requests of {list(m.prefill)} tokens straight to P; "
                               + tag)
    if m.max_batched_tokens:
        doc["prefill"]["max_batched_tokens"] = m.max_batched_tokens
        src["prefill.max_batched_tokens"] = "vLLM's start-up log of P (max_num_batched_tokens)"
    d_base, d_seq, d_ctx = _lstsq([[1.0, b, c] for b, c, _ in m.decode], [t for *_, t in m.decode])
    doc["decode"].update(step_base_s=d_base, per_seq_s=d_seq, per_ctx_token_s=d_ctx,
                         max_num_seqs=_MAX_NUM_SEQS)
    for k in ("step_base_s", "per_seq_s", "per_ctx_token_s"):
        src[f"decode.{k}"] = (f"least squares over the median inter-token time of B concurrent "
                              f"streams through the proxy, push (B = {list(_BATCHES)}, prompt "
                              f"{_DECODE_PROMPT}; B = 4, prompt {_LONG_PROMPT}); " + tag)
    kv_per_token = 2 * doc["model"]["layers"] * doc["model"]["kv_heads"] * \
        doc["model"]["head_dim"] * doc["model"]["dtype_bytes"]
    for role in ("prefill", "decode"):
        doc[role]["kv_capacity_tokens"] = _KV_CACHE_BYTES // kv_per_token
        src[f"{role}.kv_capacity_tokens"] = ("--kv-cache-memory-bytes 268435456 "
                                             "(kvbridge.testing.engines.BASE_ARGS) / KV bytes "
                                             "per token")
    g_pull, g_push = m.gaps.get("pull", {}), m.gaps.get("push", {})
    prefill_200 = base_s + per_tok * _HANDOFF_PROMPT + per_ctx * _HANDOFF_PROMPT ** 2 / 2
    request = max(0.0, _med(g_push.get("send->kv_ready"), prefill_200) - prefill_200)
    pull_start = _med(g_pull.get("send->recv_start"), 2 * request + prefill_200)
    answer = max(0.0, pull_start - 2 * request - prefill_200)
    write = _med(g_push.get("write_posted->write_done"), 1e-3)
    rank_bytes = kv_per_token * _HANDOFF_PROMPT / max(1, doc["model"]["tp"])
    step1 = d_base + d_seq + d_ctx * _HANDOFF_PROMPT
    doc["proxy"].update(client_s=0.0, request_s=request, per_prompt_token_s=0.0,
                        answer_s=answer,
                        stream_s=_med([v - step1 for v in
                                       g_pull.get("first_step->first_token", []) +
                                       g_push.get("first_step->first_token", [])]))
    doc["link"].update(latency_s=0.0, read_bandwidth=rank_bytes / write,
                       write_bandwidth=rank_bytes / write, read_per_desc_s=0.0,
                       write_per_desc_s=0.0)
    doc["pull"].update(on_d_loop=False, per_desc_s=0.0,
                       setup_s=max(0.0, _med(g_pull.get("recv_start->recv_done")) - write))
    notify = _med(g_push.get("write_done->recv_done"))
    doc["push"].update(post_on_p_thread=True, per_desc_s=0.0, notify_s=notify,
                       register_latency_s=notify,
                       setup_s=_med(g_push.get("kv_ready->write_posted")))
    doc["decode"]["idle_wake_s"] = _med(g_pull.get("recv_done->first_step", []) +
                                        g_push.get("recv_done->first_step", []))
    explained = {
        "proxy.request_s": "median client send -> P kv_ready (push through the proxy) minus "
                           "the fitted prefill of the prompt: client -> proxy -> P accepted",
        "proxy.answer_s": "median client send -> D recv_start (pull through the proxy) minus "
                          "the prefill and two legs of proxy.request_s: P's answer back at the "
                          "proxy",
        "proxy.stream_s": "median D first_step -> client first token minus one decode step",
        "link.read_bandwidth": "the prompt's KV bytes / median push write_posted -> write_done "
                               "(the same transport moves a READ)",
        "link.write_bandwidth": "the prompt's KV bytes / median push write_posted -> write_done",
        "pull.setup_s": "median pull D recv_start -> recv_done minus the WRITE time: handshake "
                        "(cached), claim round trip, descriptors, post (transfer thread)",
        "push.setup_s": "median push P kv_ready -> write_posted (P's transfer thread)",
        "push.notify_s": "median push P write_done -> D recv_done (DONE message)",
        "push.register_latency_s": "not visible separately; one control message, as notify_s",
        "decode.idle_wake_s": "median D recv_done -> first_step (both modes)",
    }
    fixed = {
        "pull.on_d_loop": "false: kvbridge's pull (claim, descriptors, READ) runs on the "
                          "transfer-loop thread, not the engine loop (kvbridge/scheduling/pull.py)",
        "push.post_on_p_thread": "true: P's transfer-loop thread posts the WRITE after the "
                                 "forward pass (kvbridge/scheduling/push.py)",
        "decode.max_num_seqs": "--max-num-seqs 8 (kvbridge.testing.engines.BASE_ARGS)",
        "decode.async_overlap": "false: on CPU the forward pass runs on the engine's own core",
    }
    doc["decode"]["async_overlap"] = False
    src.update({k: f"{v}; {tag}" for k, v in explained.items()})
    src.update(fixed)
    for section in ("prefill", "decode", "link", "pull", "push", "proxy"):
        src.pop(section, None)  # the base's section-wide notes describe other numbers now
        for key in doc[section]:
            src.setdefault(f"{section}.{key}", f"not measured by calibrate: kept from the "
                                               f"base profile {base.get('name', '?')!r}")
    doc["calibration"] = {
        "prefill_ms": {str(k): round(_med(v) * 1000, 3) for k, v in m.prefill.items()},
        "http_rtt_ms": round(_med(m.http_rtt) * 1000, 3),
        "decode": [[b, c, round(t * 1000, 3)] for b, c, t in m.decode],
        "gaps_ms": {mode: {k: round(_med(v) * 1000, 3) for k, v in g.items()}
                    for mode, g in m.gaps.items()},
        "ttft_ms": {mode: round(_med(v) * 1000, 3) for mode, v in m.ttft.items()},
        "loadavg": m.loadavg,
    }
    return doc


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="profile JSON to write")
    p.add_argument("--backend", choices=("nixl", "shm"), default="nixl")
    p.add_argument("--reps", type=int, default=8, help="requests per measured point (2..100)")
    p.add_argument("--base", default="host",
                   help="profile whose unmeasured parameters (model shape, headroom) are kept")
    p.add_argument("--log-dir", type=Path, default=None, help="engine logs (default: temp dir)")


def cli_main(args: argparse.Namespace) -> int:
    import socket
    import tempfile

    from kvbridge.simulate.profile import load_profile, parse_profile, profile_to_dict

    if not 2 <= args.reps <= 100:
        raise ConfigError(f"--reps: 2..100, got {args.reps}")
    base = profile_to_dict(load_profile(args.base))
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvbridge-calibrate-"))

    def say(msg: str) -> None:
        print(f"[calibrate] {msg}", flush=True)

    m = measure(args.backend, args.reps, log_dir, say)
    doc = derive(m, base, args.backend, socket.gethostname())
    calibration = doc.pop("calibration")
    parse_profile(doc, str(args.out))  # what we write must load
    doc["calibration"] = calibration
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    say(f"wrote {args.out}")
    return 0
