"""PNG plots of the capacity report (matplotlib, headless Agg backend, imported lazily)."""

from __future__ import annotations

from pathlib import Path

from ..config import TurboQuantConfig
from ..models.specs import ModelSpec
from .capacity import GB, bytes_per_token, layer_formats, memory_curve


def pyplot():
    """matplotlib's pyplot on the headless Agg backend (imported on first use: the capacity CLI runs without it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_capacity(
    model: ModelSpec, configs: list[TurboQuantConfig], kv_budget_bytes: int, path: str | Path, title: str = ""
) -> Path:
    """Memory (GB) vs tokens held, one line per config, with the KV budget as a horizontal line."""
    plt = pyplot()
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
    return save_figure(fig, plt, path)


def save_figure(fig, plt, path: str | Path) -> Path:
    """Write ``fig`` as a PNG at ``path`` (its folder created) and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
