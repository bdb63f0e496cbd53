"""The demo's theorem plots: measured distortion against bits per coordinate, with the paper's values and bounds
(PNG, through the capacity report's headless matplotlib)."""

from __future__ import annotations

import math
from pathlib import Path

from jetson_tq.reports.plots import pyplot, save_figure


def _plot_vs_bits(
    bits: list[int], series: list[tuple[list[float], str, str]], ylabel: str, title: str, path: str | Path
) -> Path:
    """One log-scale figure of several (values, style, label) series against bits per coordinate."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for values, style, label in series:
        ax.semilogy(bits, values, style, label=label)
    ax.set_xlabel("bits per coordinate b")
    ax.set_ylabel(ylabel)
    ax.set_xticks(bits)
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return save_figure(fig, plt, path)


def plot_theorem1(rows: list[dict], path: str | Path) -> Path:
    """Theorem 1: measured TurboQuant_mse distortion vs bits, with the paper's values and bounds (log scale)."""
    bits = [r["bits"] for r in rows]
    return _plot_vs_bits(
        bits,
        [
            ([r["measured"] for r in rows], "o-", "measured"),
            ([r["paper"] for r in rows], "x", "paper"),
            ([r["lower_bound"] for r in rows], "--", "lower bound 4^-b"),
            ([r["upper_bound"] for r in rows], "--", "upper bound sqrt(3) pi/2 4^-b"),
        ],
        "E ||x - x~||^2 (unit x)",
        "Theorem 1: TurboQuant_mse distortion",
        path,
    )


def plot_theorem2(rows: list[dict], path: str | Path) -> Path:
    """Theorem 2: d x inner-product distortion of TurboQuant_prod vs bits, with bounds (log scale)."""
    bits = [r["bits"] for r in rows]
    return _plot_vs_bits(
        bits,
        [
            ([r["distortion_times_d"] for r in rows], "o-", "measured d x D_prod"),
            ([r["paper_times_d"] for r in rows], "x", "paper"),
            ([4.0**-b for b in bits], "--", "lower bound 4^-b"),
            ([math.sqrt(3) * math.pi**2 * 4.0**-b for b in bits], "--", "upper bound"),
        ],
        "d x E |<y,x> - <y,x~>|^2",
        "Theorem 2: TurboQuant_prod inner products",
        path,
    )
