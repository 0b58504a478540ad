"""The ``vllm serve`` flags the deployment checks read, parsed without vLLM.

:func:`parse_serve_args` is the default :data:`~kvbridge.tools.deploycheck.k8s.ServeParser` of
``python -m kvbridge.tools.deploycheck.k8s``: it reads the model, ``--host``, ``--port``,
``--tensor-parallel-size`` / ``-tp``, ``--pipeline-parallel-size`` / ``-pp``, ``--middleware``
and ``--kv-transfer-config`` (a JSON object, given back as a :class:`KVTransferConfig` with
vLLM's attribute names and defaults), and leaves every other flag to vLLM. It checks what the
fleet checks need: the values' types, a JSON object, a known ``kv_role``. It does not know
every flag of a vLLM release; ``--vllm`` on the command line parses with vLLM's own parser
(:func:`kvbridge.integrations.vllm_serve.parse_serve_args`) instead. Never imports vLLM.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KVTransferConfig", "KV_ROLES", "parse_serve_args"]

#: vLLM's ``KVTransferConfig.kv_role`` values
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig:
    """The fields of vLLM's ``KVTransferConfig`` the checks read (engine id: a new UUID when
    absent, as vLLM does)."""

    kv_connector: str | None = None
    kv_role: str | None = None
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)


def _transfer_config(text: str) -> KVTransferConfig:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {type(doc).__name__}")
    role = doc.get("kv_role")
    if role is not None and role not in KV_ROLES:
        raise argparse.ArgumentTypeError(f"kv_role {role!r} is not one of {list(KV_ROLES)}")
    extra = doc.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise argparse.ArgumentTypeError("kv_connector_extra_config must be a JSON object")
    engine_id = doc.get("engine_id")
    return KVTransferConfig(
        kv_connector=doc.get("kv_connector"), kv_role=role, kv_connector_extra_config=extra,
        **({} if engine_id is None else {"engine_id": str(engine_id)}))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm serve", add_help=False, allow_abbrev=False)
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--middleware", action="append", default=[])
    p.add_argument("--kv-transfer-config", type=_transfer_config, default=None)
    return p


def parse_serve_args(argv: Sequence[str]) -> argparse.Namespace:
    """``vllm serve ARGV``'s flags that the checks read (see the module docstring); other
    flags are left alone. Raises :class:`ValueError` with argparse's message for a bad value."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args, _rest = _parser().parse_known_args(list(argv))
    except SystemExit:
        text = err.getvalue()
        start = text.find("vllm serve: error:")
        raise ValueError(" ".join(text[max(start, 0):].split()) or "vllm serve: invalid "
                         "arguments") from None
    return args
