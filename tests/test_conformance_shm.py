"""The transport conformance suite against the built-in shm transport."""

from __future__ import annotations

from kvbridge.testing.conformance import TransportConformance


class TestShmConformance(TransportConformance):
    backend = "shm"
    native_blocks = True
    options = {}
