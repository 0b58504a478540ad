"""PNG plots of sweeps and validations (matplotlib, off-screen Agg backend).

- :func:`plot_sweep`: TTFT p50, TTFT p99 and TPOT p50 against the request rate, one line per mode.
- :func:`plot_validation`: the same panels, measured (solid) against simulated (dashed) per mode.

matplotlib is imported only here, and only when a plot is drawn; where it is missing, drawing
raises :class:`~kvbridge.errors.KVBridgeError` naming the file (the CLI's one-line error).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvbridge.errors import KVBridgeError
from kvbridge.tools.simulate.metrics import Summary

__all__ = ["PANELS", "plot_sweep", "plot_validation"]

#: (metric, percentile key, panel title)
PANELS: tuple[tuple[str, str, str], ...] = (
    ("ttft", "p50", "TTFT p50"), ("ttft", "p99", "TTFT p99"), ("tpot", "p50", "TPOT p50"))


def _axes(n: int, path: Path) -> tuple[Any, Any]:
    try:
        import matplotlib
    except ImportError:
        raise KVBridgeError(f"--plot {path}: not drawn, matplotlib is not installed "
                            "(pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, n, figsize=(5.0 * n, 4.2), squeeze=False)
    return fig, axes[0]


def _finish(fig: Any, axes: Any, rates: Sequence[float], path: Path, title: str) -> Path:
    import matplotlib.pyplot as plt

    for ax, (_, _, name) in zip(axes, PANELS, strict=True):
        if rates and max(rates) / min(rates) >= 4:
            ax.set_xscale("log", base=2)
        ax.set_xticks(list(rates))
        ax.set_xticklabels([f"{r:g}" for r in rates])
        ax.minorticks_off()
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _value(s: Summary, metric: str, key: str) -> float | None:
    return (s.ttft if metric == "ttft" else s.tpot).get(key)


def plot_sweep(rows: Sequence[Summary], path: Path, title: str) -> Path:
    """TTFT/TPOT against rate per mode, from :func:`~kvbridge.tools.simulate.sizing.sweep` rows."""
    fig, axes = _axes(len(PANELS), path)
    modes = list(dict.fromkeys(s.mode for s in rows))
    rates = sorted({s.rate for s in rows})
    for ax, (metric, key, _) in zip(axes, PANELS, strict=True):
        for mode in modes:
            pts = sorted((s.rate, _value(s, metric, key)) for s in rows if s.mode == mode)
            xs = [x for x, y in pts if y is not None]
            ax.plot(xs, [y for _, y in pts if y is not None], marker="o", label=mode)
    return _finish(fig, axes, rates, path, title)


def plot_validation(pairs: Sequence[Mapping[str, Any]], path: Path, title: str) -> Path:
    """Measured vs simulated: ``pairs`` rows with ``mode``, ``rate`` and, per panel,
    ``measured_<metric>_<key>`` / ``simulated_<metric>_<key>`` in ms."""
    fig, axes = _axes(len(PANELS), path)
    modes = list(dict.fromkeys(str(p["mode"]) for p in pairs))
    rates = sorted({float(p["rate"]) for p in pairs})
    colours = {m: f"C{i}" for i, m in enumerate(modes)}
    for ax, (metric, key, _) in zip(axes, PANELS, strict=True):
        for mode in modes:
            rows = sorted((p for p in pairs if p["mode"] == mode), key=lambda p: p["rate"])
            for kind, style in (("measured", "-"), ("simulated", "--")):
                pts = [(float(p["rate"]), p.get(f"{kind}_{metric}_{key}")) for p in rows]
                pts = [(x, y) for x, y in pts if y is not None]
                ax.plot([x for x, _ in pts], [y for _, y in pts], style, marker="o",
                        color=colours[mode], label=f"{mode} {kind}")
    return _finish(fig, axes, rates, path, title)
