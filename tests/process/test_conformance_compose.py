"""The transport conformance suite against ``compose``: the composer passes it like any backend.

- ``compose(memory, shm)`` with the peer in another process: ``memory`` refuses it, ``shm`` carries;
- ``compose(memory, shm)`` with the peer in this process: ``memory`` carries;
- ``compose(shm, nixl)`` between two processes: ``shm`` carries (same host);
- ``compose(shm, nixl)`` against a peer that only has ``nixl``: ``nixl`` carries.

Each class also checks which member was chosen, so a composer that silently used the wrong path
would fail here.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvbridge.testing.conformance import TransportConformance
from kvbridge.testing.peer import Peer
from kvbridge.transport import Transport
from kvbridge.transports.compose import ComposeTransport

_has_nixl = True
try:  # the nixl classes are skipped, not failed, where nixl is not installed
    import nixl._api  # noqa: F401
except ImportError:
    _has_nixl = False


class _Compose(TransportConformance):
    backend = "compose"
    native_blocks = True
    expect_member = ""

    def test_chosen_member(self, local: Transport, peer: Peer) -> None:
        pair = self.connect(local, peer)
        assert isinstance(local, ComposeTransport)
        assert local.member_for(pair.peer_name) == self.expect_member
        assert local.members_for(pair.peer_name)[0] == self.expect_member


class TestComposeMemoryShm(_Compose):
    options: dict[str, Any] = {"members": ["memory", "shm"]}
    expect_member = "shm"


class TestComposeMemoryShmInProcess(_Compose):
    options: dict[str, Any] = {"members": ["memory", "shm"]}
    in_process_peer = True
    expect_member = "memory"


class _ComposeNixl(_Compose):
    """Both agents use UCX over loopback (as in the nixl backend's tests/test_conformance.py)."""

    peer_env = {"UCX_NET_DEVICES": "lo"}
    timeout = 60.0
    pytestmark = [pytest.mark.timeout(180), pytest.mark.nixl,
                  pytest.mark.skipif(not _has_nixl, reason="the nixl package is not installed")]
    local_env = True


class TestComposeShmNixl(_ComposeNixl):
    options: dict[str, Any] = {"members": ["shm", "nixl"]}
    expect_member = "shm"


class TestComposeShmNixlPeerNixlOnly(_ComposeNixl):
    options: dict[str, Any] = {"members": ["shm", "nixl"]}
    peer_options = {"members": ["nixl"]}
    expect_member = "nixl"
