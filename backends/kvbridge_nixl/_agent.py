"""Options of the nixl backend and creation of the NIXL agent.

:class:`NixlOptions` parses the backend options (``kv_connector_extra_config.backend_options``);
:func:`create_agent` imports nixl lazily and builds one ``nixl_agent`` with exactly the
configured NIXL backends, no listen thread (metadata travels over kvbridge's control channel)
and the configured progress-thread delay.

Why the delay: nixl's Python ``nixl_agent`` hard-codes ``pthrDelay = 0``, so UCX's progress
thread re-arms and polls without sleeping and burns one core per idle agent. A non-zero delay
makes the thread wait on the worker's event file descriptor for up to that long; events still
wake it at once, so latency and bandwidth are unchanged (docs/backends/nixl.md has the numbers).
The agent constructor offers no parameter for it, so :func:`create_agent` substitutes the
binding's ``nixlAgent`` factory for the duration of the constructor call, under a lock, and sets
``pthrDelay`` on the config object it receives.

It also sets ``UCX_MODULES=^ib*`` on hosts without RDMA devices before the UCX backend starts
(see :func:`ucx_modules_setting`: the wheel's bundled libnl otherwise crashes every process at
exit).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from kvbridge.errors import BackendUnavailable, ConfigError
from kvbridge_nixl._efa import LIBFABRIC_HINT, SYSFS_INFINIBAND

__all__ = [
    "NixlOptions", "XferMode", "import_nixl", "create_agent", "ucx_modules_setting",
    "NIXL_INSTALL_HINT",
]

log = logging.getLogger("kvbridge.transport.nixl")

NIXL_INSTALL_HINT = (
    "pip install 'kvbridge[nixl]' (on CPU-only hosts: pip install numpy "
    "nixl==1.5.1 nixl-cu13==1.5.1 --no-deps)"
)

XferMode = str  # "auto" | "prepped" | "direct"
_XFER_MODES = ("auto", "prepped", "direct")
_KNOWN = {
    "backends", "backend_params", "progress_thread", "progress_delay_us", "num_threads",
    "xfer_mode", "granule", "max_prepped_entries", "efa_check", "ucx_modules",
}
_patch_lock = threading.Lock()
_import_lock = threading.Lock()  # one first import of nixl at a time (import_nixl)


@dataclass(frozen=True)
class NixlOptions:
    """Typed backend options; see docs/backends/nixl.md for each key."""

    backends: tuple[str, ...] = ("UCX",)
    backend_params: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    progress_thread: bool = True
    progress_delay_us: int = 10_000
    num_threads: int = 0
    xfer_mode: XferMode = "direct"
    granule: int = 0
    max_prepped_entries: int = 1 << 21
    efa_check: bool = True
    ucx_modules: str = "auto"

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> NixlOptions:
        """Validate ``options``; raise :class:`ConfigError` naming the bad key."""
        unknown = sorted(set(options) - _KNOWN)
        if unknown:
            log.warning("nixl backend: ignoring unknown option(s) %s", ", ".join(unknown))
        raw = options.get("backends", ["UCX"])
        if isinstance(raw, str):
            raw = [b for b in raw.replace(";", ",").split(",") if b.strip()]
        if not isinstance(raw, (list, tuple)) or not raw:
            raise ConfigError(f"nixl option backends must be a non-empty list, got {raw!r}")
        backends = tuple(str(b).strip().upper() for b in raw)
        params = options.get("backend_params", {})
        if not isinstance(params, Mapping) or not all(
            isinstance(v, Mapping) for v in params.values()
        ):
            raise ConfigError("nixl option backend_params must map backend name -> {key: value}")
        mode = str(options.get("xfer_mode", "direct"))
        if mode not in _XFER_MODES:
            raise ConfigError(f"nixl option xfer_mode must be one of {_XFER_MODES}, got {mode!r}")
        out = cls(
            backends=backends,
            backend_params={
                str(k).upper(): {str(a): str(b) for a, b in v.items()} for k, v in params.items()
            },
            progress_thread=_bool(options, "progress_thread", True),
            progress_delay_us=_int(options, "progress_delay_us", 10_000, 0),
            num_threads=_int(options, "num_threads", 0, 0),
            xfer_mode=mode,
            granule=_int(options, "granule", 0, 0),
            max_prepped_entries=_int(options, "max_prepped_entries", 1 << 21, 1),
            efa_check=_bool(options, "efa_check", True),
            ucx_modules=str(options.get("ucx_modules", "auto")),
        )
        return out


def _int(options: Mapping[str, Any], key: str, default: int, minimum: int) -> int:
    value = options.get(key, default)
    try:
        out = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"nixl option {key} must be an integer, got {value!r}") from None
    if isinstance(value, bool) or out < minimum:
        raise ConfigError(f"nixl option {key} must be an integer >= {minimum}, got {value!r}")
    return out


def _bool(options: Mapping[str, Any], key: str, default: bool) -> bool:
    value = options.get(key, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no",
                                                    "off"):
        return value.lower() in ("1", "true", "yes", "on")
    raise ConfigError(f"nixl option {key} must be a boolean, got {value!r}")


def import_nixl() -> ModuleType:
    """Import ``nixl._api`` or raise :class:`BackendUnavailable` naming what to install.

    nixl's package picks its wheel by the CUDA version torch was built for. Where torch is
    installed, not imported, and built without CUDA (``torch/version.py`` says ``cuda = None``),
    nixl 1.5 finds nothing on disk and imports torch to ask again (about 2 s, and a few hundred
    MiB, in a process that has no other use for torch: a test peer, a bench agent,
    ``kvbridge doctor``), to get the same None. There the answer is given without the import
    (:func:`_no_cuda_detected`); anywhere else nixl detects as it does. Thread-safe."""
    try:
        with _import_lock, _no_cuda_detected():
            from nixl import _api  # type: ignore[import-not-found,unused-ignore]
    except ImportError as exc:
        raise BackendUnavailable(
            f"the nixl backend needs the nixl package ({exc}); {NIXL_INSTALL_HINT}"
        ) from exc
    return _api  # type: ignore[no-any-return,unused-ignore]


@contextlib.contextmanager
def _no_cuda_detected() -> Iterator[None]:
    """While nixl is first imported on a host whose torch has no CUDA (:func:`_torch_without_cuda`),
    nixl's CUDA detection answers None at once; what it replaced is put back after (the caller
    holds ``_import_lock``)."""
    try:
        import nixl_meta_utils  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        yield
        return
    real = getattr(nixl_meta_utils, "detect_cuda_major", None)
    if real is None or "nixl" in sys.modules or not _torch_without_cuda():
        yield
        return
    nixl_meta_utils.detect_cuda_major = lambda: None
    try:
        yield
    finally:
        nixl_meta_utils.detect_cuda_major = real


def _torch_without_cuda() -> bool:
    """Torch is installed, not imported, and its ``version.py`` says it was built without CUDA
    (read as a file, without importing torch). False when any of that is not known."""
    if "torch" in sys.modules:
        return False
    try:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.origin:
            return False
        text = (Path(spec.origin).parent / "version.py").read_text()
    except (ImportError, ValueError, OSError):
        return False
    return re.search(r"^cuda\s*(:[^=]*)?=\s*None\s*$", text, re.MULTILINE) is not None


class _DelayedBindings:
    """Stand-in for ``nixl._api.nixlBind`` that sets ``pthrDelay`` on the agent config."""

    def __init__(self, real: Any, delay_us: int) -> None:
        self._real = real
        self._delay_us = delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # noqa: N802 - mirrors the binding
        config.pthrDelay = self._delay_us
        return self._real.nixlAgent(name, config)


def ucx_modules_setting(
    opts: NixlOptions, environ: Mapping[str, str], sysfs_root: Path = SYSFS_INFINIBAND
) -> str | None:
    """The ``UCX_MODULES`` value to set before UCX starts, or ``None`` to leave it alone.

    Why: the nixl 1.5.1 wheel bundles UCX's InfiniBand modules with their own libnl-route, whose
    library destructor segfaults at process exit (``rtnl_tc_unregister`` in ``_dl_fini``), so
    every process that created a UCX agent exits with SIGSEGV (status 139) even after a clean
    shutdown. On a host without RDMA devices those modules are useless, so ``auto`` excludes
    them (``^ib*``); with RDMA devices (InfiniBand, RoCE, EFA) nothing changes. An explicit
    ``UCX_MODULES`` in the environment always wins; ``ucx_modules: ""`` disables this;
    any other value is used as is.
    """
    if "UCX" not in opts.backends or "UCX_MODULES" in environ or not opts.ucx_modules:
        return None
    if opts.ucx_modules != "auto":
        return opts.ucx_modules
    try:
        has_rdma = sysfs_root.is_dir() and any(sysfs_root.iterdir())
    except OSError:
        has_rdma = True  # cannot tell: keep UCX's defaults
    return None if has_rdma else "^ib*"


def create_agent(name: str, opts: NixlOptions) -> tuple[Any, dict[str, Any]]:
    """Create the ``nixl_agent`` for ``name``; return it and the effective agent config.

    Every backend in ``opts.backends`` must come up, else :class:`BackendUnavailable` (one line,
    with the install hint for LIBFABRIC). Blocking (plugin loading takes ~0.3–2 s).
    """
    api = import_nixl()
    conf = api.nixl_agent_config(
        enable_prog_thread=opts.progress_thread,
        enable_listen_thread=False,
        backends=[],  # created one by one below, so a missing plugin is an error, not a warning
    )
    real = getattr(api, "nixlBind", None)
    with _patch_lock:
        if real is not None and opts.progress_thread:
            setattr(api, "nixlBind", _DelayedBindings(real, opts.progress_delay_us))  # noqa: B010
        try:
            agent = api.nixl_agent(name, conf)
        except Exception as exc:
            raise BackendUnavailable(f"NIXL agent {name!r} could not start: {exc!r}") from exc
        finally:
            if real is not None:
                setattr(api, "nixlBind", real)  # noqa: B010
    if real is None:
        log.warning("nixl: cannot set the progress-thread delay on this nixl version (busy spin)")
    plugins = list(agent.get_plugin_list())
    modules = ucx_modules_setting(opts, os.environ)
    if modules is not None:
        os.environ["UCX_MODULES"] = modules  # read when the UCX backend initialises, below
        log.info("nixl: set UCX_MODULES=%s (no RDMA devices here; see ucx_modules option)",
                 modules)
    for backend in opts.backends:
        init = dict(opts.backend_params.get(backend, {}))
        if opts.num_threads and backend in ("UCX", "LIBFABRIC", "OBJ"):
            init.setdefault("num_threads", str(opts.num_threads))
        try:
            if backend not in plugins:
                raise LookupError(f"plugin not found (available: {', '.join(plugins)})")
            agent.create_backend(backend, init)
        except Exception as exc:
            del agent
            raise BackendUnavailable(_backend_error(backend, exc)) from exc
    effective = {
        "backends": list(opts.backends),
        "backend_params": {b: dict(opts.backend_params.get(b, {})) for b in opts.backends},
        "progress_thread": opts.progress_thread,
        "progress_delay_us": opts.progress_delay_us if real is not None else 0,
        "num_threads": opts.num_threads,
        "listen_thread": False,
        "plugins": plugins,
        "UCX_TLS": os.environ.get("UCX_TLS", ""),
        "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", ""),
        "UCX_MODULES": os.environ.get("UCX_MODULES", ""),
    }
    return agent, effective


def _backend_error(backend: str, exc: BaseException) -> str:
    detail = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    if backend == "LIBFABRIC":
        return (
            f"NIXL backend LIBFABRIC cannot load on this host ({detail}; the plugin needs "
            f"libfabric.so.1 >= 2.x exporting FABRIC_1.10): {LIBFABRIC_HINT}"
        )
    return f"NIXL backend {backend} cannot load on this host ({detail}); {NIXL_INSTALL_HINT}"
