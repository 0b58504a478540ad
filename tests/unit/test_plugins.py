"""Adding a backend is one folder plus one entry point: pytest markers derived from the installed
backend distributions, and the example backend (examples/kvbridge_example) found and named
through its own distribution's metadata alone."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from kvbridge import registry
from kvbridge.integrations import names
from kvbridge.testing import plugin

ROOT = Path(__file__).resolve().parents[2]


def test_marker_names_drop_the_kvbridge_prefix() -> None:
    assert plugin.marker_name("kvbridge-nixl") == "nixl"
    assert plugin.marker_name("kvbridge_mooncake") == "mooncake"
    assert plugin.marker_name("Acme.Warp-Drive") == "acme_warp_drive"
    assert plugin.marker_name("kvbridge") == "kvbridge"


def test_one_marker_per_backend_distribution() -> None:
    markers = plugin.backend_markers()
    assert {"nixl", "mooncake", "lmcache", "example"} <= set(markers)
    assert "mooncake, mooncake_store" in markers["mooncake"]
    assert "kvbridge" not in markers  # the built-in backends need no marker
    assert "vllm" not in markers  # not a backend: a static marker


def test_the_example_backend_is_its_own_distribution() -> None:
    ep = next(ep for ep in metadata.entry_points(group=registry.GROUP) if ep.name == "loopback")
    assert ep.dist is not None and ep.dist.name == "kvbridge-example"
    assert ep.value == "kvbridge_example:LoopbackTransport"
    cls = registry.load_class("loopback")
    assert registry.install_hint("loopback") == cls.install_hint
    # in-process only: it asks for no vLLM connector name (connector_word = "")
    assert all(c.backend != "loopback" for c in names.connector_names())


def test_kvbridge_names_neither_the_example_nor_a_table_of_backends() -> None:
    """No file of the library mentions the example backend: it works without touching kvbridge/
    (the workshop in kvbridge/tools/ is not the library)."""
    tools = ROOT / "kvbridge" / "tools"
    for path in (ROOT / "kvbridge").rglob("*.py"):
        if tools in path.parents:
            continue
        text = path.read_text()
        assert "kvbridge_example" not in text and '"loopback"' not in text, path
