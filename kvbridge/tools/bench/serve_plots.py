"""The benches' figures against the request rate: ``kvbridge bench serve``'s TTFT p50, TTFT p99
and TPOT p50 (:func:`write_plots`), and the panels any bench draws the same way
(:func:`draw_rate_panels`, e.g. ``bench mix``'s goodput).

Contract: :func:`write_plots` draws :data:`PLOT_FILE` from a report's rows into a directory and
returns the files written; :func:`draw_rate_panels` draws one figure into a file. Both need
matplotlib (imported there, drawn off-screen with Agg), so check :func:`matplotlib_available`
first. Nothing else here has side effects.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvbridge.tools.bench.serve_results import finite
from kvbridge.tools.bench.serve_settings import SETUP_NAMES

__all__ = ["PLOT_FILE", "PLOT_PANELS", "draw_rate_panels", "matplotlib_available", "write_plots"]

PLOT_FILE = "bench_serve.png"
#: (row key, panel title) of the figure's panels, left to right
PLOT_PANELS: tuple[tuple[str, str], ...] = (("ttft_p50", "TTFT p50"), ("ttft_p99", "TTFT p99"),
                                            ("tpot_p50", "TPOT p50"))


def _series(rows: Sequence[Mapping[str, Any]], key: str, group: str
            ) -> dict[str, list[tuple[float, float]]]:
    """group → [(rate, value)] sorted by rate, runs without the value left out."""
    out: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        v = finite(r.get(key))
        out.setdefault(str(r[group]), [])
        if v is not None and v > 0:
            out[str(r[group])].append((float(r["rate"]), v))
    return {s: sorted(points) for s, points in out.items()}


def _setup_order(name: str) -> tuple[int, str]:
    return (SETUP_NAMES.index(name) if name in SETUP_NAMES else len(SETUP_NAMES), name)


def write_plots(report: Mapping[str, Any], out_dir: Path) -> list[Path]:
    """Draw :data:`PLOT_FILE` into *out_dir* from a report's rows; the files written.

    One figure, one panel per :data:`PLOT_PANELS` entry, one line per setup
    (:func:`draw_rate_panels`). Needs matplotlib (drawn off-screen, Agg).
    """
    rows = list(report.get("rows") or [])
    cfg: Mapping[str, Any] = report.get("settings") or {}
    fleet = report.get("fleet") or "1P1D"
    title = (f"kvbridge bench serve ({fleet}): backend {cfg.get('backend', '?')}, "
             f"{cfg.get('num_prompts', '?')} prompts of {cfg.get('input_len', '?')} "
             f"tokens, {cfg.get('output_len', '?')} output tokens, {report.get('date', '')}")
    panels = [(key, name, "ms") for key, name in PLOT_PANELS]
    out_dir.mkdir(parents=True, exist_ok=True)
    return [draw_rate_panels(rows, panels, title, out_dir / PLOT_FILE, group="setup",
                             order=_setup_order)]


def draw_rate_panels(rows: Sequence[Mapping[str, Any]],
                     panels: Sequence[tuple[str, str, str]], title: str, path: Path, *,
                     group: str, order: Callable[[str], Any] | None = None) -> Path:
    """Draw one figure into ``path``: a panel per ``(row key, name, unit)`` of ``panels``, the
    ``rate`` of each row on a log2 x-axis, one line per value of the rows' ``group`` key (in
    ``order``; a row without the value leaves a gap); a panel whose values span more than 10x
    gets a log y-axis. Needs matplotlib (drawn off-screen, Agg)."""
    import matplotlib  # optional and heavy: only a run that draws pays for it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    rates = sorted({float(r["rate"]) for r in rows})
    groups = sorted({str(r[group]) for r in rows}, key=order)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.4), squeeze=False)
    try:
        for ax, (key, name, unit) in zip(axes[0], panels, strict=True):
            series = _series(rows, key, group)
            values = [v for s in groups for _, v in series.get(s, [])]
            for s in groups:
                points = series.get(s) or []
                if points:
                    ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=s)
            if rates and max(rates) / min(rates) >= 2:
                ax.set_xscale("log", base=2)
            ax.set_xticks(rates)
            ax.set_xticklabels([f"{r:g}" for r in rates])
            ax.minorticks_off()
            if values and max(values) / min(values) > 10:
                ax.set_yscale("log")  # ticks at 1, 2, 5 x 10^k, written as plain numbers
                ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
                ax.yaxis.set_minor_locator(NullLocator())
                ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
            ax.set_title(f"{name} vs request rate")
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(f"{name} ({unit})")
            ax.grid(True, which="major", alpha=0.3)
            if not values:
                ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        handles, labels = axes[0][0].get_legend_handles_labels()
        if not handles:
            for ax in axes[0][1:]:
                handles, labels = ax.get_legend_handles_labels()
                if handles:
                    break
        if handles:
            fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5),
                       frameon=False)
        fig.suptitle(title)
        fig.tight_layout(rect=(0.0, 0.08, 1.0, 1.0))
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path


def matplotlib_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None

