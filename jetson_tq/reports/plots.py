"""PNG plots for the demo and the capacity report (matplotlib, headless Agg backend, imported lazily)."""

from __future__ import annotations

import math
from pathlib import Path

from ..config import TurboQuantConfig
from .capacity import GB, bytes_per_token, layer_formats, memory_curve
from .model_specs import ModelSpec


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_capacity(model: ModelSpec, configs: list[TurboQuantConfig], kv_budget_bytes: int, path: str | Path,
                  title: str = "") -> Path:
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
        line, = ax.plot([x / 1e6 for x in xs], ys, label=f"{config.name}: {bpt:,} B/token, {fit / 1e6:.2f} M tokens fit")
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


def plot_theorem1(rows: list[dict], path: str | Path) -> Path:
    """Theorem 1: measured TurboQuant_mse distortion vs bits, with the paper's values and bounds (log scale)."""
    plt = _pyplot()
    bits = [r["bits"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.semilogy(bits, [r["measured"] for r in rows], "o-", label="measured")
    ax.semilogy(bits, [r["paper"] for r in rows], "x", label="paper")
    ax.semilogy(bits, [r["lower_bound"] for r in rows], "--", label="lower bound 4^-b")
    ax.semilogy(bits, [r["upper_bound"] for r in rows], "--", label="upper bound sqrt(3) pi/2 4^-b")
    ax.set_xlabel("bits per coordinate b")
    ax.set_ylabel("E ||x - x~||^2 (unit x)")
    ax.set_xticks(bits)
    ax.set_title("Theorem 1: TurboQuant_mse distortion")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(fig, plt, path)


def plot_theorem2(rows: list[dict], path: str | Path) -> Path:
    """Theorem 2: d x inner-product distortion of TurboQuant_prod vs bits, with bounds (log scale)."""
    plt = _pyplot()
    bits = [r["bits"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.semilogy(bits, [r["distortion_times_d"] for r in rows], "o-", label="measured d x D_prod")
    ax.semilogy(bits, [r["paper_times_d"] for r in rows], "x", label="paper")
    ax.semilogy(bits, [4.0 ** -b for b in bits], "--", label="lower bound 4^-b")
    ax.semilogy(bits, [math.sqrt(3) * math.pi ** 2 * 4.0 ** -b for b in bits], "--", label="upper bound")
    ax.set_xlabel("bits per coordinate b")
    ax.set_ylabel("d x E |<y,x> - <y,x~>|^2")
    ax.set_xticks(bits)
    ax.set_title("Theorem 2: TurboQuant_prod inner products")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(fig, plt, path)


def _save(fig, plt, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
