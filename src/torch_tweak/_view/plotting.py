"""result.plot(path): a PNG chart of latency per depth against the untuned model."""

from __future__ import annotations

import os
import textwrap
from typing import Any, Mapping


def bars(result: Any, alternatives: Mapping[str, float] | None = None) -> tuple[list, list, list, list, str]:
    """What plot_result draws: (labels, values in ms, colors, skipped depths' lines, title).

    Every bar of a depth or of the untuned model comes from one measurement, so the bars
    compare as they were measured: the depth search's (its untuned baseline and each depth),
    or that side-by-side measurement's untuned model and depth only, when the side-by-side
    figures disagreed with the search's and were the smaller, or the machine was busy (a burst
    during one of the search's measurements draws a gain the side-by-side one did not see):
    the other depths are then listed with their search figures, not drawn. The title gives
    result.speedup, the figure tweak reports.
    """
    labels, values, colors, skipped = [], [], [], []
    side = result.confirmation
    quality = getattr(result, "measurement_quality", "unchecked")
    measured = side is not None and side.get("tuned") is not None and side.get("untuned") is not None
    if measured and (quality == "busy" or (quality == "inconsistent" and not side["from_search"])):
        # a busy machine's search figures (one burst on the untuned run draws 8x where side by
        # side was 1.6x), or the smaller figure was the side-by-side one: that measurement alone
        source = ("side by side, on a busy machine" if quality == "busy"
                  else "side by side (the depth search measured at another load)")
        labels += ["untuned", f"depth {side['depth']}"]
        values += [side["untuned"]["median_ns"] / 1e6, side["tuned"]["median_ns"] / 1e6]
        colors += ["#9e9e9e", "#2e7d32" if result.selected_depth is not None else "#64b5f6"]
        skipped += [f"depth {row.depth}: {row.latency_ms:.3g} ms in the depth search (another load: not drawn)"
                    for row in result.rows if row.latency_ms is not None and row.depth != side["depth"]]
    else:
        source = "the depth search"
        if result.untuned.latency_ms is not None:
            labels.append("untuned")
            values.append(result.untuned.latency_ms)
            colors.append("#9e9e9e")
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
    title = "torch-tweak: latency per depth"
    if result.selected_depth is not None and result.speedup and quality == "busy":
        title += f" (depth {result.selected_depth} kept, {result.speedup:.2f}x, measured busy)"
    elif result.selected_depth is not None and result.speedup:
        title += f" (depth {result.selected_depth} kept, {result.speedup:.2f}x)"
    elif quality == "busy":
        title += " (measured busy: nothing kept)"
    if values:
        title += f"\nbars: {source}"
    return labels, values, colors, skipped, title


def plot_result(result: Any, path: str | os.PathLike, alternatives: Mapping[str, float] | None = None) -> str:
    """Writes a bar chart of `result` (a TweakResult) to `path` as PNG; returns the path.

    One bar per measured depth, one for the untuned model (see bars: all from one
    measurement), and one per entry of `alternatives` ({label: latency in ms}, e.g. other
    ways of running the model you measured yourself). The kept depth is highlighted; skipped
    depths are listed with their error. Needs matplotlib (pip install torch-tweak[plot]).
    """
    try:
        import matplotlib
        matplotlib.use("Agg", force=False)
        from matplotlib import pyplot as plt
    except ImportError:
        raise ImportError("result.plot needs matplotlib: pip install 'torch-tweak[plot]'") from None
    path = os.fspath(path)
    fig = figure(result, alternatives, plt)
    try:
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"cannot write {path}: the folder {directory} does not exist")
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
    return path


def figure(result: Any, alternatives: Mapping[str, float] | None, plt: Any) -> Any:
    """The chart's matplotlib figure (plot_result writes it); its title wrapped to its width."""
    labels, values, colors, skipped, title = bars(result, alternatives)
    if not values:
        raise ValueError("nothing to plot: no depth and no untuned model was measured (a dry run?)")
    width = max(5.0, 1.1 * len(values) + 2)
    fig, ax = plt.subplots(figsize=(width, 4.2), dpi=110)
    try:
        drawn = ax.bar(range(len(values)), values, color=colors)
        ax.set_xticks(range(len(values)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_ylabel("latency per call (ms), lower is better")
        # a 10-point character is at most about 6 points wide: the lines fit the figure's width
        fits = max(20, int(width * 72 / 6.5))
        ax.set_title("\n".join(textwrap.fill(line, fits) for line in title.split("\n")), fontsize=10)
        for bar, value in zip(drawn, values):
            ax.annotate(f"{value:.3g}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
        if skipped:
            ax.text(0.99, 0.98, "\n".join(textwrap.fill(line, int(width * 72 / 5)) for line in skipped)[:600],
                    transform=ax.transAxes, ha="right", va="top", fontsize=7, color="#b71c1c")
        fig.tight_layout()
    except BaseException:
        plt.close(fig)
        raise
    return fig
