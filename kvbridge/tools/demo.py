"""``kvbridge demo``: disaggregated prefill/decode with real vLLM engines on one CPU machine.

What it does (docs/demo.md has the expected output):

1. Builds the tiny random Qwen3 model into the cache directory (seconds; never downloads).
2. Starts one prefill engine P (``kv_producer``, pinned to core 0) and one decode engine D
   (``kv_consumer``, pinned to core 1), both running KVBridgeConnector with ``--backend``,
   concurrently, printing the elapsed time while they start (about a minute).
3. Starts one kvbridge proxy per mode in this process (pull, push and auto, the planner, unless
   ``--modes`` says otherwise, e.g. adds headroom; ports chosen by the OS) in front of P and D.
4. For each mode: one warm-up request, ``--requests`` sequential requests, then ``--requests``
   requests with ``--concurrency`` in flight; every request streams greedy output (``ignore_eos``)
   so time to first token and time per output token are measured at the client. Every mode uses
   fresh prompts, so neither engine can answer from its own prefix cache.
5. Computes the single-engine reference for every prompt by sending it straight to P without
   ``kv_transfer_params`` (greedy), after the proxied runs so the reference does not warm P's
   prefix cache for them, and checks every proxied output token for token against it.
6. Prints a TTFT/TPOT table (median, p90) per mode and phase, then PASS or FAIL.

Everything it started (engines, proxies, threads) is shut down on success, on error and on
Ctrl-C / SIGTERM. Engine logs are deleted unless ``--keep-logs`` is given or the demo failed.

The hidden ``--no-connector`` flag (a debugging aid) starts P and D as plain engines and only
compares direct greedy requests to P and to D; no proxy is involved.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import logging
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from kvbridge import trust
from kvbridge.errors import KVBridgeError
from kvbridge.tools.client import complete, output_token_ids, stream_complete
from kvbridge.tools.engines import EngineError, VllmServer, start_servers
from kvbridge.tools.report import percentile, table
from kvbridge.tools.tiny_model import build_tiny_model, default_cache_dir, random_prompts

__all__ = ["add_arguments", "main", "cli_main"]

log = logging.getLogger("kvbridge.tools.demo")

MODES = ("pull", "push", "auto", "headroom")
DEFAULT_MODES = ("pull", "push", "auto")
_P_ENGINE_ID = "demo-prefill"
_D_ENGINE_ID = "demo-decode"


# -- arguments ---------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``kvbridge demo`` flags."""
    parser.add_argument(
        "--backend", default="shm", help="kvbridge transport backend for P and D (default shm)"
    )
    parser.add_argument(
        "--requests", type=int, default=6, metavar="N",
        help="requests per mode and phase (sequential, then concurrent); default 6",
    )  # fmt: skip
    parser.add_argument(
        "--concurrency", type=int, default=4, metavar="C",
        help="requests in flight in the concurrent phase (default 4)",
    )  # fmt: skip
    parser.add_argument(
        "--prompt-len", type=int, default=256, metavar="T",
        help="prompt length in tokens (default 256)",
    )  # fmt: skip
    parser.add_argument(
        "--max-tokens", type=int, default=32, metavar="T",
        help="output tokens per request (default 32)",
    )  # fmt: skip
    parser.add_argument(
        "--modes", nargs="+", choices=MODES, default=list(DEFAULT_MODES),
        help="proxy modes to exercise: pull, push, auto (the planner: D alone, push or pull "
        "per request), headroom (push or pull by D's load) (default: pull push auto)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    parser.add_argument(
        "--keep-logs", action="store_true",
        help="keep the engine logs (they are always kept when the demo fails)",
    )  # fmt: skip
    parser.add_argument(
        "--work-dir", type=Path, default=None,
        help="where engine logs go (default: a new temporary directory)",
    )  # fmt: skip
    parser.add_argument(
        "--model-dir", type=Path, default=None,
        help=f"where the tiny model is built/cached (default {default_cache_dir()}/tiny-qwen3-s0)",
    )  # fmt: skip
    parser.add_argument(
        "--engine-timeout", type=float, default=360.0, metavar="S",
        help="how long to wait for the engines to start (default 360)",
    )  # fmt: skip
    parser.add_argument(
        "--request-timeout", type=float, default=120.0, metavar="S",
        help="upper bound on one request (default 120)",
    )  # fmt: skip
    parser.add_argument("--verbose", "-v", action="store_true", help="log kvbridge at INFO")
    parser.add_argument("--no-connector", action="store_true", help=argparse.SUPPRESS)
    # Tests swap the engine interpreter for a stand-in that speaks the same HTTP API.
    parser.add_argument("--engine-python", default=sys.executable, help=argparse.SUPPRESS)


# -- small helpers -----------------------------------------------------------------------------


def _say(msg: str) -> None:
    print(msg, flush=True)


def _ms(values: Sequence[float], q: float) -> str:
    v = percentile(values, q)
    return "-" if v is None else f"{v * 1000:.1f}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    return "\n".join(table(headers, rows, ["l", "l"] + ["r"] * (len(headers) - 2)))


def _progress(names: Sequence[str]) -> Any:
    def report(elapsed: float, ready: list[bool]) -> None:
        states = "  ".join(
            f"{n}: {'ready' if r else 'starting'}" for n, r in zip(names, ready, strict=True)
        )
        _say(f"  [{elapsed:5.0f} s] {states}")

    return report


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt in the main thread, so ``finally`` blocks run."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# -- the in-process proxies --------------------------------------------------------------------


def _proxies(p_url: str, d_url: str, modes: Sequence[str], timeout_s: float) -> Any:
    """One started :class:`~kvbridge.tools.proxies.ProxyThread` with a proxy per mode."""
    try:
        from kvbridge.tools.proxies import ProxyThread  # aiohttp: optional, said below
    except ImportError as exc:
        raise KVBridgeError(
            f"the kvbridge proxy cannot be loaded ({exc}); install: pip install "
            "'kvbridge[proxy]'"
        ) from exc
    return ProxyThread([p_url], [d_url], modes=modes, timeout_s=timeout_s).start()


def _decisions(proxies: Any, mode: str) -> dict[str, int]:
    """How many requests the proxy of *mode* sent by each path (auto's or headroom's choices)."""
    out: dict[str, int] = {}

    async def read() -> None:
        out.update(proxies.servers[mode].metrics.chosen_modes())

    with contextlib.suppress(Exception):
        proxies.call(read(), 5.0)
    return out


# -- requests ----------------------------------------------------------------------------------


@dataclass
class _Outcome:
    prompt_index: int
    token_ids: list[int] | None = None
    ttft: float | None = None
    tpot: float | None = None
    error: str | None = None
    matches: bool | None = None


@dataclass
class _Phase:
    mode: str
    name: str
    outcomes: list[_Outcome] = field(default_factory=list)


def _stream_one(url: str, index: int, prompt: list[int], args: argparse.Namespace) -> _Outcome:
    try:
        r = stream_complete(
            url, prompt, args.max_tokens, extra={"ignore_eos": True},
            timeout=args.request_timeout,
        )  # fmt: skip
    except KVBridgeError as exc:
        return _Outcome(index, error=str(exc).splitlines()[0][:300])
    return _Outcome(index, token_ids=r.token_ids, ttft=r.ttft, tpot=r.tpot)


def _run_phase(
    url: str,
    indices: Sequence[int],
    prompts: Sequence[list[int]],
    args: argparse.Namespace,
    concurrency: int,
) -> list[_Outcome]:
    if concurrency <= 1:
        return [_stream_one(url, i, prompts[i], args) for i in indices]
    pool = concurrent.futures.ThreadPoolExecutor(concurrency, thread_name_prefix="demo-client")
    try:
        futures = [pool.submit(_stream_one, url, i, prompts[i], args) for i in indices]
        return [f.result() for f in futures]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _reference(
    p_url: str, prompts: Sequence[list[int]], args: argparse.Namespace
) -> list[list[int] | None]:
    refs: list[list[int] | None] = []
    for prompt in prompts:
        try:
            resp = complete(
                p_url, prompt, args.max_tokens, extra={"ignore_eos": True},
                timeout=args.request_timeout,
            )  # fmt: skip
            refs.append(output_token_ids(resp))
        except KVBridgeError as exc:
            log.warning("reference request failed: %s", str(exc).splitlines()[0])
            refs.append(None)
    return refs


def _check(phases: Sequence[_Phase], refs: Sequence[list[int] | None]) -> int:
    """Mark each outcome; return how many failed (error, no reference, or mismatch)."""
    failed = 0
    for ph in phases:
        for o in ph.outcomes:
            ref = refs[o.prompt_index]
            o.matches = o.error is None and ref is not None and o.token_ids == ref
            if not o.matches:
                failed += 1
    return failed


def _report(phases: Sequence[_Phase]) -> str:
    rows = []
    for ph in phases:
        ok = [o for o in ph.outcomes if o.matches]
        ttft = [o.ttft for o in ph.outcomes if o.error is None and o.ttft is not None]
        tpot = [o.tpot for o in ph.outcomes if o.error is None and o.tpot is not None]
        rows.append([
            ph.mode, ph.name, len(ph.outcomes), len(ok),
            _ms(ttft, 50), _ms(ttft, 90), _ms(tpot, 50), _ms(tpot, 90),
        ])  # fmt: skip
    return _table(
        ["mode", "phase", "n", "match", "TTFT p50 ms", "TTFT p90 ms", "TPOT p50 ms", "TPOT p90 ms"],
        rows,
    )


def _first_failures(phases: Sequence[_Phase], refs: Sequence[list[int] | None]) -> list[str]:
    lines = []
    for ph in phases:
        for o in ph.outcomes:
            if o.matches:
                continue
            if o.error is not None:
                why = f"error: {o.error}"
            elif refs[o.prompt_index] is None:
                why = "no reference (the direct request to P failed)"
            else:
                ref = refs[o.prompt_index] or []
                got = o.token_ids or []
                at = next(
                    (k for k, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b),
                    min(len(got), len(ref)),
                )
                why = f"output differs from the reference at token {at}: {got[:8]}… vs {ref[:8]}…"
            lines.append(f"  {ph.mode}/{ph.name} prompt #{o.prompt_index}: {why}")
    return lines[:10]


# -- the demo ----------------------------------------------------------------------------------


def _engines(model: Path, work: Path, args: argparse.Namespace) -> tuple[VllmServer, VllmServer]:
    def kv(role: str, engine_id: str) -> dict[str, Any] | None:
        if args.no_connector:
            return None
        return {
            "kv_connector": "KVBridgeConnector",
            "kv_role": role,
            "engine_id": engine_id,
            "kv_connector_extra_config": {"backend": args.backend},
        }

    p = VllmServer(
        model, name="P", cpu_bind="0", log_path=work / "prefill.log",
        kv_transfer_config=kv("kv_producer", _P_ENGINE_ID), python=args.engine_python,
        env=_ENGINE_ENV, extra_args=_ENGINE_ARGS,
    )  # fmt: skip
    d = VllmServer(
        model, name="D", cpu_bind="1", log_path=work / "decode.log",
        kv_transfer_config=kv("kv_consumer", _D_ENGINE_ID), python=args.engine_python,
        env=_ENGINE_ENV, extra_args=_ENGINE_ARGS,
    )  # fmt: skip
    return p, d


#: On a small CPU host: stop idle engines from spinning a core each (see docs/usage.md), and use
#: 32-token blocks so every request moves several blocks.
_ENGINE_ENV = {"KVBRIDGE_ENGINE_SPIN_MS": "2"}
_ENGINE_ARGS = ["--block-size", "32"]


def _validate(args: argparse.Namespace) -> str | None:
    if args.requests < 1:
        return "--requests must be >= 1"
    if args.concurrency < 1:
        return "--concurrency must be >= 1"
    if args.max_tokens < 2:
        return "--max-tokens must be >= 2 (TPOT needs two tokens)"
    if not 1 <= args.prompt_len <= 1024 - args.max_tokens:
        return f"--prompt-len must be in [1, {1024 - args.max_tokens}] (max-model-len is 1024)"
    return None


def _run(args: argparse.Namespace, work: Path) -> bool:
    t_start = time.monotonic()
    _say("[1/5] building the tiny model …")
    model = build_tiny_model(args.model_dir, seed=0)
    _say(f"      {model}")

    p, d = _engines(model, work, args)
    what = "plain engines (--no-connector)" if args.no_connector else (
        f"KVBridgeConnector, backend {args.backend}"
    )  # fmt: skip
    _say(f"[2/5] starting P (core 0) and D (core 1): {what}; logs in {work}")
    if not args.no_connector:
        _say(f"      control channels {trust.for_tools().describe()} (no set-up needed on "
             "one host: docs/security.md)")
    proxies: Any = None
    try:
        start_servers(
            [p, d], timeout=args.engine_timeout, progress=_progress(["P", "D"]),
            progress_every=5.0,
        )  # fmt: skip
        _say(f"      P {p.url} and D {d.url} ready after {time.monotonic() - t_start:.0f} s")

        n = args.requests
        phases: list[_Phase] = []
        if args.no_connector:
            prompts = random_prompts(n, args.prompt_len, seed=args.seed * 1000 + 1)
            _say("[3/5] (--no-connector) no proxy")
            _say(f"[4/5] {n} greedy requests straight to D")
            ph = _Phase("direct-D", "sequential")
            ph.outcomes = _run_phase(d.url, range(n), prompts, args, 1)
            phases.append(ph)
        else:
            per_mode = 1 + 2 * n  # warm-up, sequential, concurrent
            prompts = []
            for k, _mode in enumerate(args.modes):
                prompts += random_prompts(per_mode, args.prompt_len, seed=args.seed * 1000 + k + 1)
            proxies = _proxies(p.url, d.url, args.modes, args.request_timeout)
            urls = proxies.urls
            _say("[3/5] proxies: " + ", ".join(f"{m} {u}" for m, u in urls.items()))
            _say(
                f"[4/5] per mode: 1 warm-up, {n} sequential, {n} with {args.concurrency} in "
                f"flight; prompt {args.prompt_len} tokens, {args.max_tokens} output tokens"
            )
            for k, mode in enumerate(args.modes):
                base = k * per_mode
                plan = [
                    ("warm-up", [base], 1),
                    ("sequential", list(range(base + 1, base + 1 + n)), 1),
                    ("concurrent", list(range(base + 1 + n, base + per_mode)), args.concurrency),
                ]
                for name, idx, conc in plan:
                    t0 = time.monotonic()
                    ph = _Phase(mode, name, _run_phase(urls[mode], idx, prompts, args, conc))
                    phases.append(ph)
                    errors = sum(o.error is not None for o in ph.outcomes)
                    _say(
                        f"      {mode:<4} {name:<10} {len(idx)} requests in "
                        f"{time.monotonic() - t0:5.1f} s" + (f", {errors} failed" if errors else "")
                    )
                if mode in ("auto", "headroom"):
                    chosen = _decisions(proxies, mode)
                    _say(f"      {mode} chose: "
                         + ", ".join(f"{k} {v}" for k, v in sorted(chosen.items())))

        _say(f"[5/5] single-engine reference: {len(prompts)} greedy requests straight to P")
        refs = _reference(p.url, prompts, args)
        failed = _check(phases, refs)
        _say("")
        _say(_report(phases))
        _say("")
        for line in _first_failures(phases, refs):
            _say(line)
        total = sum(len(ph.outcomes) for ph in phases)
        verdict = "PASS" if failed == 0 else "FAIL"
        _say(
            f"{verdict}: {total - failed}/{total} outputs equal the single-engine reference "
            f"({time.monotonic() - t_start:.0f} s in all)"
        )
        return failed == 0
    finally:
        _say("shutting down …")
        if proxies is not None:
            proxies.close()
        for s in (d, p):
            s.stop()


def main(args: argparse.Namespace) -> int:
    """Run the demo; returns 0 on PASS, 1 on FAIL or error, 130 on Ctrl-C."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kvbridge").setLevel(logging.INFO if args.verbose else logging.WARNING)
    why = _validate(args)
    if why is not None:
        print(f"kvbridge demo: error: {why}", file=sys.stderr)
        return 2
    owned = args.work_dir is None
    work = Path(tempfile.mkdtemp(prefix="kvbridge-demo-")) if owned else Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    ok = False
    try:
        with _sigterm_as_interrupt():
            ok = _run(args, work)
        return 0 if ok else 1
    except KeyboardInterrupt:
        _say("interrupted; everything was shut down")
        return 130
    except EngineError as exc:
        _say(f"FAIL: {exc}")
        return 1
    except KVBridgeError as exc:
        _say(f"FAIL: {exc}")
        return 1
    finally:
        if ok and owned and not args.keep_logs:
            shutil.rmtree(work, ignore_errors=True)
        else:
            _say(f"engine logs kept in {work}")


cli_main = main  # the name kvbridge.tools.cli's lazy subcommands look for


def _cli(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvbridge demo",
        description="Disaggregated prefill/decode demo with real vLLM engines on this machine.",
    )
    add_arguments(parser)
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(_cli())
