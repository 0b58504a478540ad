"""Tiered offload and KV reuse: content keys, tiers, the worker-side manager, the scheduler book.

Layers (docs/offload.md):

- :mod:`.keys` — chained content keys over full token blocks (stable across processes).
- :mod:`.tier` — the :class:`~kvbridge.offload.tier.Tier` ABC every tier implements.
- :mod:`.tiers` — the built-in tiers, ``dram`` and ``disk`` (entry points in ``kvbridge.tiers``).
- :mod:`.config` — the ``offload`` configuration (``kv_connector_extra_config`` + env).
- :mod:`.manager` — worker side: ordered tiers, capacities, LRU, staging, write-behind.
- :mod:`.book` — scheduler side: lookups, hits, stores, vLLM-free.
"""
