"""The built-in offload tiers: host DRAM and local disk (entry-point group ``kvbridge.tiers``)."""
