"""``kvbridge doctor``: check what makes deployments fail, one line per check.

:mod:`~kvbridge.tools.doctor.target` says what a check looks at and answers
(:class:`~kvbridge.tools.doctor.target.Target`, :class:`~kvbridge.tools.doctor.target.Check`);
:mod:`~kvbridge.tools.doctor.checks` holds the checks, :mod:`~kvbridge.tools.doctor.probes` the
host probes they ask, and :mod:`~kvbridge.tools.doctor.run` runs them all and is the command
(a lazy command of :mod:`kvbridge.tools.cli`).

Contract:

* A check is a small function of a :class:`Target` (the effective configuration, the TP size
  and the backends and tiers that configuration uses) returning one :class:`Check`, or a list
  of them for per-item checks (one line per backend). A ``detail`` that is not ``ok`` says what
  to do.
* Status: ``ok``; ``warn`` (works, or does not matter for this configuration, but deserves a
  look); ``fail`` (this configuration will not work on this host); ``skip`` (does not apply
  here, e.g. no EFA devices). Something the configuration does not use is never a ``fail``:
  a backend that cannot load, or a missing library only an unused backend needs, is a ``warn``.
* :func:`~kvbridge.tools.doctor.run.run_checks` never raises because of a check: an unexpected
  exception in one becomes a ``fail`` line naming it. It blocks for a few seconds to about half
  a minute: it imports vLLM (~10 s) and starts throw-away processes (a CMA probe, a NIXL
  agent), each bounded by a timeout and always reaped; it binds and closes test sockets, and
  changes nothing else.
* vLLM is imported only inside :func:`~kvbridge.tools.doctor.checks.check_vllm` (through
  :mod:`kvbridge.integrations.vllm`), so the doctor works, reporting the failure, where vLLM is
  missing.

``kvbridge doctor`` exits with status 1 when any line is ``fail``, else 0.
"""
