"""The public surface: ``kvbridge.__all__`` is exactly what ``import kvbridge`` offers, and that
import stays light (no backend, no vLLM, no torch, no ZeroMQ)."""

from __future__ import annotations

import subprocess
import sys
import types

import kvbridge


def test_every_exported_name_resolves_and_comes_from_kvbridge() -> None:
    for name in kvbridge.__all__:
        value = getattr(kvbridge, name)
        if isinstance(value, types.ModuleType):
            assert value.__name__.startswith("kvbridge."), name
        elif isinstance(value, type) or callable(value):
            assert value.__module__.startswith("kvbridge."), (name, value.__module__)


def test_all_lists_every_public_name_and_nothing_else() -> None:
    """A name bound in ``kvbridge`` by accident (a helper, a stray import) fails here; so does one
    promised in ``__all__`` and gone. Subpackages bound as a side effect of importing them are
    not names of the API, except the ones ``__all__`` lists."""
    public = {n for n, v in vars(kvbridge).items()
              if not n.startswith("_") and not isinstance(v, types.ModuleType)}
    listed = {n for n in kvbridge.__all__
              if not isinstance(getattr(kvbridge, n), types.ModuleType) and n != "__version__"}
    assert public == listed
    assert len(kvbridge.__all__) == len(set(kvbridge.__all__)), "a name listed twice"


def test_the_contracts_are_the_ones_the_plugins_implement() -> None:
    from kvbridge import registry
    from kvbridge.offload.tier import Tier
    from kvbridge.transport import Transport

    assert kvbridge.Transport is Transport and kvbridge.Tier is Tier
    assert kvbridge.create is registry.create
    assert issubclass(kvbridge.PeerForged, kvbridge.KVBridgeError)
    assert issubclass(kvbridge.TierError, kvbridge.KVBridgeError)


def test_importing_kvbridge_loads_no_backend_engine_or_network_library() -> None:
    heavy = ["torch", "vllm", "nixl", "mooncake", "lmcache", "zmq", "aiohttp", "stevedore",
             "kvbridge_nixl", "kvbridge_mooncake", "kvbridge_lmcache", "kvbridge.tools"]
    code = ("import sys, kvbridge; "
            f"print(','.join(m for m in {heavy!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "", f"import kvbridge loaded: {out.stdout.strip()}"
