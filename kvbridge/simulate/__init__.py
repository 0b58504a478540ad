"""A discrete-event model of a disaggregated prefill/decode fleet (``kvbridge simulate``).

Pure Python (numpy), no vLLM: requests arrive (Poisson or a trace), P engines prefill in chunked
batches, the KV moves to a D engine by pull or push over a link, D engines decode in batches, the
kvbridge proxy's own routing code places every request. Per-step costs come from a
:class:`~kvbridge.simulate.profile.Profile` whose every parameter names its source.

Modules, each one job: :mod:`~kvbridge.simulate.profile` (costs, JSON), :mod:`~kvbridge.simulate.
workload` (arrivals), :mod:`~kvbridge.simulate.events` (clock, FIFO resources),
:mod:`~kvbridge.simulate.engines` (P and D loops), :mod:`~kvbridge.simulate.fleet` (routing and
the hand-off modes), :mod:`~kvbridge.simulate.cpu` (a small host's shared cores),
:mod:`~kvbridge.simulate.metrics`, :mod:`~kvbridge.simulate.sizing` (sweeps, sizing),
:mod:`~kvbridge.simulate.plots`, :mod:`~kvbridge.simulate.validate` (against ``kvbridge bench
serve`` results), :mod:`~kvbridge.simulate.published` (vLLM PR #35264's rows),
:mod:`~kvbridge.simulate.calibrate` and :mod:`~kvbridge.simulate.calibrate_cpu` (measure this
host), :mod:`~kvbridge.simulate.cli`. See docs/simulator.md.
"""
