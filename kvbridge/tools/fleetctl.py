"""``kvbridge engines`` and ``kvbridge drain``: run a proxy's fleet from the command line.

A client of the proxy's ``/admin`` endpoints (:mod:`kvbridge.proxy.admin`)::

    kvbridge engines                          # every engine: state, load, hand-offs
    kvbridge engines add decode http://10.0.0.9:8100
    kvbridge engines drain http://10.0.0.7:8100 [--wait 600]
    kvbridge engines resume http://10.0.0.7:8100
    kvbridge engines remove http://10.0.0.7:8100 [--force]
    kvbridge drain http://10.0.0.7:8100       # = engines drain --wait 600: returns once drained

``--proxy`` (default ``$KVBRIDGE_PROXY_URL``, else ``http://127.0.0.1:8000``) names the proxy;
the bearer token is :func:`kvbridge.trust.admin_token` of ``--control-secret`` /
``KVBRIDGE_SECRET``, else of this user's per-host secret, as the proxy computes it. Only the
standard library; every call blocks with a timeout; a refusal is one line naming what the proxy
said (exit status 1), an engine still draining when ``--wait`` ran out is exit status 3.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from kvbridge import trust
from kvbridge.errors import KVBridgeError
from kvbridge.tools.report import print_json, print_table

__all__ = ["AdminClient", "add_arguments", "add_drain_arguments", "cli_main", "drain_main"]

DEFAULT_PROXY = "http://127.0.0.1:8000"
_COLUMNS = ("url", "role", "state", "in_flight", "handoffs", "requests", "errors")
EXIT_STILL_DRAINING = 3


class AdminError(KVBridgeError):
    """The proxy refused or did not answer an admin request."""


class AdminClient:
    """Calls one proxy's ``/admin`` endpoints (blocking, bounded by ``timeout_s``)."""

    def __init__(self, proxy: str, secret: str | None = None, timeout_s: float = 10.0) -> None:
        self.proxy = proxy.rstrip("/")
        if "://" not in self.proxy:
            self.proxy = "http://" + self.proxy
        key = trust.for_tools(secret).secret
        if key is None:
            raise AdminError("no secret to sign admin requests with (the proxy's admin "
                             "endpoints are off without one): set KVBRIDGE_SECRET")
        self._token = trust.admin_token(key)
        self.timeout_s = timeout_s

    def call(self, method: str, path: str, query: dict[str, str] | None = None,
             body: Any = None) -> Any:
        url = self.proxy + path
        if query:
            url += "?" + urllib.parse.urlencode(query)
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, method=method, headers={
            "Authorization": f"Bearer {self._token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            raise AdminError(f"{method} {path}: {_message(exc)}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise AdminError(f"cannot reach the proxy at {self.proxy}: "
                             f"{getattr(exc, 'reason', exc)}") from None

    def engines(self) -> list[dict[str, Any]]:
        return list(self.call("GET", "/admin/engines")["engines"])

    def drain(self, url: str) -> dict[str, Any]:
        return dict(self.call("POST", "/admin/drain", {"engine": url}))

    def resume(self, url: str) -> dict[str, Any]:
        return dict(self.call("POST", "/admin/resume", {"engine": url}))

    def add(self, role: str, url: str) -> dict[str, Any]:
        return dict(self.call("POST", "/admin/engines", body={"role": role, "url": url}))

    def remove(self, url: str, force: bool = False) -> dict[str, Any]:
        query = {"engine": url, **({"force": "1"} if force else {})}
        return dict(self.call("DELETE", "/admin/engines", query))

    def wait_drained(self, url: str, timeout_s: float, interval_s: float = 0.5
                     ) -> dict[str, Any]:
        """Poll until the engine at ``url`` is drained (or dead); returns its last row, drained
        or not once ``timeout_s`` ran out."""
        deadline = time.monotonic() + timeout_s
        while True:
            row = next((r for r in self.engines() if r["url"] == url.rstrip("/")), None)
            if row is None:
                raise AdminError(f"{url} is no longer an engine of the proxy")
            if row["state"] in ("drained", "dead") or time.monotonic() >= deadline:
                return row
            time.sleep(interval_s)


def _message(exc: urllib.error.HTTPError) -> str:
    try:
        err = json.loads(exc.read(64 << 10))["error"]
        return f"HTTP {exc.code}: {err['message']}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {exc.code}"


def _client(args: argparse.Namespace) -> AdminClient:
    return AdminClient(args.proxy, args.control_secret, args.timeout)


def _show(rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        print_json(rows)
    else:
        print_table(_COLUMNS, [[r.get(c, "") for c in _COLUMNS] for r in rows])


def _common(p: argparse.ArgumentParser, sub: bool = False) -> None:
    """The options every action takes; on an action's parser (``sub``) they default to
    nothing, so ``kvbridge engines --proxy X drain URL`` and ``… drain URL --proxy X`` agree."""
    def default(value: Any) -> Any:
        return argparse.SUPPRESS if sub else value

    p.add_argument("--proxy", default=default(os.environ.get("KVBRIDGE_PROXY_URL")
                                              or DEFAULT_PROXY),
                   metavar="URL", help="the proxy (default: $KVBRIDGE_PROXY_URL, else "
                   f"{DEFAULT_PROXY})")
    p.add_argument("--control-secret", default=default(os.environ.get("KVBRIDGE_SECRET")
                                                       or None),
                   metavar="SECRET", help="the fleet secret the proxy runs with (default: "
                   "$KVBRIDGE_SECRET, else this user's per-host secret)")
    p.add_argument("--timeout", type=float, default=default(10.0), metavar="S",
                   help="bound on each request to the proxy, seconds (default 10)")
    p.add_argument("--json", action="store_true", default=default(False),
                   help="print JSON instead of a table")


def _wait_arg(p: argparse.ArgumentParser, default: float) -> None:
    p.add_argument("--wait", type=float, default=default, metavar="S",
                   help="drain: return once the engine is drained, waiting at most S seconds "
                   f"(0: do not wait; default {default:g})")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``kvbridge engines``."""
    _common(parser)
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    ls = sub.add_parser("list", help="every engine: state, load, hand-offs (the default)")
    a = sub.add_parser("add", help="add an engine; it joins once /health (and for a P the "
                       "probe) passes")
    a.add_argument("role", choices=("prefill", "decode"), help="what the engine does")
    a.add_argument("url", help="the engine's base URL, http://host:port")
    d = sub.add_parser("drain", help="send it no new requests; what it serves runs to its end")
    d.add_argument("url", help="the engine's base URL")
    _wait_arg(d, 0.0)
    r = sub.add_parser("resume", help="undo a drain")
    r.add_argument("url", help="the engine's base URL")
    rm = sub.add_parser("remove", help="forget an engine (refused while it serves something)")
    rm.add_argument("url", help="the engine's base URL")
    rm.add_argument("--force", action="store_true",
                    help="remove it even while it serves requests (they run on, unrouted)")
    for p in (ls, a, d, r, rm):
        _common(p, sub=True)
    parser.set_defaults(action="list")


def add_drain_arguments(parser: argparse.ArgumentParser) -> None:
    """``kvbridge drain``."""
    parser.add_argument("url", help="the engine's base URL, http://host:port")
    _common(parser)
    _wait_arg(parser, 600.0)


def _drain(client: AdminClient, url: str, wait_s: float, as_json: bool) -> int:
    row = client.drain(url)
    if wait_s > 0 and row["state"] not in ("drained", "dead"):
        row = client.wait_drained(row["url"], wait_s)
    _show([row], as_json)
    if row["state"] in ("drained", "dead") or wait_s <= 0:
        return 0
    print(f"kvbridge: {row['url']} is still draining after {wait_s:g}s "
          f"({row['in_flight']} requests, {row['handoffs']} hand-offs)")
    return EXIT_STILL_DRAINING


def cli_main(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.action == "list":
        _show(client.engines(), args.json)
        return 0
    if args.action == "drain":
        return _drain(client, args.url, args.wait, args.json)
    if args.action == "add":
        row = client.add(args.role, args.url)
    elif args.action == "resume":
        row = client.resume(args.url)
    else:
        row = client.remove(args.url, args.force)
    _show([row], args.json)
    return 0


def drain_main(args: argparse.Namespace) -> int:
    return _drain(_client(args), args.url, args.wait, args.json)
