"""AWS EFA detection and the advice that goes with it.

On an EFA host, NIXL's UCX backend does not use the EFA devices for RDMA (it falls back to TCP
or to the slower ``ib`` path); the LIBFABRIC backend is the one built for EFA. These functions
find EFA devices and turn "UCX configured + EFA present" into one recommendation line. Detection
is a plain function of a sysfs root and an optional ``fi_info`` runner, so tests inject both.
Nothing here imports nixl.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = [
    "SYSFS_INFINIBAND",
    "LIBFABRIC_HINT",
    "detect_efa_devices",
    "efa_advice",
    "fi_info_efa",
]

log = logging.getLogger("kvbridge.transport.nixl")

SYSFS_INFINIBAND = Path("/sys/class/infiniband")

#: What to install when NIXL's LIBFABRIC plugin cannot load.
LIBFABRIC_HINT = (
    "install libfabric >= 2 with the EFA provider (the AWS EFA installer, "
    "https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-start.html, puts it in "
    "/opt/amazon/efa; add /opt/amazon/efa/lib to LD_LIBRARY_PATH), or use backends=['UCX']"
)


def fi_info_efa(timeout: float = 5.0) -> list[str]:
    """EFA domains that ``fi_info -p efa`` lists ([] if fi_info is missing or finds none).

    Blocking for at most ``timeout`` seconds; never raises.
    """
    exe = shutil.which("fi_info") or (
        "/opt/amazon/efa/bin/fi_info" if Path("/opt/amazon/efa/bin/fi_info").exists() else None
    )
    if exe is None:
        return []
    try:
        out = subprocess.run(
            [exe, "-p", "efa"], capture_output=True, text=True, timeout=timeout, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    domains = []
    for line in out.splitlines():
        key, _, value = line.strip().partition(":")
        if key == "domain" and value.strip() and value.strip() not in domains:
            domains.append(value.strip())
    return domains


def detect_efa_devices(
    sysfs_root: Path = SYSFS_INFINIBAND,
    fi_info: Callable[[], Sequence[str]] | None = fi_info_efa,
) -> list[str]:
    """Names of EFA devices on this host.

    Looks for ``<sysfs_root>/*efa*`` (the kernel's ``efa`` driver names devices ``rdmap…`` on
    some AMIs, so ``<dev>/device/driver`` pointing at ``efa`` counts too), then, if nothing was
    found, asks ``fi_info`` (pass ``None`` to skip it). Never raises.
    """
    found: list[str] = []
    try:
        entries = sorted(sysfs_root.iterdir()) if sysfs_root.is_dir() else []
    except OSError:
        entries = []
    for dev in entries:
        driver = ""
        try:
            link = dev / "device" / "driver"
            if link.exists():
                driver = link.resolve().name
        except OSError:
            pass
        if "efa" in dev.name or driver == "efa":
            found.append(dev.name)
    if not found and fi_info is not None:
        try:
            found = list(fi_info())
        except Exception:  # noqa: BLE001 - detection is advisory
            found = []
    return found


def efa_advice(backends: Sequence[str], devices: Sequence[str]) -> str | None:
    """The recommendation to log when UCX is configured on an EFA host, else ``None``."""
    if not devices or "LIBFABRIC" in backends or "UCX" not in backends:
        return None
    return (
        f"this host has AWS EFA devices ({', '.join(devices)}) but the nixl backend uses "
        f"{list(backends)}: UCX does not drive EFA RDMA; set backend option "
        "backends=['LIBFABRIC'] (see docs/efa.md)"
    )
