"""An ASGI guard in front of vLLM's OpenAI server: malformed ``kv_transfer_params`` get HTTP 400.

vLLM hands a request's ``kv_transfer_params`` to the KV connector inside its scheduler, where an
exception would kill the engine and no HTTP answer can be given any more; KVBridgeConnector
therefore serves such a request without a hand-off (it computes the prompt locally and logs a
WARNING naming the key). This middleware checks the same params at the HTTP boundary, with the
same parser (:func:`kvbridge.params.parse`), so the client is told instead::

    vllm serve MODEL --kv-transfer-config '{...}' \\
        --middleware kvbridge.integrations.vllm_http.KVTransferParamsGuard

vLLM adds the class with ``app.add_middleware(cls)``. It is plain ASGI: no vLLM, Starlette or
FastAPI import.

Contract:

* Only ``POST /v1/completions`` and ``POST /v1/chat/completions`` are looked at. Every other
  scope (other paths or methods, websockets, lifespan) goes to the wrapped app untouched and
  unbuffered.
* The body is read in full, up to :data:`MAX_BODY_BYTES` (64 MiB). A larger body (by its
  ``content-length`` or as it arrives), a body that is not JSON, or JSON that is not an object,
  goes to the app untouched (the messages already read are replayed as they came), and vLLM
  answers it with its own error.
* Without ``kv_transfer_params`` (or with ``null``) the request passes.
* ``kv_transfer_params`` that :func:`~kvbridge.params.parse` refuses: the guard answers 400 itself,
  in vLLM's error shape ``{"error": {"message", "type": "BadRequestError", "param": <field>,
  "code": 400}}``, ``param`` naming the key (``kv_transfer_params.remote_port``).
* Params that ask for a hand-off (``do_remote_decode`` or ``do_remote_prefill``) with ``n > 1``
  or a batched ``prompt`` (more than one string or token-id list): 400 naming ``n`` / ``prompt``,
  because vLLM would run several requests under one ``transfer_id``.
* JSON nested too deeply for Python's parser (which vLLM uses too, and would fail on with a 500):
  400, ``param`` null.
* Otherwise the app receives exactly the bytes the client sent, as one ``http.request`` message
  with ``more_body`` False; later ``receive()`` calls go to the server, so vLLM still notices a
  client that disconnects.
* A client that disconnects while the body is being read: the app is not called.
* After SIGTERM (:mod:`kvbridge.integrations.vllm_drain`): ``/health`` and new generation
  requests are answered 503 by the guard (``Retry-After: 1`` on the latter), so routers move
  on while vLLM drains what it already runs.

No shared state: any number of requests may be in flight at once.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvbridge.errors import ParamsError
from kvbridge.integrations.vllm_drain import SigtermDrain
from kvbridge.params import parse

__all__ = ["KVTransferParamsGuard", "MAX_BODY_BYTES", "GUARDED_PATHS", "check_body"]

log = logging.getLogger("kvbridge.connector.http")

#: Largest body the guard reads; a larger one is passed through unchecked.
MAX_BODY_BYTES = 64 << 20
#: The endpoints whose bodies carry ``kv_transfer_params``.
GUARDED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_MAX_MESSAGE_CHARS = 2000


def _is_batch(prompt: object) -> bool:
    """More than one prompt: a list of several strings or several token-id lists."""
    return (
        isinstance(prompt, list)
        and len(prompt) > 1
        and all(isinstance(p, str | list) for p in prompt)
    )


def check_body(body: dict[str, Any], completions: bool) -> tuple[str | None, str] | None:
    """``(param, message)`` of why a parsed request body must be refused, or None.

    ``completions``: the body is a ``/v1/completions`` one (it has ``prompt``, not messages).
    """
    raw = body.get("kv_transfer_params")
    if raw is None:
        return None
    try:
        params = parse(raw)
    except ParamsError as err:
        return err.field, str(err)
    if not (params.do_remote_decode or params.do_remote_prefill):
        return None
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        return "n", (f"n is {n}: a request with a KV hand-off samples one sequence (the "
                     "sequences would share one transfer_id); send n requests")
    if completions and _is_batch(body.get("prompt")):
        return "prompt", (f"prompt is a batch of {len(body['prompt'])} prompts: a request with a "
                          "KV hand-off carries one prompt; send one request per prompt")
    return None


class KVTransferParamsGuard:
    """ASGI middleware; see the module docstring for the contract."""

    def __init__(self, app: ASGIApp, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.drain = SigtermDrain()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.drain.armed:
            self.drain.arm()
        if self.drain.draining and scope.get("type") == "http":
            path = self._path(scope)
            if path == "/health":
                await self.drain.answer(send, health=True)
                return
            if self._guarded(scope):
                await self.drain.answer(send, health=False)
                return
        if not self._guarded(scope):
            await self.app(scope, receive, send)
            return
        if self._declared_length(scope) > self.max_body_bytes:
            await self.app(scope, receive, send)  # too big to check: vLLM's to judge
            return
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            if message.get("type") == "http.disconnect":
                return  # the client went away before its request was complete
            messages.append(message)
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                await self.app(scope, _replaying(messages, receive), send)
                return
            if not message.get("more_body", False):
                break
        body = b"".join(m.get("body", b"") for m in messages)
        refusal = self._check(scope, body)
        if refusal is not None:
            param, text = refusal
            log.info("refused %s: %s", scope.get("path"), text[:200])
            await _bad_request(send, param, text)
            return
        whole: Message = {"type": "http.request", "body": body, "more_body": False}
        await self.app(scope, _replaying([whole], receive), send)

    @staticmethod
    def _path(scope: Scope) -> str:
        path = str(scope.get("path", ""))
        root = str(scope.get("root_path", ""))
        if root and path.startswith(root + "/"):
            path = path[len(root):]
        return path.rstrip("/") or "/"

    def _guarded(self, scope: Scope) -> bool:
        return (
            scope.get("type") == "http"
            and scope.get("method") == "POST"
            and self._path(scope) in GUARDED_PATHS
        )

    @staticmethod
    def _declared_length(scope: Scope) -> int:
        for name, value in scope.get("headers", ()):
            if bytes(name).lower() == b"content-length":
                try:
                    return int(bytes(value))
                except ValueError:
                    return 0
        return 0

    def _check(self, scope: Scope, body: bytes) -> tuple[str | None, str] | None:
        try:
            data = json.loads(body)
        except RecursionError:
            return None, "the request body nests JSON too deeply to be read"
        except ValueError:  # not JSON (UnicodeDecodeError included): vLLM answers it
            return None
        if not isinstance(data, dict):
            return None
        try:
            return check_body(data, self._path(scope) == "/v1/completions")
        except RecursionError:
            return None, "the request body nests JSON too deeply to be read"


def _replaying(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that returns ``messages`` first, then what the server sends."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed


async def _bad_request(send: Send, param: str | None, message: str) -> None:
    """Answer 400 in vLLM's own error shape."""
    error = {"message": message[:_MAX_MESSAGE_CHARS], "type": "BadRequestError",
             "param": param, "code": 400}
    body = json.dumps({"error": error}).encode()
    await send({
        "type": "http.response.start",
        "status": 400,
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
    })
    await send({"type": "http.response.body", "body": body, "more_body": False})
