"""kvbridge: one vLLM KV connector for disaggregated prefill/decode.

Push or pull per request, over any transport (see ``docs/concepts.md``).
"""

__version__ = "0.1.0"
