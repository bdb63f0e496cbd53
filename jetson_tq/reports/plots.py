"""PNG plots for the demo and the capacity report (matplotlib, headless Agg backend, imported lazily)."""

from __future__ import annotations

import math
from pathlib import Path

from ..config import TurboQuantConfig
from ..models.specs import ModelSpec
from .capacity import GB, bytes_per_token, layer_formats, memory_curve


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_capacity(
    model: ModelSpec, configs: list[TurboQuantConfig], kv_budget_bytes: int, path: str | Path, title: str = ""
) -> Path:
    """Memory (GB) vs tokens held, one line per config, with the KV budget as a horizontal line."""
    plt = _pyplot()
    per_config = [(c, layer_formats(c, model)) for c in configs]
    # x axis up to ~1.2x the largest pool capacity among the configs (at least 8k tokens).
    max_tokens = max(kv_budget_bytes / bytes_per_token(f, model) for _, f in per_config)
    top = max(int(max_tokens * 1.2), 8192)
    xs = [int(top * i / 200) for i in range(1, 201)]
    fig, ax = plt.subplots(figsize=(8, 5))
    for config, formats in per_config:
        ys = [b / GB for b in memory_curve(formats, model, xs)]
        bpt = bytes_per_token(formats, model)
        fit = max(kv_budget_bytes, 0) / bpt
        (line,) = ax.plot(
            [x / 1e6 for x in xs], ys, label=f"{config.name}: {bpt:,} B/token, {fit / 1e6:.2f} M tokens fit"
        )
        if fit > 0:
            ax.plot([fit / 1e6], [kv_budget_bytes / GB], "o", color=line.get_color())
    if kv_budget_bytes > 0:
        ax.axhline(kv_budget_bytes / GB, color="grey", linestyle="--", label=f"KV budget {kv_budget_bytes / GB:.1f} GB")
    ax.set_xlabel("tokens held (millions, all sequences)")
    ax.set_ylabel("KV cache memory (GB)")
    ax.set_ylim(0, max(kv_budget_bytes / GB * 1.4, 1e-3))
    ax.set_title(title or f"{model.name}: KV memory vs tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, plt, path)


def _plot_vs_bits(
    bits: list[int], series: list[tuple[list[float], str, str]], ylabel: str, title: str, path: str | Path
) -> Path:
    """One log-scale figure of several (values, style, label) series against bits per coordinate."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for values, style, label in series:
        ax.semilogy(bits, values, style, label=label)
    ax.set_xlabel("bits per coordinate b")
    ax.set_ylabel(ylabel)
    ax.set_xticks(bits)
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(fig, plt, path)


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


def _save(fig, plt, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
