"""kvbridge: one vLLM KV connector for disaggregated prefill/decode.

Push or pull per request, over any transport (see ``docs/concepts.md``). This module is the public
surface: the names in ``__all__`` are the API a backend, a tier or an application builds on, and
they keep their meaning across minor versions. Everything else under ``kvbridge`` is importable
but internal (``kvbridge.tools`` is the workshop: benches, demo, doctor, simulator).

* :class:`Transport` (and :class:`TransferHandle`, :class:`MemoryRegion`, :class:`HandleState`,
  :class:`Capabilities`): the contract a data-plane backend implements.
* :class:`Tier` (and :class:`TierContext`): the contract an offload tier implements.
* :class:`TransferParams` and :func:`parse_params`: a request's ``kv_transfer_params``, parsed.
* :class:`Config` and :class:`TransferMode`: the connector's configuration.
* :func:`create`, :func:`available`, :func:`available_tiers`: find and build plugins by name.
* :mod:`errors` and its classes (:class:`KVBridgeError` is the root of every one).

Importing ``kvbridge`` loads no backend, no vLLM and no torch.
"""

from kvbridge import errors
from kvbridge.config import Config, TransferMode
from kvbridge.errors import (
    BackendNotFound,
    BackendUnavailable,
    ConfigError,
    KVBridgeError,
    ParamsError,
    PeerForged,
    PeerUnreachable,
    TransferFailed,
    TransferTimeout,
    TransportClosed,
    TransportError,
)
from kvbridge.offload.tier import Tier, TierContext, TierError
from kvbridge.params import TransferParams
from kvbridge.params import parse as parse_params
from kvbridge.registry import available, available_tiers, create
from kvbridge.transport import Capabilities, HandleState, MemoryRegion, TransferHandle, Transport

__version__ = "0.1.0"

__all__ = [
    "__version__",
    # contracts
    "Transport", "TransferHandle", "HandleState", "MemoryRegion", "Capabilities",
    "Tier", "TierContext",
    # configuration and requests
    "Config", "TransferMode", "TransferParams", "parse_params",
    # plugins by name
    "create", "available", "available_tiers",
    # errors
    "errors", "KVBridgeError", "ConfigError", "ParamsError", "BackendNotFound",
    "BackendUnavailable", "TransportError", "TransferFailed", "TransferTimeout",
    "TransportClosed", "PeerUnreachable", "PeerForged", "TierError",
]
