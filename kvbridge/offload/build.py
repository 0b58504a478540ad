"""Building the configured offload tiers (one engine rank's), in order.

:func:`build_tiers` constructs each tier from its entry point; a tier that cannot be built
closes the ones already built and the error propagates (nothing is left half-open). Blocking
only as long as the tiers' constructors (a disk tier scans its directory; a remote one
connects). No shared state.
"""

from __future__ import annotations

from kvbridge import registry
from kvbridge.offload.config import OffloadConfig
from kvbridge.offload.seal import sealed_size
from kvbridge.offload.tier import Tier, TierContext

__all__ = ["build_tiers"]


def build_tiers(config: OffloadConfig, chunk_bytes: int, namespace: str, *,
                secret: bytes | None = None) -> list[Tier]:
    """Construct the configured tiers in order (raises ConfigError/BackendUnavailable).
    ``chunk_bytes`` is the payload of one chunk (one block of one rank); the tiers store it
    sealed (:mod:`kvbridge.offload.seal`: its digest follows it) unless ``config.sealed`` is
    off (the payload alone). ``secret`` is the engine's
    (:func:`kvbridge.trust.resolve`): tiers that authenticate their chunks (``disk``) key their
    MAC with it."""
    tiers: list[Tier] = []
    size = sealed_size(chunk_bytes, config.sealed)
    try:
        for spec in config.tiers:
            cls = registry.load_tier_class(spec.name)
            tiers.append(cls(TierContext(spec.name, size, namespace, spec.options,
                                         secret=secret)))
    except BaseException:
        for t in tiers:
            t.close()
        raise
    return tiers
