"""Loading the Mooncake Transfer Engine and translating its failures.

The ``mooncake`` module is imported lazily (listing kvbridge backends must stay cheap) and every
way it can fail to load becomes one :class:`~kvbridge.errors.BackendUnavailable` line that names
what to install. Nothing here moves data.
"""

from __future__ import annotations

import logging
import os
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from kvbridge.errors import BackendUnavailable

__all__ = [
    "PIP_HINT",
    "APT_HINT",
    "import_engine_module",
    "create_engine",
    "probe",
    "engine_transfer_timeout_s",
    "is_bad_batch_id",
]

log = logging.getLogger("kvbridge.transport.mooncake")

PIP_HINT = "pip install mooncake-transfer-engine-non-cuda"
APT_HINT = "apt-get install -y libibverbs1"
_CUDA_HINT = (
    "the CUDA wheel 'mooncake-transfer-engine' is installed but this host has no CUDA runtime; "
    "on CPU hosts run: pip uninstall -y mooncake-transfer-engine && " + PIP_HINT
)

# batch_transfer_async_* answers 0 when submission failed and -1 (as an unsigned 64-bit id)
# when the peer's segment could not be opened.
_BAD_BATCH_IDS = frozenset({0, (1 << 64) - 1, -1})


def import_engine_module() -> Any:
    """Import and return ``mooncake.engine``; raise :class:`BackendUnavailable` with one line."""
    try:
        import mooncake.engine as engine_module
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "mooncake":
            raise BackendUnavailable(
                f"mooncake backend: the Mooncake Transfer Engine is not installed — {PIP_HINT}"
            ) from exc
        raise BackendUnavailable(f"mooncake backend cannot load: {exc} — {PIP_HINT}") from exc
    except ImportError as exc:
        text = str(exc)
        if "libibverbs" in text or "libnl" in text:
            hint = APT_HINT
        elif "libcudart" in text or "libcuda" in text:
            hint = _CUDA_HINT
        elif "libnuma" in text:
            hint = "apt-get install -y libnuma1"
        elif "libcurl" in text:
            hint = "apt-get install -y libcurl4"
        else:
            hint = f"{PIP_HINT} and {APT_HINT}"
        raise BackendUnavailable(
            f"mooncake backend: mooncake.engine cannot load ({text.splitlines()[0]}) — {hint}"
        ) from exc
    return engine_module


def create_engine(host: str, metadata_server: str, protocol: str, device_name: str) -> Any:
    """Construct and initialise a ``TransferEngine``; raise :class:`BackendUnavailable` on failure.

    Blocking (engine start-up takes tens of milliseconds). The engine logs one harmless
    ``Local segment descriptor not found`` line at start-up.
    """
    module = import_engine_module()
    if protocol == "efa" and not getattr(module, "SUPPORT_EFA", False):
        raise BackendUnavailable(
            "mooncake backend: protocol 'efa' needs a Mooncake build with EFA support; the "
            "installed wheel has none (mooncake.engine.SUPPORT_EFA is false) — use 'rdma'/'tcp' "
            "or the nixl backend with LIBFABRIC"
        )
    engine = module.TransferEngine()
    rc = engine.initialize(host, metadata_server, protocol, device_name)
    if rc != 0:
        raise BackendUnavailable(
            f"mooncake backend: TransferEngine.initialize(host={host!r}, "
            f"metadata_server={metadata_server!r}, protocol={protocol!r}, "
            f"device_name={device_name!r}) failed with rc {rc}"
            + ("" if protocol == "tcp" else " — no RDMA/EFA device on this host? use 'tcp'")
        )
    return engine


def probe() -> str:
    """Say whether the engine module loads; raise :class:`BackendUnavailable` when it does not."""
    module = import_engine_module()

    dist, ver = "mooncake", "?"
    for name in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        try:
            dist, ver = name, version(name)
            break
        except PackageNotFoundError:
            continue
    extras = [
        flag.removeprefix("SUPPORT_").lower()
        for flag in ("SUPPORT_CUDA", "SUPPORT_EFA")
        if getattr(module, flag, False)
    ]
    return f"ok ({dist} {ver}; tcp, rdma{''.join(', ' + e for e in extras)})"


def engine_transfer_timeout_s() -> float:
    """The engine's own per-batch timeout: ``MC_TRANSFER_TIMEOUT`` seconds (default 30, min 5)."""
    raw = os.environ.get("MC_TRANSFER_TIMEOUT")
    try:
        return float(max(5, int(raw))) if raw else 30.0
    except ValueError:
        return 30.0


def is_bad_batch_id(batch_id: int) -> bool:
    """True when an async submission returned one of the engine's failure values."""
    return batch_id in _BAD_BATCH_IDS or batch_id < 0
