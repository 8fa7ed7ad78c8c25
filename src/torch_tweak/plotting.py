"""result.plot(path): a PNG chart of latency per depth against the untuned model."""

from __future__ import annotations

import os
from typing import Any, Mapping


def plot_result(result: Any, path: str | os.PathLike, alternatives: Mapping[str, float] | None = None) -> str:
    """Writes a bar chart of `result` (a TweakResult) to `path` as PNG; returns the path.

    One bar per measured depth, one for the untuned model, and one per entry of
    `alternatives` ({label: latency in ms}, e.g. other ways of running the model you
    measured yourself). The selected depth is highlighted; skipped depths are listed
    with their error. Needs matplotlib (pip install torch-tweak[plot]).
    """
    try:
        import matplotlib
        matplotlib.use("Agg", force=False)
        from matplotlib import pyplot as plt
    except ImportError:
        raise ImportError("result.plot needs matplotlib: pip install 'torch-tweak[plot]'") from None
    path = os.fspath(path)
    labels, values, colors = [], [], []
    if result.baseline_ms is not None:
        labels.append("untuned")
        values.append(result.baseline_ms)
        colors.append("#9e9e9e")
    skipped = []
    for row in result.rows:
        if row.latency_ms is None:
            skipped.append(f"depth {row.depth}: {row.error or 'not measured'}")
            continue
        labels.append(f"depth {row.depth}\n{row.modules} module" + ("s" if row.modules != 1 else ""))
        values.append(row.latency_ms)
        colors.append("#2e7d32" if row.selected else "#64b5f6")
    for label, value in (alternatives or {}).items():
        labels.append(str(label))
        values.append(float(value))
        colors.append("#ffb74d")
    if not values:
        raise ValueError("nothing to plot: no depth and no untuned model was measured (a dry run?)")
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(values) + 2), 4.2), dpi=110)
    try:
        bars = ax.bar(range(len(values)), values, color=colors)
        ax.set_xticks(range(len(values)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_ylabel("latency per call (ms), lower is better")
        title = "torch-tweak: latency per depth"
        if result.selected_depth is not None and result.speedup:
            title += f" (depth {result.selected_depth} selected, {result.speedup:.2f}x)"
        ax.set_title(title, fontsize=10)
        for bar, value in zip(bars, values):
            ax.annotate(f"{value:.3g}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
        if skipped:
            ax.text(0.99, 0.98, "\n".join(skipped)[:400], transform=ax.transAxes, ha="right", va="top",
                    fontsize=7, color="#b71c1c")
        fig.tight_layout()
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"cannot write {path}: the folder {directory} does not exist")
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
    return path
