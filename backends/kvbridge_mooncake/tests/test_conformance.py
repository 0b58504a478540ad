"""kvbridge's transport conformance suite against the mooncake backend (Transfer Engine over TCP,
two real processes on 127.0.0.1, P2PHANDSHAKE: no etcd)."""

from __future__ import annotations

import importlib.util
from typing import Any, ClassVar

import pytest

from kvbridge.testing.conformance import TransportConformance

pytestmark = [
    pytest.mark.mooncake,
    pytest.mark.skipif(
        importlib.util.find_spec("mooncake") is None, reason="mooncake is not installed"
    ),
]


class TestMooncakeConformance(TransportConformance):
    backend = "mooncake"
    native_blocks = True
    options: ClassVar[dict[str, Any]] = {"protocol": "tcp", "host": "127.0.0.1"}
    peer_env: ClassVar[dict[str, str]] = {}  # the engine needs no environment over TCP
    timeout = 60.0
