"""The kvbridge Grafana dashboard, generated with grafana-foundation-sdk (`kvbridge dashboards`).

Contract:

* :data:`ROWS` is the dashboard's content as data: rows of :class:`PanelSpec`, each with its
  :class:`Query` list. Every query names only series kvbridge exports today (docs/metrics.md):
  the engines' ``vllm:kvbridge_*`` and the proxy's ``kvbridge_proxy_*``. Range windows are
  Grafana's ``$__rate_interval``; the data source is the ``datasource`` variable.
* :func:`queries` lists every panel query; a query whose :attr:`Query.sparse` is not empty may
  return nothing on a healthy fleet, and that text says why. Every other query returns data from
  a Prometheus scraping one P, one D and the proxy after a few requests
  (``tests/engines/test_prometheus.py`` evaluates each one).
* :func:`build` returns the dashboard model (the SDK's object), :func:`render` its JSON text
  (sorted keys, two-space indent, trailing newline): the committed
  ``deploy/grafana/kvbridge.json`` must equal it (``tests/unit/test_dashboards.py``).

Not shown yet: a KV credit panel (no such series exists).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Query", "PanelSpec", "ROWS", "UID", "FILE_NAME", "RATE", "queries", "build",
           "render", "add_arguments", "cli_main"]

#: The dashboard's stable uid (links and provisioning keep working across regenerations).
UID = "kvbridge-pd"
#: The file ``kvbridge dashboards --out DIR`` writes, and the name under deploy/grafana/.
FILE_NAME = "kvbridge.json"
#: Grafana's range window for rate()/increase(); tests substitute a fixed window.
RATE = "$__rate_interval"

#: Engine counters that should stay at zero (all published at zero per engine).
FAILURE_COUNTERS = ("checksum_mismatch", "lease_expired", "push_timeout", "transfer_timeout",
                    "handoff_stalled",
                    "push_failed", "recv_failed", "peer_gone", "params_rejected",
                    "offload_load_failed")


@dataclass(frozen=True)
class Query:
    """One PromQL target: expression, legend, and why it may be empty (``""``: it must not)."""

    expr: str
    legend: str
    sparse: str = ""


@dataclass(frozen=True)
class PanelSpec:
    """One time-series panel."""

    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]


def _rate(metric: str, by: str, selector: str = "", fn: str = "rate") -> str:
    return f"sum by ({by}) ({fn}({metric}{selector}[{RATE}]))"


def _quantile(q: float, metric: str, by: str) -> str:
    return f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket[{RATE}])))"


_PEER = "mode, backend, peer"
_LABELLED_ON_FIRST = ("a labelled child is created by its first occurrence; the unlabelled "
                      "counters of the panel beside it are published at zero")

_ADMISSION_ONLY = "published only by proxies with --kv-admission reject or queue"

ROWS: tuple[tuple[str, tuple[PanelSpec, ...]], ...] = (
    ("Hand-offs", (
        PanelSpec("Requests at the proxy", "Client requests by the mode used and outcome.",
                  "reqps", (Query(_rate("kvbridge_proxy_requests_total", "mode, outcome"),
                                  "{{mode}} {{outcome}}"),)),
        PanelSpec("Hand-offs on D", "Requests whose KV arrived complete, did not arrive "
                  "(recomputed or failed per policy), or were found in D's own prefix cache.",
                  "ops", tuple(Query(_rate(f"vllm:kvbridge_{n}_total", "instance"),
                                     f"{n} {{{{instance}}}}")
                               for n in ("recv_ok", "recv_failed", "recv_full_local_hit"))),
        PanelSpec("Transfers by outcome", "Finished READ (pull, on D) and WRITE (push, on P) "
                  "transfers.", "ops",
                  (Query(_rate("vllm:kvbridge_transfers_total", f"{_PEER}, outcome"),
                         "{{mode}} {{backend}} {{peer}} {{outcome}}"),)),
        PanelSpec("The planner's and headroom's choices",
                  "What auto (the planner; plan is its other name) and headroom (push or pull "
                  "by D's load) chose, and why; a request's X-KVBridge-Mode counts under the "
                  "mode it named.", "ops",
                  (Query(_rate("kvbridge_proxy_mode_decisions_total",
                               "configured, chosen, reason", '{configured=~"auto|headroom"}'),
                         "{{configured}}: {{chosen}} ({{reason}})",
                         sparse="only requests in auto or headroom mode are decided"),)),
    )),
    ("TTFT phases", (
        PanelSpec("TTFT at the proxy", "Time to the first streamed byte, p50 and p99.", "s",
                  (Query(_quantile(0.5, "kvbridge_proxy_ttft_seconds", "mode"), "p50 {{mode}}"),
                   Query(_quantile(0.99, "kvbridge_proxy_ttft_seconds", "mode"),
                         "p99 {{mode}}"))),
        PanelSpec("Phases, p99", "P's prefill leg at the proxy, D's hand-off (load started to "
                  "KV usable), the transfer on the wire, and each role's time to headers.", "s",
                  (Query(_quantile(0.99, "kvbridge_proxy_prefill_leg_seconds", "mode"),
                         "prefill leg {{mode}}"),
                   Query(_quantile(0.99, "vllm:kvbridge_handoff_seconds", "mode"),
                         "hand-off {{mode}}"),
                   Query(_quantile(0.99, "vllm:kvbridge_transfer_seconds", "mode"),
                         "transfer {{mode}}"),
                   Query(_quantile(0.99, "kvbridge_proxy_upstream_seconds", "role"),
                         "upstream {{role}}"))),
        PanelSpec("Hand-off phases (flight recorder)", "Each phase the engines timed on their "
                  "own clock (docs/why.md), p50 and p99 of each. queue: vLLM's waiting "
                  "queue; prefill: P's forward; post: KV ready to WRITE posted; wire: the "
                  "transfer; plan, claim: D's receive set up; notified, first_step: D's "
                  "scheduler learns and schedules.", "s",
                  (Query(_quantile(0.5, "vllm:kvbridge_phase_seconds", "phase"), "p50 {{phase}}"),
                   Query(_quantile(0.99, "vllm:kvbridge_phase_seconds", "phase"),
                         "p99 {{phase}}"))),
        PanelSpec("Request duration, p99", "Request received to response done, at the proxy.",
                  "s", (Query(_quantile(0.99, "kvbridge_proxy_request_duration_seconds", "mode"),
                              "{{mode}}"),)),
        PanelSpec("Wait in the proxy's socket", "How long requests waited in the proxy's "
                  "socket before its handler ran, p50 and p99 (a lower bound from the kernel; "
                  "0 under one scheduler tick). A growing tail is the proxy, or its host, "
                  "falling behind.", "s",
                  (Query(_quantile(0.5, "kvbridge_proxy_socket_wait_seconds", "instance"),
                         "p50 {{instance}}"),
                   Query(_quantile(0.99, "kvbridge_proxy_socket_wait_seconds", "instance"),
                         "p99 {{instance}}"))),
    )),
    ("Transfers per backend and peer", (
        PanelSpec("KV bytes per second", "Bytes of finished transfers.", "Bps",
                  (Query(_rate("vllm:kvbridge_transfer_bytes_sum", _PEER),
                         "{{mode}} {{backend}} {{peer}}"),)),
        PanelSpec("Transfer seconds, p99", "One transfer on the wire.", "s",
                  (Query(_quantile(0.99, "vllm:kvbridge_transfer_seconds", _PEER),
                         "{{mode}} {{backend}} {{peer}}"),)),
        PanelSpec("Transfer seconds, mean", "Wire time per transfer.", "s",
                  (Query(f"{_rate('vllm:kvbridge_transfer_seconds_sum', _PEER)} / "
                         f"{_rate('vllm:kvbridge_transfer_seconds_count', _PEER)}",
                         "{{mode}} {{backend}} {{peer}}"),)),
        PanelSpec("Bytes per engine", "Bytes D read (pull), P wrote (push) and D received "
                  "(push).", "Bps",
                  tuple(Query(_rate(f"vllm:kvbridge_{n}_total", "instance"),
                              f"{n} {{{{instance}}}}")
                        for n in ("pull_bytes", "push_bytes", "push_received_bytes"))),
    )),
    ("Offload tiers", (
        PanelSpec("Tier lookups and hits", "Tier lookups, requests served partly from a tier, "
                  "requests stored to the tiers.", "ops",
                  tuple(Query(_rate(f"vllm:kvbridge_{n}_total", "instance"),
                              f"{n} {{{{instance}}}}")
                        for n in ("offload_lookups", "offload_hit_requests",
                                  "offload_store_requests"))),
        PanelSpec("Prompt tokens from tiers", "Prompt tokens loaded from an offload tier.",
                  "short", (Query(_rate("vllm:kvbridge_offload_hit_tokens_total", "instance"),
                                  "{{instance}}"),)),
    )),
    ("Errors (should stay at zero)", (
        PanelSpec("Engine failure counters", "Increase per window of every engine counter that "
                  "should stay at zero (docs/metrics.md, alerts).", "short",
                  tuple(Query(_rate(f"vllm:kvbridge_{n}_total", "instance", fn="increase"),
                              f"{n} {{{{instance}}}}") for n in FAILURE_COUNTERS)),
        PanelSpec("Failure events by peer", "The same failures with mode, backend and peer, "
                  "and hand-offs D gave up (handoff_stalled).", "short",
                  (Query(_rate("vllm:kvbridge_events_total", "event, mode, backend, peer",
                               fn="increase"), "{{event}} {{mode}} {{backend}} {{peer}}",
                         sparse=_LABELLED_ON_FIRST),)),
        PanelSpec("Proxy retries and errors", "Dispatches made again after an engine failed "
                  "one, failed legs by kind, connection failures per engine.", "short",
                  (Query(_rate("kvbridge_proxy_retries_total", "mode, reason", fn="increase"),
                         "retry {{mode}} {{reason}}"),
                   Query(_rate("kvbridge_proxy_errors_total", "kind", fn="increase"),
                         "error {{kind}}", sparse="labelled by an open set of kinds, each "
                         "created by its first error; requests by outcome show them too"),
                   Query(_rate("kvbridge_proxy_engine_errors_total", "role, engine",
                               fn="increase"), "engine errors {{role}} {{engine}}"))),
        PanelSpec("Engines in rotation", "1 while the proxy routes to the engine, 0 while it "
                  "is out of rotation; open requests per engine.", "short",
                  (Query("min by (role, engine) (kvbridge_proxy_engine_up)",
                         "up {{role}} {{engine}}"),
                   Query("sum by (role, engine) (kvbridge_proxy_in_flight)",
                         "in flight {{role}} {{engine}}"))),
        PanelSpec("Engine states", "Each engine's state at the proxy (joining, active, "
                  "draining, drained, dead: docs/proxy.md, fleet operations) and the hand-offs "
                  "it serves beyond its open requests (a draining P is drained at 0).", "short",
                  (Query("max by (role, engine, state) (kvbridge_proxy_engine_state) == 1",
                         "{{state}} {{role}} {{engine}}"),
                   Query("sum by (role, engine) (kvbridge_proxy_engine_handoffs)",
                         "hand-offs {{role}} {{engine}}"))),
        PanelSpec("KV credit", "Blocks of KV each decode engine may still be given, its "
                  "capacity, and requests waiting for credit (--kv-admission).", "short",
                  (Query("min by (engine) (kvbridge_proxy_kv_credit_blocks)",
                         "credit {{engine}}", sparse=_ADMISSION_ONLY),
                   Query("max by (engine) (kvbridge_proxy_kv_capacity_blocks)",
                         "capacity {{engine}}", sparse=_ADMISSION_ONLY),
                   Query("sum (kvbridge_proxy_kv_queued)", "waiting for credit",
                         sparse=_ADMISSION_ONLY))),
    )),
)


def queries() -> list[Query]:
    """Every panel query, in dashboard order."""
    return [q for _, panels in ROWS for p in panels for q in p.queries]


def build() -> Any:
    """The dashboard model (``grafana_foundation_sdk.models.dashboard.Dashboard``)."""
    from grafana_foundation_sdk.builders import common, dashboard, prometheus, timeseries
    from grafana_foundation_sdk.models import common as common_models
    from grafana_foundation_sdk.models.dashboard import DataSourceRef

    ds = DataSourceRef(type_val="prometheus", uid="${datasource}")
    board = (dashboard.Dashboard("kvbridge: disaggregated prefill/decode")
             .uid(UID).tags(["kvbridge", "vllm"]).refresh("30s").time("now-1h", "now")
             .description("Hand-offs, TTFT phases, transfers per backend and peer, offload "
                          "tiers and failures of kvbridge engines and proxies (docs/metrics.md)")
             .with_variable(dashboard.DatasourceVariable("datasource").label("Data source")
                            .type("prometheus")))
    ids = iter(range(1, 1000))
    for row_title, panels in ROWS:
        board = board.with_row(dashboard.Row(row_title).id(next(ids)))
        for spec in panels:
            panel = (timeseries.Panel().id(next(ids)).title(spec.title)
                     .description(spec.description).unit(spec.unit).datasource(ds).height(8).span(12)
                     .legend(common.VizLegendOptions().show_legend(True)
                             .display_mode(common_models.LegendDisplayMode.LIST)
                             .placement(common_models.LegendPlacement.BOTTOM)))
            for i, q in enumerate(spec.queries):
                panel = panel.with_target(prometheus.Dataquery().expr(q.expr)
                                          .legend_format(q.legend).ref_id(chr(ord("A") + i)))
            board = board.with_panel(panel)
    return board.build()


def render() -> str:
    """The dashboard's JSON text, as committed in deploy/grafana/kvbridge.json."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder

    model = json.loads(JSONEncoder().encode(build()))
    return json.dumps(model, indent=2, sort_keys=True) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("."),
                        help=f"directory to write {FILE_NAME} into (created if missing)")
    parser.add_argument("--check", action="store_true",
                        help=f"write nothing; exit 1 if DIR/{FILE_NAME} differs from the "
                        "generated dashboard")


def cli_main(args: argparse.Namespace) -> int:
    """Write (or, with --check, compare) the dashboard JSON."""
    text = render()
    path: Path = args.out / FILE_NAME
    if args.check:
        same = path.is_file() and path.read_text() == text
        print(f"{path}: {'up to date' if same else 'differs from the generated dashboard'}")
        return 0 if same else 1
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path} ({len(queries())} queries)")
    return 0
