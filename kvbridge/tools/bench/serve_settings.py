"""``kvbridge bench serve``'s setups, settings and the parsing of its flags' values.

Contract: :data:`SETUP_NAMES` are the setups (kvbridge's three modes share one engine group,
each vLLM connector has its own); :class:`ServeSettings` is every knob of one run (the CLI
flags map one to one). The parsers are pure and raise :class:`~kvbridge.errors.ConfigError`
naming the flag; :func:`run_seed` makes kvbridge's and vLLM's pull (likewise push) see the very
same prompts and arrival times.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvbridge.errors import ConfigError
from kvbridge.tools.args import parse_names
from kvbridge.tools.bench.fleet import MAX_FLEET

__all__ = ["KVBRIDGE_GROUP", "MAX_RATES", "MODE_SLOT", "SETUP_NAMES", "ServeSettings",
           "fleet_name", "parse_fleet", "parse_rates", "parse_setups", "rate_name", "run_seed",
           "setup_group", "setup_groups", "setup_mode"]

SETUP_NAMES: tuple[str, ...] = ("kvbridge-pull", "kvbridge-push", "kvbridge-auto",
                                "kvbridge-headroom", "vllm-nixl-pull", "vllm-nixl-push")
KVBRIDGE_GROUP = "kvbridge"
MAX_RATES = 100
MODE_SLOT = {"pull": 0, "push": 1, "auto": 2, "headroom": 3}


@dataclass(frozen=True)
class ServeSettings:
    """Everything one run needs; the CLI flags map one to one."""

    setups: tuple[str, ...] = SETUP_NAMES
    rates: tuple[float, ...] = (2.0, 4.0, 8.0, 16.0)
    num_prompts: int = 40
    input_len: int = 200
    output_len: int = 16
    seed: int = 0
    backend: str = "nixl"
    warmups: int = 2
    push_headroom: int = 4
    prefill_engines: int = 1
    decode_engines: int = 1
    #: KVBRIDGE_ENGINE_SPIN_MS for kvbridge's engines (negative: vLLM's default 1 s spin)
    engine_spin_ms: float = 2.0
    pin_engines: bool = False
    #: niceness of the proxy and the load generator while the engines keep theirs (0: as is)
    client_nice: int = 0
    request_timeout: float = 120.0
    bench_timeout: float = 600.0
    start_timeout: float = 600.0
    idle_timeout: float = 120.0
    plots: bool = True
    out: Path | None = None
    model_dir: Path | None = None


def parse_setups(text: str) -> tuple[str, ...]:
    """``"a,b"`` → the setups, validated, duplicates removed, order kept; ``all`` → all."""
    return parse_names(text, SETUP_NAMES, "--setups", "setup")


def parse_rates(text: str) -> tuple[float, ...]:
    """``"2,4,8"`` → request rates (req/s): positive, finite, duplicates removed, order kept."""
    rates: list[float] = []
    for part in text.split(","):
        word = part.strip()
        if not word:
            continue
        try:
            rate = float(word)
        except ValueError:
            raise ConfigError(f"--rates: {word!r} is not a number") from None
        if not math.isfinite(rate) or rate <= 0:
            raise ConfigError(f"--rates: {word!r} must be a positive, finite request rate "
                              "(req/s)")
        rates.append(rate)
    if not rates:
        raise ConfigError("--rates names no rate")
    out = tuple(dict.fromkeys(rates))
    if len(out) > MAX_RATES:
        raise ConfigError(f"--rates: at most {MAX_RATES} rates")
    return out


def parse_fleet(text: str) -> tuple[int, int]:
    """``"2P2D"`` → (2, 2): how many prefill and decode engines (1..MAX_FLEET each)."""
    m = re.fullmatch(r"\s*(\d{1,2})\s*[pP]\s*(\d{1,2})\s*[dD]\s*", text)
    if m is None:
        raise ConfigError(f"--fleet: {text!r} is not a fleet shape such as 1P1D or 2P2D")
    shape = (int(m.group(1)), int(m.group(2)))
    if not all(1 <= n <= MAX_FLEET for n in shape):
        raise ConfigError(f"--fleet: {text!r}: 1..{MAX_FLEET} engines per role")
    return shape


def fleet_name(prefill: int, decode: int) -> str:
    return f"{prefill}P{decode}D"


def setup_mode(setup: str) -> str:
    """The proxy mode of a setup: ``pull``, ``push``, ``auto`` (the planner) or ``headroom``."""
    return setup.rsplit("-", 1)[1]


def setup_group(setup: str) -> str:
    """The engine pair a setup runs on: ``kvbridge`` (shared by its modes) or the vLLM setup."""
    return KVBRIDGE_GROUP if setup.startswith("kvbridge-") else setup


def setup_groups(setups: Sequence[str]) -> list[tuple[str, tuple[str, ...]]]:
    """Setups by engine pair, groups in order of first appearance: ``[(group, setups), ...]``."""
    groups: dict[str, list[str]] = {}
    for s in setups:
        groups.setdefault(setup_group(s), []).append(s)
    return [(g, tuple(members)) for g, members in groups.items()]


def run_seed(seed: int, setup: str, rate_index: int) -> int:
    """The ``vllm bench serve --seed`` of one run: equal for the same mode and rate index."""
    return seed + 1000 * MODE_SLOT[setup_mode(setup)] + rate_index


def rate_name(rate: float) -> str:
    return f"{rate:g}".replace(".", "p")

