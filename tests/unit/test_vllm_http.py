"""The ASGI guard for vLLM's API server, driven through real ASGI calls.

The downstream app is a recording fake (it stands where vLLM's FastAPI app would be): each test
checks what it received — nothing when the guard answered 400 itself, the client's exact bytes
otherwise. Scopes and messages are written by hand, so chunking and disconnects are exact.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvbridge.integrations.vllm_http import MAX_BODY_BYTES, KVTransferParamsGuard

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class Downstream:
    """A stand-in for vLLM's app: records the scope, every message it read, and answers 200."""

    calls: int = 0
    scope: dict[str, Any] | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    receive: Any = None
    read_after: dict[str, Any] | None = None  # one more receive() after the body, if asked
    read_extra: bool = False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.calls += 1
        self.scope = scope
        self.receive = receive
        if scope["type"] == "http":
            while True:
                message = await receive()
                self.messages.append(message)
                if not message.get("more_body", False):
                    break
            if self.read_extra:
                self.read_after = await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"ok": true}'})

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages)


@dataclass
class Result:
    status: int | None
    headers: dict[bytes, bytes]
    body: bytes
    sent: list[dict[str, Any]]

    def json(self) -> Any:
        return json.loads(self.body)


def scope_for(path: str = "/v1/completions", method: str = "POST",
              headers: Sequence[tuple[bytes, bytes]] = (), kind: str = "http") -> dict[str, Any]:
    return {"type": kind, "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
            "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "headers": list(headers), "server": ("127.0.0.1", 8000),
            "client": ("127.0.0.1", 50000)}


async def call(app: Any, body: bytes | Sequence[bytes], *, path: str = "/v1/completions",
               method: str = "POST", headers: Sequence[tuple[bytes, bytes]] = (),
               disconnect_after: int | None = None) -> Result:
    """One request through ``app``; ``body`` as a list is sent as that many chunks."""
    chunks = [body] if isinstance(body, bytes) else list(body)
    inbox: list[dict[str, Any]] = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]
    if disconnect_after is not None:
        inbox = inbox[:disconnect_after]

    async def receive() -> dict[str, Any]:
        if inbox:
            return inbox.pop(0)
        return {"type": "http.disconnect"}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope_for(path, method, headers), receive, send)
    start = next((m for m in sent if m["type"] == "http.response.start"), None)
    return Result(
        start["status"] if start else None,
        dict(start["headers"]) if start else {},
        b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"),
        sent,
    )


def request(kvp: Any = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4, **extra}
    if kvp is not None:
        body["kv_transfer_params"] = kvp
    return body


def encode(body: Any) -> bytes:
    return json.dumps(body).encode()


P_LEG = {"do_remote_decode": True, "transfer_id": "xfer-1", "transfer_mode": "pull"}
D_LEG = {"do_remote_prefill": True, "transfer_id": "xfer-1", "transfer_mode": "pull",
         "remote_engine_id": "P-1", "remote_host": "127.0.0.1", "remote_port": 5600,
         "remote_block_ids": [0, 1]}


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


# ------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    ("kvp", "field"),
    [
        ({**D_LEG, "remote_block_ids": "abc"}, "kv_transfer_params.remote_block_ids"),
        ({**D_LEG, "remote_port": "port"}, "kv_transfer_params.remote_port"),
        ({**D_LEG, "remote_engine_id": 5}, "kv_transfer_params.remote_engine_id"),
        ({**P_LEG, "transfer_mode": "sideways"}, "kv_transfer_params.transfer_mode"),
        ({**D_LEG, "remote_block_ids": list(range(200_000))},
         "kv_transfer_params.remote_block_ids"),
        ({**D_LEG, "remote_block_ids": [nested(60)]}, "kv_transfer_params.remote_block_ids"),
        ({**D_LEG, "remote_host": {"a": nested(60)}}, "kv_transfer_params.remote_host"),
        ({**D_LEG, "remote_engine_id": "x" * (10 << 20)}, "kv_transfer_params.remote_engine_id"),
        ({**P_LEG, "transfer_id": "has spaces"}, "kv_transfer_params.transfer_id"),
        ({**D_LEG, "remote_port": 70000}, "kv_transfer_params.remote_port"),
        ({**P_LEG, "do_remote_decode": "yes"}, "kv_transfer_params.do_remote_decode"),
        ([1, 2], "kv_transfer_params"),
        ("do_remote_decode", "kv_transfer_params"),
    ],
)
async def test_malformed_params_are_400_naming_the_key(kvp: Any, field: str) -> None:
    app = Downstream()
    r = await call(KVTransferParamsGuard(app), encode(request(kvp)))
    assert r.status == 400
    assert r.headers[b"content-type"] == b"application/json"
    assert int(r.headers[b"content-length"]) == len(r.body)
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert error["param"] == field and error["message"].startswith(field)
    assert len(error["message"]) <= 2000  # never echoes a huge value
    assert app.calls == 0


async def test_too_deep_json_is_400_not_a_crash() -> None:
    app = Downstream()
    raw = b'{"prompt": [1], "kv_transfer_params": {"remote_block_ids": ' + b"[" * 200_000
    raw += b"]" * 200_000 + b"}}"
    r = await call(KVTransferParamsGuard(app), raw)
    assert r.status == 400 and r.json()["error"]["param"] is None
    assert "too deeply" in r.json()["error"]["message"]
    assert app.calls == 0


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/completions", {"n": 2}, "n"),
        ("/v1/chat/completions", {"n": 3}, "n"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2], [3]]}, "prompt"),
    ],
)
@pytest.mark.parametrize("kvp", [P_LEG, D_LEG])
async def test_n_and_batches_with_a_hand_off_are_400(
    path: str, extra: dict[str, Any], param: str, kvp: dict[str, Any]
) -> None:
    app = Downstream()
    r = await call(KVTransferParamsGuard(app), encode(request(kvp, **extra)), path=path)
    assert r.status == 400, r.body
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param)
    assert app.calls == 0


# ------------------------------------------------------------------------------ pass-through


@pytest.mark.parametrize(
    "body",
    [
        request(P_LEG),
        request(D_LEG),
        request(D_LEG, prompt="one string prompt"),
        request(D_LEG, prompt=["a one-element batch"]),
        request(D_LEG, prompt=[[1, 2, 3]]),
        request(P_LEG, n=1),
        request({**D_LEG, "remote_block_ids": [[0, 1]]}),  # vLLM's per-group form
        request({"kvbridge_probe": True}, prompt=[1]),
        request(None),
        {"model": "tiny", "prompt": "x", "kv_transfer_params": None},
        request({"unknown_key": 1}, n=2),  # no hand-off: n > 1 is vLLM's business
        request(None, n=4, prompt=["a", "b"]),
    ],
)
async def test_acceptable_requests_pass_byte_identical(body: dict[str, Any]) -> None:
    app = Downstream()
    raw = json.dumps(body, indent=1, ensure_ascii=False).encode() + b"\n  "
    r = await call(KVTransferParamsGuard(app), raw)
    assert r.status == 200 and app.calls == 1
    assert app.messages == [{"type": "http.request", "body": raw, "more_body": False}]


async def test_exact_bytes_survive_whitespace_unicode_and_duplicate_keys() -> None:
    app = Downstream()
    raw = ('{ "model":"tiny" ,"prompt":"caf\u00e9 \\u00e9",\t"max_tokens":4,'
           '"kv_transfer_params":{"do_remote_decode":true,"transfer_id":"xfer-9",'
           '"transfer_id":"xfer-9"} }').encode()
    r = await call(KVTransferParamsGuard(app), raw)
    assert r.status == 200 and app.body == raw


async def test_chunked_body_is_replayed_as_one_message() -> None:
    app = Downstream()
    raw = encode(request(D_LEG, prompt="The capital of France is"))
    chunks = [raw[:7], b"", raw[7:40], raw[40:]]
    r = await call(KVTransferParamsGuard(app), chunks)
    assert r.status == 200
    assert app.messages == [{"type": "http.request", "body": raw, "more_body": False}]


async def test_chunked_malformed_body_is_400() -> None:
    app = Downstream()
    raw = encode(request({**D_LEG, "remote_port": "port"}))
    r = await call(KVTransferParamsGuard(app), [raw[i:i + 5] for i in range(0, len(raw), 5)])
    assert r.status == 400 and r.json()["error"]["param"] == "kv_transfer_params.remote_port"
    assert app.calls == 0


@pytest.mark.parametrize(
    "raw",
    [b"{not json", b"", b"[1, 2]", b'"a string"', b"\xff\xfe\x00garbage", b"null"],
)
async def test_non_json_and_non_objects_pass_through(raw: bytes) -> None:
    app = Downstream()
    r = await call(KVTransferParamsGuard(app), [raw[:2], raw[2:]])
    assert r.status == 200 and app.body == raw


async def test_a_body_above_the_limit_passes_through_as_it_came() -> None:
    app = Downstream()
    raw = encode(request({**D_LEG, "remote_port": "port"}))  # malformed, but too big to check
    chunks = [raw[:30], raw[30:60], raw[60:]]
    r = await call(KVTransferParamsGuard(app, max_body_bytes=50), chunks)
    assert r.status == 200
    assert [m["body"] for m in app.messages] == chunks  # replayed untouched, then streamed
    assert [m["more_body"] for m in app.messages] == [True, True, False]


async def test_declared_length_above_64_mib_is_not_buffered() -> None:
    app = Downstream()
    raw = encode(request({**D_LEG, "remote_port": "port"}))
    headers = [(b"content-length", str(MAX_BODY_BYTES + 1).encode())]
    r = await call(KVTransferParamsGuard(app), [raw[:10], raw[10:]], headers=headers)
    assert r.status == 200 and len(app.messages) == 2 and app.body == raw


@pytest.mark.parametrize(
    ("path", "method", "kind"),
    [
        ("/v1/models", "GET", "http"),
        ("/v1/embeddings", "POST", "http"),
        ("/v1/completions", "GET", "http"),
        ("/v1/completions/extra", "POST", "http"),
        ("/health", "GET", "http"),
    ],
)
async def test_other_requests_are_not_touched(path: str, method: str, kind: str) -> None:
    app = Downstream()
    raw = encode(request({**D_LEG, "remote_port": "port"}))

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await KVTransferParamsGuard(app)(scope_for(path, method, kind=kind), receive, send)
    assert app.calls == 1 and app.receive is receive  # unbuffered: the server's own receive
    assert sent[0]["status"] == 200


async def test_lifespan_and_websocket_scopes_pass() -> None:
    seen: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["type"])

    guard = KVTransferParamsGuard(app)

    async def nothing() -> dict[str, Any]:
        raise AssertionError("the guard must not read")

    async def discard(message: Any) -> None:
        raise AssertionError("the guard must not send")

    await guard({"type": "lifespan"}, nothing, discard)
    await guard(scope_for(kind="websocket", method="GET"), nothing, discard)
    assert seen == ["lifespan", "websocket"]


async def test_root_path_and_trailing_slash_are_guarded() -> None:
    app = Downstream()
    scope = scope_for("/api/v1/completions/")
    scope["root_path"] = "/api"
    raw = encode(request({**D_LEG, "remote_port": "port"}))
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await KVTransferParamsGuard(app)(scope, receive, send)
    assert sent[0]["status"] == 400 and app.calls == 0


async def test_disconnect_while_reading_the_body_calls_nothing() -> None:
    app = Downstream()
    raw = encode(request(D_LEG))
    r = await call(KVTransferParamsGuard(app), [raw[:10], raw[10:]], disconnect_after=1)
    assert r.status is None and r.sent == [] and app.calls == 0


async def test_later_receives_reach_the_server() -> None:
    app = Downstream(read_extra=True)  # like a streaming response waiting for a disconnect
    r = await call(KVTransferParamsGuard(app), encode(request(D_LEG, stream=True)))
    assert r.status == 200 and app.read_after == {"type": "http.disconnect"}


async def test_as_starlette_middleware() -> None:
    """The way vLLM registers it: ``app.add_middleware(KVTransferParamsGuard)``."""
    starlette = pytest.importorskip("starlette.applications")
    httpx = pytest.importorskip("httpx")
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    got: list[bytes] = []

    async def completions(request: Request) -> JSONResponse:
        got.append(await request.body())
        return JSONResponse({"ok": True})

    app = starlette.Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    app.add_middleware(KVTransferParamsGuard)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://vllm") as client:
        bad = await client.post("/v1/completions", json=request({**D_LEG, "remote_port": "p"}))
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "kv_transfer_params.remote_port"
        raw = encode(request(D_LEG))
        ok = await client.post("/v1/completions", content=raw,
                               headers={"content-type": "application/json"})
        assert ok.status_code == 200 and got == [raw]


# -- draining after SIGTERM (kvbridge.integrations.vllm_drain) --------------------------------


async def test_a_draining_engine_answers_503_at_once_and_runs_nothing_new() -> None:
    down = Downstream()
    guard = KVTransferParamsGuard(down)
    assert (await call(guard, encode(request()))).status == 200
    guard.drain.draining = True
    for path in ("/v1/completions", "/v1/chat/completions"):
        res = await call(guard, encode(request()), path=path)
        assert res.status == 503 and res.headers[b"retry-after"] == b"1"
        assert res.json()["error"]["type"] == "EngineDraining"
    health = await call(guard, b"", path="/health", method="GET")
    assert health.status == 503 and health.json() == {"status": "draining"}
    assert down.calls == 1  # neither the new requests nor /health reached vLLM
    models = await call(guard, b"", path="/v1/models", method="GET")
    assert models.status == 200 and down.calls == 2  # everything else passes
