"""The transport conformance suite against the nixl backend (UCX), between two real processes.

Matrix over ``UCX_TLS``: UCX's default selection (cma for one-sided operations on one host) and
``tcp`` (the closest stand-in for a cross-host path), always on the loopback device.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

pytest.importorskip("nixl._api", reason="the nixl package is not installed")

from kvbridge.testing.conformance import TransportConformance  # noqa: E402

pytestmark = [pytest.mark.nixl]


class _NixlEnv(TransportConformance):
    """Applies ``peer_env`` to this process too, so both agents use the same UCX transports."""

    backend = "nixl"
    native_blocks = True
    options: ClassVar[dict[str, Any]] = {}
    timeout = 60.0  # peer start-up (spawn, import nixl, agent) takes 10-50 s on a busy 2-core box
    local_env = True


class TestNixlConformanceDefault(_NixlEnv):
    peer_env = {"UCX_NET_DEVICES": "lo"}


class TestNixlConformanceTcp(_NixlEnv):
    peer_env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
