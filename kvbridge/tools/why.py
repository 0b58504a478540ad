"""``kvbridge why <request-id>``: one request's critical path, from the proxy's flight records.

A client of the proxy's ``GET /admin/why/<request-id>`` (:mod:`kvbridge.proxy.admin`, joined by
:func:`kvbridge.proxy.flight.critical_path`); the request id is the ``X-Request-Id`` header of
the proxy's answer. Prints the phases as a table (milliseconds, share of the time to first
token; a ``*`` marks a hop between processes, whose split depends on the hosts' clocks agreeing),
or ``--json`` the proxy's answer; ``--plot FILE.png`` also draws the phases as a timeline
(needs matplotlib; without it, one line saying so and exit status 1). ``--proxy``,
``--control-secret`` and ``--timeout`` as for ``kvbridge engines``. Blocking, bounded by
``--timeout``; a refusal is one line naming what the proxy said (exit status 1).
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.parse
from typing import Any

from kvbridge.tools.fleetctl import DEFAULT_PROXY, AdminClient, AdminError
from kvbridge.tools.report import print_json, table

__all__ = ["add_arguments", "cli_main", "format_why", "render_why", "plot_why"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("request_id", metavar="REQUEST_ID",
                   help="the proxy's request id (the X-Request-Id header of its answer)")
    p.add_argument("--proxy", default=os.environ.get("KVBRIDGE_PROXY_URL") or DEFAULT_PROXY,
                   metavar="URL", help="the proxy (default: $KVBRIDGE_PROXY_URL, else "
                   f"{DEFAULT_PROXY})")
    p.add_argument("--control-secret", default=os.environ.get("KVBRIDGE_SECRET") or None,
                   metavar="SECRET", help="the fleet secret the proxy runs with (default: "
                   "$KVBRIDGE_SECRET, else this user's per-host secret)")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S",
                   help="bound on the request to the proxy, seconds (default 10)")
    p.add_argument("--json", action="store_true", help="print the proxy's answer as JSON")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="also draw the phases as a timeline into FILE.png (needs matplotlib)")


def format_why(row: dict[str, Any]) -> tuple[list[str], list[list[object]]]:
    """The heading lines and the table rows of one ``/admin/why`` answer."""
    phases = row.get("phases") or []
    total = sum(p["seconds"] for p in phases)
    head = [f"request {row.get('request_id')}  mode {row.get('mode')}  transfer "
            f"{row.get('transfer_id') or '-'}  retries {row.get('retries', 0)}  outcome "
            f"{row.get('outcome') or 'running'}",
            f"P {row.get('prefill') or '-'}  D {row.get('decode') or '-'}"]
    for side, note in sorted((row.get("engines") or {}).items()):
        if not note.endswith(": recorded"):
            head.append(f"{side}: {note}")
    if not phases:
        head.append("no critical path yet: the proxy has not sent the first token")
        return head, []
    head.append(f"time to first token (proxy): {total * 1e3:.1f} ms; * = hop between "
                "processes (its split depends on the clocks agreeing; the sum does not)")
    rows: list[list[object]] = []
    for p in phases:
        share = 100.0 * p["seconds"] / total if total > 0 else 0.0
        rows.append([p["phase"] + (" *" if p["hop"] else ""), f"{p['seconds'] * 1e3:.2f}",
                     f"{share:.1f}", "#" * max(0, round(share / 4)), f"{p['from']} → {p['to']}"])
    return head, rows


def render_why(row: dict[str, Any], width: int | None = None) -> list[str]:
    """What ``kvbridge why`` prints of one answer: the heading, then the table."""
    head, rows = format_why(row)
    if not rows:
        return head
    return [*head, *table(["phase", "ms", "%", "", "from → to"], rows, list("lrrll"), width)]


def plot_why(row: dict[str, Any], path: str) -> None:
    """The phases of one answer as a timeline PNG. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = row.get("phases") or []
    fig, ax = plt.subplots(figsize=(10, 0.4 * len(phases) + 1.5))
    start = 0.0
    for i, p in enumerate(phases):
        ms = p["seconds"] * 1e3
        ax.broken_barh([(start, max(ms, 0.01))], (i - 0.4, 0.8),
                       color="tab:orange" if p["hop"] else "tab:blue")
        start += ms
    ax.set_yticks(range(len(phases)), [p["phase"] for p in phases])
    ax.invert_yaxis()
    ax.set_xlabel("ms after the request reached the proxy")
    ax.set_title(f"{row.get('request_id')} ({row.get('mode')}): time to first token "
                 f"{start:.1f} ms (orange: hop between processes)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def cli_main(args: argparse.Namespace) -> int:
    try:
        client = AdminClient(args.proxy, args.control_secret, args.timeout)
        row = client.call("GET", "/admin/why/" + urllib.parse.quote(args.request_id, safe=""))
    except AdminError as exc:
        print(f"kvbridge why: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print_json(row)
    else:
        print("\n".join(render_why(row)))
    if args.plot:
        try:
            plot_why(row, args.plot)
        except ImportError:
            print("kvbridge why: --plot needs matplotlib (pip install matplotlib)",
                  file=sys.stderr)
            return 1
    return 0
