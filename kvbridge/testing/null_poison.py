"""KVBridgeConnector with vLLM's null block poisoned, for hybrid-model tests on CPU engines.

vLLM puts its null block (block 0) in a sliding-window group's block table where the window
dropped a block. Nothing should ever read it; it holds zeros, so a read that should not happen
(the last prompt token's attention reaching one position past what vLLM kept, see
:mod:`kvbridge.scheduling.handoff`) changes the output only now and then. This connector fills
the null block with NaN before registering the KV cache, so such a read turns the output into
garbage and a test comparing D's output with a single engine's catches it every time.

Load it with ``kv_connector: KVBridgeNullPoisonConnector`` and
``kv_connector_module_path: kvbridge.testing.null_poison``. CPU layouts only (the block
dimension first, as vLLM's CPU backend allocates it).
"""

from __future__ import annotations

from typing import Any

from kvbridge.integrations.vllm import KVBridgeConnector
from kvbridge.integrations.vllm_groups import NULL_BLOCK

__all__ = ["KVBridgeNullPoisonConnector"]


class KVBridgeNullPoisonConnector(KVBridgeConnector):
    """See the module docstring."""

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        for tensor in kv_caches.values():
            tensor[NULL_BLOCK].fill_(float("nan"))
        super().register_kv_caches(kv_caches)
