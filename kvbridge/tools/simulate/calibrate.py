"""``kvbridge simulate calibrate``: measure this host's costs on real engines → a profile.

:mod:`kvbridge.tools.simulate.calibrate_measure` takes the measurements (engines, proxies, real
``vllm bench serve`` runs); :func:`derive` turns them into a profile document by least squares:

- ``prefill``: ``step_base_s + per_token_s * L + per_token_ctx_s * L^2/2`` over the prefill
  times; ``decode``: ``step_base_s + per_seq_s * B + per_ctx_token_s * sum(context)`` over the
  decode steps. With CPU measurements (the default) both come from the engines' CPU seconds,
  which other jobs on the host move far less than wall time (:func:`_cpu_step_costs`); else
  from wall time.
- the hand-off gaps (``proxy``, ``link``, ``pull``, ``push``, ``decode.idle_wake_s``) from the
  sequential requests' medians;
- the ``cpu`` section (the host's shared cores) from the front ends' load runs
  (:func:`kvbridge.tools.simulate.calibrate_cpu.derive_cpu`).

What is not measured stays as in the base profile, and every source says which is which.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.tools.args import parse_names
from kvbridge.tools.simulate.calibrate_cpu import cpu_record, derive_cpu, fit_cpu
from kvbridge.tools.simulate.calibrate_measure import (
    _BATCHES,
    _DECODE_PROMPT,
    _DECODE_TOKENS,
    _HANDOFF_PROMPT,
    _HANDOFF_TOKENS,
    _KV_CACHE_BYTES,
    _LONG_PROMPT,
    _MAX_NUM_SEQS,
    _SPIN_S,
    Measurements,
    measure,
)
from kvbridge.tools.simulate.fit import nonneg_lstsq
from kvbridge.tools.simulate.profile import load_profile, parse_profile, profile_to_dict

__all__ = ["Measurements", "add_arguments", "cli_main", "derive", "measure"]


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
    base_s, per_tok, per_ctx = nonneg_lstsq(rows, ys)
    doc["prefill"].update(step_base_s=base_s, per_token_s=per_tok, per_token_ctx_s=per_ctx)
    for k in ("step_base_s", "per_token_s", "per_token_ctx_s"):
        src[f"prefill.{k}"] = (f"least squares over vLLM's request_prefill_time of sequential "
                               f"one-token requests of {list(m.prefill)} tokens straight to P; "
                               + tag)
    if m.max_batched_tokens:
        doc["prefill"]["max_batched_tokens"] = m.max_batched_tokens
        src["prefill.max_batched_tokens"] = "vLLM's start-up log of P (max_num_batched_tokens)"
    d_base, d_seq, d_ctx = nonneg_lstsq([[1.0, b, c] for b, c, _ in m.decode],
                                        [t for *_, t in m.decode])
    doc["decode"].update(step_base_s=d_base, per_seq_s=d_seq, per_ctx_token_s=d_ctx,
                         max_num_seqs=_MAX_NUM_SEQS)
    for k in ("step_base_s", "per_seq_s", "per_ctx_token_s"):
        src[f"decode.{k}"] = (f"least squares over the median inter-token time of B concurrent "
                              f"streams through the proxy, push (B = {list(_BATCHES)}, prompt "
                              f"{_DECODE_PROMPT}; B = 4, prompt {_LONG_PROMPT}); " + tag)
    engines: dict[str, tuple[float, str]] = {}
    if m.prefill_cpu and m.decode_cpu:
        engines = _cpu_step_costs(m, doc, tag)
    kv_per_token = 2 * doc["model"]["layers"] * doc["model"]["kv_heads"] * \
        doc["model"]["head_dim"] * doc["model"]["dtype_bytes"]
    for role in ("prefill", "decode"):
        doc[role]["kv_capacity_tokens"] = _KV_CACHE_BYTES // kv_per_token
        src[f"{role}.kv_capacity_tokens"] = ("--kv-cache-memory-bytes 268435456 "
                                             "(kvbridge.tools.engines.BASE_ARGS) / KV bytes "
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
        "decode.max_num_seqs": "--max-num-seqs 8 (kvbridge.tools.engines.BASE_ARGS)",
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
        "prefill_cpu_ms": {str(k): round(_med(v) * 1000, 3) for k, v in m.prefill_cpu.items()},
        "decode_cpu": [[b, c, round(t * 1000, 3)] for b, c, t in m.decode_cpu],
        "request_cpu_ms": {mode: {k: round(statistics.fmean(v) * 1000, 3) for k, v in g.items()
                                  if v} for mode, g in m.request_cpu.items()},
    }
    if m.cpu is not None and m.cpu.runs:
        derive_cpu(m.cpu, doc, tag, os.cpu_count() or 1, _SPIN_S, engines)
        doc["calibration"]["cpu"] = cpu_record(m.cpu)
    return doc


def _cpu_step_costs(m: Measurements, doc: dict[str, Any], tag: str
                    ) -> dict[str, tuple[float, str]]:
    """Step costs from the engines' CPU seconds instead of wall time: what a step costs on a core
    of its own, which other work on the host inflates far less (the CPU model,
    :mod:`kvbridge.tools.simulate.cpu`, stretches them by the engine's share of its core). Returns
    each engine's CPU per request beyond its steps (``cpu.p_engine_request_s`` ... → (value,
    source)), from the sequential hand-off requests.

    D's extra ``e`` per request is spread over the decode rounds' steps (B streams of
    ``_DECODE_TOKENS`` + 1 steps), so with ``c1`` the decode round's CPU per step at B = 1 and
    ``T`` D's CPU for one hand-off request (``_HANDOFF_TOKENS`` steps and one spin):
    ``c1 = s1 + e / 49`` and ``T = 16 s1 + e + spin`` give the step ``s1`` and ``e``; the part of
    ``e`` before the first token (``T_first - s1``) is D's admission, the rest its stream."""
    src: dict[str, str] = doc["sources"]
    rows = [[1.0, n, n * n / 2] for n, values in m.prefill_cpu.items() for _ in values]
    ys = [v for values in m.prefill_cpu.values() for v in values]
    pre = dict(zip(("step_base_s", "per_token_s", "per_token_ctx_s"), nonneg_lstsq(rows, ys),
                   strict=True))
    doc["prefill"].update(pre)
    for k in pre:
        src[f"prefill.{k}"] = (f"least squares over P's engine-core CPU seconds per sequential "
                               f"one-token request of {list(m.prefill_cpu)} tokens (idle burn and "
                               f"one {_SPIN_S * 1000:g} ms spin removed); " + tag)
    steps = _DECODE_TOKENS + 1
    raw = nonneg_lstsq([[1.0, b, c] for b, c, _ in m.decode_cpu], [t for *_, t in m.decode_cpu])
    c1 = raw[0] + raw[1] + raw[2] * (_HANDOFF_PROMPT + _DECODE_TOKENS // 2)
    d_first = [v for g in m.request_cpu.values() for v in g.get("d_first", [])]
    d_rest = [v for g in m.request_cpu.values() for v in g.get("d_rest", [])]
    p_total = [v for g in m.request_cpu.values() for v in g.get("p", [])]
    n = _HANDOFF_TOKENS
    load = fit_cpu(m.cpu).get("d_engine", {}) if m.cpu is not None else {}
    if "step_s" in load:
        # the load runs count D's steps: its CPU per step and per request separate there,
        # under vllm bench serve's own sampling; the decode rounds give the slopes in B and
        # context
        extra = load["request_s"]
        runs = m.cpu.runs if m.cpu is not None else []
        b_mean = sum((r.completed or r.prompts) * r.output_len for r in runs) / max(
            1, sum(r.d_steps for r in runs))
        ctx = b_mean * (_HANDOFF_PROMPT + statistics.fmean(r.output_len for r in runs) / 2)
        slope = nonneg_lstsq([[1.0, b, c] for b, c, _ in m.decode_cpu],
                             [t - extra * b / steps for b, _, t in m.decode_cpu])
        coef = [max(0.0, load["step_s"] - slope[1] * b_mean - slope[2] * ctx), slope[1],
                slope[2]]
        s1 = coef[0] + coef[1] + coef[2] * (_HANDOFF_PROMPT + n // 2)
        basis = (f"D's engine-core CPU seconds over the front-end load runs (vllm bench serve, "
                 f"cpu section), fitted against its steps (vllm:iteration_tokens_total count) "
                 f"and requests: {load['step_s'] * 1000:.2f} ms per step at a mean batch of "
                 f"{b_mean:.2f}; the slopes in batch and context from D's CPU per step while B "
                 f"concurrent streams of {_DECODE_TOKENS} tokens ran (B = {list(_BATCHES)}); ")
    else:
        extra = 0.0
        if d_first and d_rest:
            total = statistics.fmean(d_first) + statistics.fmean(d_rest)
            extra = max(0.0, (total - _SPIN_S - n * c1) / (1.0 - n / steps))
        s1 = c1 - extra / steps
        coef = nonneg_lstsq([[1.0, b, c] for b, c, _ in m.decode_cpu],
                            [t - extra * b / steps for b, _, t in m.decode_cpu])
        basis = (f"least squares over D's engine-core CPU seconds per engine step "
                 f"(vllm:iteration_tokens_total count) while B concurrent streams of "
                 f"{_DECODE_TOKENS} tokens ran through the proxy, push (B = {list(_BATCHES)}, "
                 f"prompt {_DECODE_PROMPT}; B = 4, prompt {_LONG_PROMPT}), less D's CPU per "
                 "request beyond its steps spread over them; ")
    doc["decode"].update(zip(("step_base_s", "per_seq_s", "per_ctx_token_s"), coef, strict=True))
    for k in ("step_base_s", "per_seq_s", "per_ctx_token_s"):
        src[f"decode.{k}"] = basis + tag
    admit = min(extra, max(0.0, statistics.fmean(d_first) - s1)) if d_first else 0.0
    extra_how = ("the load runs' fit against D's steps and requests, see decode.step_base_s"
                 if "step_s" in load else f"sequential {_HANDOFF_PROMPT}-token requests, {n} "
                 "steps and one spin removed, the steps' CPU from the decode rounds")
    prefill = pre["step_base_s"] + pre["per_token_s"] * _HANDOFF_PROMPT + \
        pre["per_token_ctx_s"] * _HANDOFF_PROMPT ** 2 / 2
    how = (f"sequential {_HANDOFF_PROMPT}-token, {n}-token requests through the proxy, pull and "
           "push, engine-core CPU sampled every 5 ms (idle burn removed)")
    return {
        "p_engine_request_s": (max(0.0, statistics.fmean(p_total) - prefill - _SPIN_S)
                               if p_total else 0.0,
                               f"P's engine CPU per request ({how}) less its prefill step and "
                               f"one spin; {tag}"),
        "d_engine_request_s": (admit, f"D's engine CPU from send to first token ({how}) less one "
                                      f"decode step; {tag}"),
        "d_engine_stream_s": (extra - admit,
                              f"D's engine CPU per request beyond its steps ({extra_how}) less "
                              f"d_engine_request_s; {tag}"),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="profile JSON to write")
    p.add_argument("--backend", choices=("nixl", "shm"), default="nixl",
                   help="kvbridge transport of the measured engines")
    p.add_argument("--reps", type=int, default=8, help="requests per measured point (2..100)")
    p.add_argument("--base", default="host",
                   help="profile whose unmeasured parameters (model shape, headroom) are kept")
    p.add_argument("--log-dir", type=Path, default=None, help="engine logs (default: temp dir)")
    p.add_argument("--cpu-modes", default="pull,push",
                   help="modes whose front-end CPU cost is measured with real `vllm bench serve` "
                        "runs (comma-separated; 'none' skips it)")


def cli_main(args: argparse.Namespace) -> int:
    if not 2 <= args.reps <= 100:
        raise ConfigError(f"--reps: 2..100, got {args.reps}")
    base = profile_to_dict(load_profile(args.base))
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvbridge-calibrate-"))

    def say(msg: str) -> None:
        print(f"[calibrate] {msg}", flush=True)

    cpu_modes: tuple[str, ...] = ()
    if args.cpu_modes.strip().lower() != "none":
        cpu_modes = parse_names(args.cpu_modes, ("pull", "push"), "--cpu-modes", "mode")
    m = measure(args.backend, args.reps, log_dir, say, cpu_modes)
    doc = derive(m, base, args.backend, socket.gethostname())
    calibration = doc.pop("calibration")
    parse_profile(doc, str(args.out))  # what we write must load
    doc["calibration"] = calibration
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    say(f"wrote {args.out}")
    return 0
