"""``kvbridge doctor``'s runner and command line: every check, in report order, never a traceback.

Contract: :func:`run_checks` runs :data:`CHECKS` against a configuration and never raises
because of a check (a check that crashes is a ``fail`` line naming it); :func:`diagnose` first
loads the configuration as an engine would. :func:`add_arguments` / :func:`cli_main` are the
lazy command ``kvbridge doctor`` (exit status 1 when a line is ``fail``). Blocking: a few
seconds to about half a minute (vLLM's import, throw-away probe processes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvbridge.config import Config, Preset
from kvbridge.errors import ConfigError
from kvbridge.tools.connector_args import add_connector_arguments, connector_args
from kvbridge.tools.doctor.checks import (
    check_backends,
    check_cma,
    check_efa,
    check_huge_pages,
    check_ibverbs,
    check_mapped_copies,
    check_nixl_plugins,
    check_ports,
    check_ptrace_scope,
    check_python,
    check_security,
    check_tiers,
    check_ucx_devices,
    check_vllm,
    check_wake,
)
from kvbridge.tools.doctor.target import Check, Status, Target
from kvbridge.tools.report import print_json, print_table, terminal_width

__all__ = ["CHECKS", "CheckFn", "add_arguments", "cli_main", "diagnose", "failed", "run_checks"]

CheckFn = Callable[[Target], "Check | list[Check]"]

#: Every check in report order, with the name its line gets if it crashes.
CHECKS: tuple[tuple[str, CheckFn], ...] = (
    ("python", check_python),
    ("vllm", check_vllm),
    ("wake on arrival", check_wake),
    ("backends", check_backends),
    ("tiers", check_tiers),
    ("shm ptrace_scope", check_ptrace_scope),
    ("shm cma", check_cma),
    ("huge pages", check_huge_pages),
    ("shm mapped copies", check_mapped_copies),
    ("nixl plugins", check_nixl_plugins),
    ("nixl ucx devices", check_ucx_devices),
    ("nixl efa", check_efa),
    ("mooncake libibverbs", check_ibverbs),
    ("ports", check_ports),
    ("security", check_security),
)


def _guarded(name: str, fn: CheckFn, target: Target) -> list[Check]:
    try:
        out = fn(target)
    except Exception as exc:  # noqa: BLE001 - a broken check is a line, never a traceback
        return [Check(name, Status.FAIL, f"the check itself failed: {type(exc).__name__}: {exc}")]
    return [out] if isinstance(out, Check) else list(out)


def run_checks(config: Config, tp: int = 1, *, connector: str | None = None) -> list[Check]:
    """Run :data:`CHECKS` against ``config`` for ``tp`` ranks (see the module docstring)."""
    if tp < 1:
        raise ConfigError(f"tp must be >= 1, got {tp}")
    target = Target.of(config, tp, connector)
    return [line for name, fn in CHECKS for line in _guarded(name, fn, target)]


def diagnose(extra: Mapping[str, Any] | None = None, *, preset: Preset | None = None,
             connector: str | None = None, tp: int = 1,
             env: Mapping[str, str] | None = None) -> list[Check]:
    """Load the configuration as an engine would (``Config.load(extra, env, preset)``), report
    it as the ``config`` line, then :func:`run_checks`. A configuration that does not load is a
    ``fail`` line, and the other checks run against the defaults."""
    try:
        config = Config.load(extra, env, preset)
    except ConfigError as exc:
        first = Check("config", Status.FAIL, f"{exc}; the checks below use the defaults")
        config = Config.load({}, {})
    else:
        tiers = ", ".join(t.name for t in config.offload_config().tiers) or "none"
        text = (f"backend {config.backend} ({config.sources.get('backend', 'default')}), mode "
                f"{config.mode.value}, offload tiers: {tiers}")
        if config.warnings:
            first = Check("config", Status.WARN, f"{text}; {'; '.join(config.warnings)}")
        else:
            first = Check("config", Status.OK, text)
    return [first, *run_checks(config, tp, connector=connector)]


def failed(checks: Sequence[Check]) -> bool:
    """True when any line is ``fail`` (``kvbridge doctor`` then exits with status 1)."""
    return any(c.status is Status.FAIL for c in checks)


# -- command line (``kvbridge doctor``, a lazy command of kvbridge.tools.cli) -------------------


def add_arguments(p: Any) -> None:
    """The options of ``kvbridge doctor``."""
    p.description = ("Check what makes deployments fail, one line per check: the configuration, "
                     "vLLM and the connector names, every backend and tier, ptrace/CMA for shm, "
                     "NIXL plugins, UCX and EFA devices, libibverbs for Mooncake, the control "
                     "ports, the secret on a routable address. Exit status 1 when a check fails.")
    add_connector_arguments(p)
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel size (the ports of ranks 0..tp-1 are checked)")
    p.add_argument("--width", type=int, default=None, metavar="COLUMNS",
                   help="wrap the detail column so lines fit COLUMNS characters (default: the "
                   "terminal's width, 100 when not a terminal; 0: no wrapping)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def cli_main(args: Any) -> int:
    named = connector_args(args)
    checks = diagnose(named.extra, preset=named.preset, connector=named.connector, tp=args.tp)
    if args.json:
        print_json([c.to_json() for c in checks])
    else:
        print_table(["check", "status", "detail"],
                    [(c.name, c.status.word, c.detail) for c in checks],
                    width=terminal_width() if args.width is None else args.width)
    return 1 if failed(checks) else 0
