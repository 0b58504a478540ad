"""One HTTP endpoint in front of a vLLM P/D pair that speaks vLLM's *stock* NIXL protocols.

``vllm bench serve`` needs one ``/v1/completions`` URL. The kvbridge proxy
(:mod:`kvbridge.proxy.app`) speaks kvbridge's protocol; vLLM's own ``NixlConnector`` and
``NixlPushConnector`` need vLLM's, exactly as :mod:`kvbridge.tools.bench.dispatch` dispatches them:

``pull`` (``NixlConnector``)
    P leg: the client's body with ``max_tokens=1``, not streamed (``stream_options``,
    ``min_tokens`` dropped), ``kv_transfer_params`` =
    :func:`~kvbridge.tools.bench.dispatch.vllm_pull_params`.
    Then D: the client's body unchanged except ``kv_transfer_params`` = what P answered.
``push`` (``NixlPushConnector``)
    Both legs at once with the same fresh ``X-Request-Id``: P as above plus a ``transfer_id``, D
    told P's engine id and side-channel port
    (:func:`~kvbridge.tools.bench.dispatch.vllm_push_params`).
    A P leg that fails before D's first byte aborts D (502); one that fails later is logged and
    counted (``stats["p_failed_late"]``), since D's answer has already gone out.

D's answer is relayed as it comes (SSE chunks as they arrive; a non-streamed answer whole).

Bounds: binds 127.0.0.1 only, on a free port; at most ``max_in_flight`` requests at a time
(more get 503); bodies up to 16 MiB; every upstream call has a connect timeout and a total
timeout. A client that goes away cancels its handler, which closes its upstream connections (vLLM
then aborts the request). :class:`StockProxyThread` runs the server on its own event-loop thread;
:meth:`StockProxyThread.close` is idempotent and also runs at interpreter exit. ``python -m
kvbridge.tools.bench.proxy`` runs one as a process until SIGTERM or SIGINT (``kvbridge bench
serve`` does, as it runs the kvbridge proxy: :class:`~kvbridge.tools.proxies.ProxyProcess`).

This is a benchmark harness, not a production router: one P, one D, no retries, no discovery.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import copy
import json
import logging
import signal
import threading
import uuid
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from kvbridge.errors import ConfigError
from kvbridge.tools.bench.dispatch import vllm_pull_params, vllm_push_params

if TYPE_CHECKING:
    import aiohttp
    from aiohttp import web

__all__ = [
    "PROTOCOLS",
    "stock_prefill_body",
    "stock_decode_body",
    "StockProxy",
    "StockProxyThread",
]

log = logging.getLogger("kvbridge.tools.bench.proxy")

PROTOCOLS = ("pull", "push")
HOST = "127.0.0.1"
_MAX_BODY = 16 << 20


# -- request translation (pure, unit-tested) -----------------------------------------------------


def stock_prefill_body(body: Mapping[str, Any], kv_params: Mapping[str, Any]) -> dict[str, Any]:
    """P's copy of the client's *body*: one token, not streamed, with *kv_params*."""
    out = copy.deepcopy(dict(body))
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        out.pop(key, None)
    out["kv_transfer_params"] = dict(kv_params)
    return out


def stock_decode_body(body: Mapping[str, Any], kv_params: Mapping[str, Any]) -> dict[str, Any]:
    """D's copy of the client's *body*: unchanged but for *kv_params*."""
    out = dict(body)
    out["kv_transfer_params"] = dict(kv_params)
    return out


class _Refused(Exception):
    """A leg failed; becomes the client's JSON error."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _error(status: int, message: str) -> web.Response:
    from aiohttp import web

    return web.json_response({"error": {"message": message, "type": "bench_proxy_error",
                                        "code": status}}, status=status)


# -- the server ----------------------------------------------------------------------------------


class StockProxy:
    """The proxy on the running event loop: ``await start()`` binds, ``await stop()``.

    *protocol* is ``pull`` or ``push``; ``push`` needs *p_side_channel_port* (P's
    ``VLLM_NIXL_SIDE_CHANNEL_PORT``). ``stats`` counts requests, failures and late P failures.
    """

    def __init__(self, protocol: str, prefill_url: str, decode_url: str, *,
                 p_side_channel_port: int | None = None, timeout_s: float = 600.0,
                 connect_timeout_s: float = 3.0, max_in_flight: int = 256,
                 host: str = HOST, port: int = 0) -> None:
        if protocol not in PROTOCOLS:
            raise ConfigError(f"unknown stock protocol {protocol!r}; expected pull or push")
        if protocol == "push" and p_side_channel_port is None:
            raise ConfigError("the push protocol needs P's side-channel port")
        if timeout_s <= 0 or connect_timeout_s <= 0 or max_in_flight < 1:
            raise ConfigError("timeouts must be > 0 and max_in_flight >= 1")
        self.protocol = protocol
        self.prefill_url = prefill_url.rstrip("/")
        self.decode_url = decode_url.rstrip("/")
        self.p_side_channel_port = p_side_channel_port
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_in_flight = max_in_flight
        self.host = host
        self.port = port
        self.stats: dict[str, int] = {"requests": 0, "ok": 0, "failed": 0, "busy": 0,
                                      "p_failed_late": 0}
        self._in_flight = 0
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        import aiohttp
        from aiohttp import web

        timeout = aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=self.connect_timeout_s)
        # keep-alive below uvicorn's 5 s, so a pooled connection is never one the engine closed
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        app = web.Application(client_max_size=_MAX_BODY)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        log.info("stock %s proxy on %s -> P %s, D %s", self.protocol, self.url,
                 self.prefill_url, self.decode_url)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("stock proxy not started")
        return self._session

    # -------------------------------------------------------------- handlers

    async def _health(self, request: web.Request) -> web.StreamResponse:
        from aiohttp import web

        return web.json_response({"status": "ok", "protocol": self.protocol,
                                  "in_flight": self._in_flight, **self.stats})

    async def _models(self, request: web.Request) -> web.StreamResponse:
        from aiohttp import web

        try:
            async with self.session.get(self.decode_url + "/v1/models") as r:
                raw = await r.read()
                ctype = r.headers.get("Content-Type", "application/json")
                return web.Response(body=raw, status=r.status, headers={"Content-Type": ctype})
        except (OSError, TimeoutError, _client_error()) as exc:
            return _error(502, f"decode engine {self.decode_url}: {exc}")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        self.stats["requests"] += 1
        if self._in_flight >= self.max_in_flight:
            self.stats["busy"] += 1
            return _error(503, f"more than {self.max_in_flight} requests in flight")
        try:
            body = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            self.stats["failed"] += 1
            return _error(400, f"request body is not valid JSON: {exc}")
        if not isinstance(body, dict) or "prompt" not in body:
            self.stats["failed"] += 1
            return _error(400, "request body must be a JSON object with a prompt")
        self._in_flight += 1
        try:
            if self.protocol == "pull":
                resp = await self._pull(request, body)
            else:
                resp = await self._push(request, body)
        except _Refused as exc:
            log.warning("stock %s request failed: %s", self.protocol, exc.message)
            self.stats["failed"] += 1
            return _error(exc.status, exc.message)
        finally:
            self._in_flight -= 1
        self.stats["ok" if resp.status < 400 else "failed"] += 1
        return resp

    async def _prefill(self, body: dict[str, Any], headers: Mapping[str, str]) -> dict[str, Any]:
        """P's one-token leg; its answer JSON (``_Refused`` on any failure)."""
        try:
            async with self.session.post(self.prefill_url + "/v1/completions", json=body,
                                         headers=dict(headers)) as r:
                raw = await r.read()
                status = r.status
        except (OSError, TimeoutError, _client_error()) as exc:
            raise _Refused(502, f"prefill engine {self.prefill_url}: "
                           f"{exc or type(exc).__name__}") from exc
        if status >= 400:
            raise _Refused(status if status < 500 else 502, f"prefill engine answered {status}: "
                           + raw[:500].decode("utf-8", "replace"))
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise _Refused(502, f"prefill engine answered no JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise _Refused(502, "prefill engine answered no JSON object")
        return data

    async def _pull(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        answer = await self._prefill(stock_prefill_body(body, vllm_pull_params()), {})
        kvp = answer.get("kv_transfer_params")
        if not isinstance(kvp, dict):
            raise _Refused(502, "prefill engine answered no kv_transfer_params: "
                           f"{str(answer)[:200]}")
        return await self._relay(request, stock_decode_body(body, kvp), {}, None)

    async def _push(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        assert self.p_side_channel_port is not None
        rid = uuid.uuid4().hex
        headers = {"X-Request-Id": rid}
        p_params, d_params = vllm_push_params(rid, self.p_side_channel_port)
        p_leg = asyncio.ensure_future(self._prefill(stock_prefill_body(body, p_params), headers))
        try:
            resp = await self._relay(request, stock_decode_body(body, d_params), headers, p_leg)
        except BaseException:  # refused (P or D failed first) or the client went away
            p_leg.cancel()
            raise
        try:  # D has answered; P's one-token leg ends about now (bounded by wait_for)
            await asyncio.wait_for(p_leg, self.timeout_s)
        except (_Refused, TimeoutError) as exc:
            self.stats["p_failed_late"] += 1
            log.warning("push %s: P leg failed after D answered: %s", rid, exc)
        return resp

    async def _relay(self, request: web.Request, d_body: dict[str, Any],
                     headers: Mapping[str, str],
                     p_leg: asyncio.Future[dict[str, Any]] | None) -> web.StreamResponse:
        """Open D's leg and pass its answer on; a P failure before D's first chunk aborts D."""
        from aiohttp import web

        d_open = asyncio.ensure_future(self.session.post(
            self.decode_url + "/v1/completions", json=d_body, headers=dict(headers)))
        resp: aiohttp.ClientResponse | None = None
        try:
            resp = await self._gate(d_open, p_leg)
            if resp.status >= 400 or not d_body.get("stream"):
                raw = await self._gate(asyncio.ensure_future(resp.read()), p_leg)
                ctype = resp.headers.get("Content-Type", "application/json")
                return web.Response(body=raw, status=resp.status, headers={"Content-Type": ctype})
            first = await self._gate(asyncio.ensure_future(resp.content.readany()), p_leg)
            out = web.StreamResponse(status=resp.status, headers={
                "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
                "Cache-Control": "no-cache"})
            await out.prepare(request)
            chunk = first
            while chunk:
                try:
                    await out.write(chunk)
                except ConnectionError:  # the client went away: closing D's stream aborts it
                    log.info("stock %s: client went away mid-stream", self.protocol)
                    return out
                chunk = await resp.content.readany()
            with contextlib.suppress(ConnectionError):
                await out.write_eof()
            return out
        except (OSError, TimeoutError, _client_error()) as exc:
            if resp is None:
                raise _Refused(502, f"decode engine {self.decode_url}: "
                               f"{exc or type(exc).__name__}") from exc
            raise  # mid-stream: the client sees the stream break, as it would from vLLM
        finally:
            if not d_open.done():
                d_open.cancel()
            elif resp is None and not d_open.cancelled() and d_open.exception() is None:
                d_open.result().close()
            if resp is not None:
                resp.close()  # closing mid-stream aborts the request inside vLLM

    async def _gate(self, task: asyncio.Future[Any],
                    p_leg: asyncio.Future[dict[str, Any]] | None) -> Any:
        """Await *task*; if the P leg fails first, cancel *task* and refuse with P's error."""
        try:
            while p_leg is not None and not p_leg.done() and not task.done():
                await asyncio.wait({task, p_leg}, return_when=asyncio.FIRST_COMPLETED)
            if (p_leg is not None and p_leg.done() and not p_leg.cancelled()
                    and p_leg.exception() is not None and not task.done()):
                exc = p_leg.exception()
                task.cancel()
                if isinstance(exc, _Refused):
                    raise _Refused(exc.status, "prefill leg failed, decode leg aborted: "
                                   + exc.message)
                raise _Refused(502, f"prefill leg failed, decode leg aborted: {exc}")
            return await task
        except BaseException:
            task.cancel()
            raise


def _client_error() -> type[Exception]:
    import aiohttp

    return aiohttp.ClientError


# -- on a thread ---------------------------------------------------------------------------------


_LIVE: set[StockProxyThread] = set()
_LIVE_LOCK = threading.Lock()


def _close_all() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for t in live:
        with contextlib.suppress(Exception):
            t.close()


atexit.register(_close_all)


class StockProxyThread:
    """A :class:`StockProxy` on its own event-loop thread; ``url`` once :meth:`start` returned.

    Takes :class:`StockProxy`'s arguments. :meth:`close` stops the server, closes every upstream
    connection and joins the thread; idempotent, and also run at interpreter exit.
    """

    def __init__(self, protocol: str, prefill_url: str, decode_url: str,
                 **kwargs: Any) -> None:
        self.proxy = StockProxy(protocol, prefill_url, decode_url, **kwargs)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever,
                                        name=f"kvbridge-stock-{protocol}", daemon=True)

    @property
    def url(self) -> str:
        return self.proxy.url

    @property
    def stats(self) -> dict[str, int]:
        return dict(self.proxy.stats)

    def start(self, timeout: float = 30.0) -> StockProxyThread:
        self._thread.start()
        with _LIVE_LOCK:
            _LIVE.add(self)
        try:
            asyncio.run_coroutine_threadsafe(self.proxy.start(), self._loop).result(timeout)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        with _LIVE_LOCK:
            _LIVE.discard(self)
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.proxy.stop(), self._loop).result(15)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> StockProxyThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def stock_proxy(protocol: str, prefill_url: str, decode_url: str,
                **kwargs: Any) -> Iterator[StockProxyThread]:
    """:class:`StockProxyThread` as a context manager (started on entry, closed on exit)."""
    t = StockProxyThread(protocol, prefill_url, decode_url, **kwargs).start()
    try:
        yield t
    finally:
        t.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m kvbridge.tools.bench.proxy``: one stock proxy until SIGTERM or SIGINT."""
    ap = argparse.ArgumentParser(prog="python -m kvbridge.tools.bench.proxy",
                                 description="A proxy speaking vLLM's stock NIXL P/D protocol "
                                             "(benchmark harness, one P, one D).")
    ap.add_argument("--protocol", choices=PROTOCOLS, required=True,
                    help="pull (NixlConnector) or push (NixlPushConnector)")
    ap.add_argument("--prefill", required=True, help="P's base URL")
    ap.add_argument("--decode", required=True, help="D's base URL")
    ap.add_argument("--p-side-channel-port", type=int, default=None,
                    help="push: P's VLLM_NIXL_SIDE_CHANNEL_PORT")
    ap.add_argument("--timeout-s", type=float, default=600.0,
                    help="total timeout of each upstream call (s)")
    ap.add_argument("--host", default=HOST, help="address to bind (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=0, help="port to bind (0: a free one)")
    ap.add_argument("--log-level", default="INFO", help="Python log level")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        proxy = StockProxy(args.protocol, args.prefill, args.decode,
                           p_side_channel_port=args.p_side_channel_port,
                           timeout_s=args.timeout_s, host=args.host, port=args.port)
    except ConfigError as exc:
        ap.error(str(exc))

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await proxy.start()
        try:
            await stop.wait()
        finally:
            await proxy.stop()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
