"""A discrete-event model of a disaggregated prefill/decode fleet (``kvbridge simulate``).

Pure Python (numpy), no vLLM: requests arrive (Poisson or a trace), P engines prefill in chunked
batches, the KV moves to a D engine by pull or push over a link, D engines decode in batches (or
prefill for themselves: D alone), the kvbridge proxy's own routing code and hand-off planner place
every request. Per-step costs come from a
:class:`~kvbridge.tools.simulate.profile.Profile` whose every parameter names its source.

Modules, each one job, in :mod:`kvbridge.tools.simulate`: ``profile`` (costs, JSON),
``workload`` (arrivals), ``events`` (clock, FIFO resources), ``engines`` (P and D loops),
``fleet`` (routing and the hand-off modes), ``cpu`` (a small host's shared cores), ``metrics``,
``sizing`` (sweeps, sizing), ``plots``, ``validate`` (against ``kvbridge bench serve``
results), ``published`` (vLLM PR #35264's rows), ``calibrate`` and ``calibrate_cpu`` (measure
this host), ``cli``. See docs/simulator.md.
"""
