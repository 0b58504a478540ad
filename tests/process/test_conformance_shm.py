"""The transport conformance suite against the built-in shm transport."""

from __future__ import annotations

from kvbridge.testing.conformance import TransportConformance


class TestShmConformance(TransportConformance):
    backend = "shm"
    native_blocks = True
    options = {}


class TestShmMappedConformance(TransportConformance):
    """Both sides share their memory through a sealed memfd and map the other's: every case
    moves the bytes the peer's mapping holds with the native range copy, the rest by CMA."""

    backend = "shm"
    native_blocks = True
    options = {"map_memory": True}
