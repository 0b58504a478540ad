"""``kvbridge proxy`` and ``python -m kvbridge.proxy``: the flags, and serving until a signal.

:func:`add_arguments` defines the flags (one per :class:`~kvbridge.proxy.settings.ProxySettings`
field), :func:`settings_from_args` maps them, :func:`main` serves until SIGINT or SIGTERM and
returns the exit code (1 when the address cannot be bound; a bad value raises
:class:`~kvbridge.errors.ConfigError` before anything is bound). :data:`cli_main` is the name
:mod:`kvbridge.tools.cli`'s lazy subcommands look for; :func:`run` is ``python -m
kvbridge.proxy``. Meant for the main thread of a process of its own (it installs signal handlers
and runs its own event loop).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Sequence

from kvbridge.proxy.app import serve
from kvbridge.proxy.credit import KvAdmission
from kvbridge.proxy.planner import PlannerSettings
from kvbridge.proxy.routing import ProxyMode
from kvbridge.proxy.settings import ProxySettings
from kvbridge.values import LOG_LEVELS

__all__ = ["add_arguments", "build_parser", "settings_from_args", "main", "cli_main", "run"]

log = logging.getLogger("kvbridge.proxy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``kvbridge proxy`` flags."""
    parser.add_argument(
        "--prefill",
        nargs="+",
        default=[],
        metavar="URL",
        help="prefill engine URLs (http://host:port); never removed by discovery. Each role "
        "needs these, --ROLE-dns or --engines-file",
    )
    parser.add_argument(
        "--decode",
        nargs="+",
        default=[],
        metavar="URL",
        help="decode engine URLs (http://host:port); never removed by discovery",
    )
    parser.add_argument(
        "--prefill-dns",
        metavar="NAME[:PORT]",
        help="discovery: prefill engines are every A/AAAA address NAME resolves to (a headless "
        "Service), on PORT (default 8000), re-resolved every --discovery-interval",
    )
    parser.add_argument(
        "--decode-dns",
        metavar="NAME[:PORT]",
        help="discovery: decode engines are every address NAME resolves to, on PORT "
        "(default 8000)",
    )
    parser.add_argument(
        "--engines-file",
        metavar="PATH",
        help='discovery: a JSON file {"prefill": [URL...], "decode": [URL...]}, re-read when '
        "it changes (at most 1 MiB)",
    )
    parser.add_argument(
        "--discovery-interval",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds between two discovery rounds (default 5)",
    )
    parser.add_argument(
        "--mode",
        choices=ProxyMode.names(),
        default="auto",
        help="auto (the planner: local, push or pull per request by measured cost; plan is "
        "another name of it), push, pull, headroom (push or pull per request from live load: "
        "what auto was before the planner) or local (D alone, no P); a request's "
        "X-KVBridge-Mode header overrides it (default auto)",
    )
    parser.add_argument(
        "--plan-ttft-slo-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="auto: the TTFT SLO of a request without an X-KVBridge-TTFT-SLO-Ms header; the "
        "cheapest path meeting it wins (default 0: none, the fastest path wins)",
    )
    parser.add_argument(
        "--plan-tpot-slo-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="auto: the decode engines' TPOT SLO; while a D's recent TPOT is past 75%% of "
        "it, a request whose prefill would stall D's decodes is not served by D alone "
        "(default 0: no guard)",
    )
    parser.add_argument(
        "--plan-tie",
        type=float,
        default=0.1,
        metavar="F",
        help="auto: without an SLO, D alone wins when its estimate is within this share of "
        "the fastest path's, leaving P free (default 0.1)",
    )
    parser.add_argument(
        "--plan-explore-every",
        type=int,
        default=16,
        metavar="N",
        help="auto: one decision in N of a kind (prompt size, share held by D) goes to the "
        "path other than the cheapest measured longest ago for that kind, so each path's "
        "cost for requests like it stays current; while that path's prefilling engine has "
        "work queued, the first one after (default 16; 0: never)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind; 0 picks a free one")
    parser.add_argument(
        "--push-headroom",
        type=int,
        default=4,
        metavar="N",
        help="headroom: push while some D has fewer than N requests in flight",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="upper bound on one upstream exchange, seconds (default 600)",
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=3.0,
        metavar="S",
        help="upper bound on opening an upstream connection (default 3)",
    )
    parser.add_argument(
        "--control-timeout",
        type=float,
        default=1.0,
        metavar="S",
        help="upper bound on asking an engine's control channel why a transfer failed "
        "(default 1)",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=1,
        metavar="N",
        help="dispatch a request again, on engines it has not tried, at most N times when an "
        "engine failed it before any byte reached the client (default 1; 0: never)",
    )
    parser.add_argument(
        "--health-interval",
        type=float,
        default=2.0,
        metavar="S",
        help="check every engine's /health every S seconds; failing engines leave the "
        "rotation until they pass again (default 2; 0: no checks)",
    )
    parser.add_argument(
        "--health-failures",
        type=int,
        default=2,
        metavar="N",
        help="failed health checks in a row that take an engine out (a refused connection: "
        "at once; default 2)",
    )
    parser.add_argument(
        "--control-secret",
        default=os.environ.get("KVBRIDGE_SECRET") or None,
        metavar="SECRET",
        help="the engines' control-channel secret (default: $KVBRIDGE_SECRET)",
    )
    parser.add_argument(
        "--salt-from-header",
        default=os.environ.get("KVBRIDGE_SALT_FROM_HEADER") or None,
        metavar="HEADER",
        help="tenant isolation: set each request's cache_salt from this header (HMAC with the "
        "control secret) and ignore a cache_salt in the client's body; requests without the "
        "header get none (default: $KVBRIDGE_SALT_FROM_HEADER, else off)",
    )
    parser.add_argument(
        "--kv-admission",
        choices=[m.value for m in KvAdmission],
        default=os.environ.get("KVBRIDGE_KV_ADMISSION") or "off",
        help="admission by KV credit: send a request on only when a decode engine has KV for "
        "its prompt and max_tokens; when none has: reject (503 with Retry-After) or queue "
        "(then 503 after --kv-queue-s); off admits all (default: $KVBRIDGE_KV_ADMISSION, "
        "else off)",
    )
    parser.add_argument(
        "--kv-credit-fraction",
        type=float,
        default=1.0,
        metavar="F",
        help="share of each decode engine's KV cache this proxy commits: 1/N with N proxies "
        "in front of the same engines, above 1 overcommits (default 1)",
    )
    parser.add_argument(
        "--kv-queue",
        type=int,
        default=64,
        metavar="N",
        help="--kv-admission queue: most requests waiting for credit at once (default 64)",
    )
    parser.add_argument(
        "--kv-queue-s",
        type=float,
        default=30.0,
        metavar="S",
        help="--kv-admission queue: longest wait for credit before a 503 (default 30)",
    )
    parser.add_argument(
        "--kv-events",
        action="store_true",
        help="place requests by the prefixes the engines report in their KV events (engines "
             "started with a zmq --kv-events-config name the publisher in their probe); "
             "engines without fall back to what the proxy sent where",
    )
    parser.add_argument(
        "--otlp-traces-endpoint",
        default=os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or None,
        metavar="URL",
        help="OpenTelemetry: export a span per request, with one per prefill and decode leg, "
        "to this OTLP collector, and pass each leg's traceparent to its engine so vLLM's own "
        "spans join the trace (vLLM's flag; gRPC unless $OTEL_EXPORTER_OTLP_TRACES_PROTOCOL "
        "is http/protobuf; default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else off)",
    )
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default=argparse.SUPPRESS,  # kvbridge's own --log-level (before the command) otherwise
        help="level of the kvbridge loggers, any case (default: kvbridge --log-level, or INFO "
        "for python -m kvbridge.proxy)",
    )


def settings_from_args(args: argparse.Namespace) -> ProxySettings:
    return ProxySettings(
        prefill=tuple(args.prefill),
        decode=tuple(args.decode),
        mode=ProxyMode(args.mode),
        host=args.host,
        port=args.port,
        push_headroom=args.push_headroom,
        timeout_s=args.timeout,
        connect_timeout_s=args.connect_timeout,
        control_timeout_s=args.control_timeout,
        control_secret=args.control_secret,
        max_retries=args.retries,
        health_interval_s=args.health_interval,
        health_failures=args.health_failures,
        salt_header=args.salt_from_header,
        kv_admission=KvAdmission(args.kv_admission),
        kv_credit_fraction=args.kv_credit_fraction,
        kv_queue=args.kv_queue,
        kv_queue_s=args.kv_queue_s,
        kv_events=args.kv_events,
        prefill_dns=args.prefill_dns,
        decode_dns=args.decode_dns,
        engines_file=args.engines_file,
        discovery_interval_s=args.discovery_interval,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        plan=PlannerSettings(ttft_slo_ms=args.plan_ttft_slo_ms,
                             tpot_slo_ms=args.plan_tpot_slo_ms, tie=args.plan_tie,
                             explore_every=args.plan_explore_every),
    )


def main(args: argparse.Namespace) -> int:
    """Entry point of ``kvbridge proxy``: serve until SIGINT/SIGTERM; returns the exit code."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if getattr(args, "log_level", None):
        logging.getLogger("kvbridge").setLevel(str(args.log_level).upper())
    settings = settings_from_args(args)

    async def until_signal() -> None:
        task = asyncio.ensure_future(serve(settings))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    try:
        asyncio.run(until_signal())
    except OSError as exc:
        log.error("cannot serve on %s:%d: %s", settings.host, settings.port, exc)
        return 1
    return 0


def run(argv: Sequence[str] | None = None) -> int:
    """``python -m kvbridge.proxy``: parse ``argv`` (default: ``sys.argv``), then :func:`main`."""
    return main(build_parser().parse_args(argv))


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m kvbridge.proxy`` (:func:`add_arguments`, log level INFO)."""
    parser = argparse.ArgumentParser(
        prog="kvbridge proxy", description="kvbridge disaggregation proxy"
    )
    add_arguments(parser)
    parser.set_defaults(log_level="INFO")
    return parser


cli_main = main  # the name kvbridge.tools.cli's lazy subcommands look for
