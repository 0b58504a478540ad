"""kvbridge's transport conformance suite against the example ``loopback`` backend.

All a backend's conformance module needs: subclass the suite, name the entry point. The peer is
a second transport in this process (``in_process_peer``): loopback cannot reach another one.
"""

from __future__ import annotations

import pytest

from kvbridge.testing.conformance import TransportConformance

pytestmark = [pytest.mark.example]


class TestLoopbackConformance(TransportConformance):
    backend = "loopback"
    in_process_peer = True
    native_blocks = False  # descriptor arrays only: the core's block path falls back to them
