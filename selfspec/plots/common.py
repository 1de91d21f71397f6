"""What the figures share: the style, the title line, the legend under the panels, summary values with the
prompts' spread."""

import functools
import statistics
import textwrap

import matplotlib
from matplotlib.figure import Figure

from selfspec.errors import SelfspecError
from selfspec.records.prompt_records import PromptRecord, summarize

STYLE = {
    "font.size": 9, "axes.titlesize": 9.5, "axes.labelsize": 9, "legend.fontsize": 8, "xtick.labelsize": 8,
    "ytick.labelsize": 8, "figure.titlesize": 10, "axes.spines.top": False, "axes.spines.right": False,
    "axes.grid": True, "grid.alpha": 0.3, "grid.linewidth": 0.6, "lines.linewidth": 1.5, "lines.markersize": 4.5,
    "legend.frameon": False, "savefig.dpi": 200, "pdf.fonttype": 42, "ps.fonttype": 42,
}
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf", "#7f7f7f"]
# name: (axis label with unit, y limits or None)
METRICS = {
    "acceptance_rate": ("acceptance rate (accepted / drafted)", (0, 1.02)),
    "mean_accepted_tokens": ("tokens per verification step", None),
    "speedup": ("speedup (× plain tokens/s)", None),
}
METRIC_PANELS = ("acceptance_rate", "mean_accepted_tokens", "speedup")  # the panels of run-by-run figures
SPREAD_NOTE = "whiskers: 25–75% of prompts"


def styled(plot):
    """Run a plot function under STYLE: matplotlib reads rcParams when each artist is made."""
    @functools.wraps(plot)
    def wrapper(*args, **kwargs):
        with matplotlib.rc_context(STYLE):
            return plot(*args, **kwargs)
    return wrapper


def nonempty(items: list, what: str, expected: str) -> list:
    if not items:
        raise SelfspecError(f"{what}: nothing to plot (expected a non-empty list of {expected})")
    return items


def of_strategy(records: list[PromptRecord], strategy: str, what: str) -> list[PromptRecord]:
    mine = [r for r in records if r.strategy == strategy]
    if not mine:
        found = ", ".join(dict.fromkeys(r.strategy for r in records)) or "no records"
        raise SelfspecError(f"{what}: no records of strategy {strategy!r} (found: {found})")
    return mine


def new_figure(width: float, height: float) -> Figure:
    return Figure(figsize=(width, height), layout="constrained")


def subplots(fig: Figure, nrows: int, ncols: int, **kwargs):
    return [ax for row in fig.subplots(nrows, ncols, squeeze=False, **kwargs) for ax in row]


def set_title(fig: Figure, title: str, model: str | None, date, *notes: str) -> None:
    """Title, then one line: model, date of the records, notes."""
    meta = " · ".join(str(part) for part in (model and f"model: {model}", date and f"records: {date}", *notes)
                      if part)
    width = int(fig.get_figwidth() * 72 / (0.56 * STYLE["figure.titlesize"]))  # characters that fit the width
    lines = textwrap.wrap(meta, width, break_long_words=False) if meta else []
    fig.suptitle("\n".join([title, *lines]))


def figure_legend(fig: Figure, axes) -> None:
    """One legend for all panels, under them: every labelled artist once."""
    handles = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    wide = sum(len(label) for label in handles) > 80
    fig.legend(handles.values(), handles.keys(), loc="outside lower center",
               ncols=min(2 if wide else 4, len(handles)))


def strategy_summary(records: list[PromptRecord], strategy: str, what: str) -> dict:
    """summary.json's row of `strategy`; SelfspecError without plain decoding to compare with."""
    row = summarize(records)[strategy]
    if row["speedup"] is None:
        raise SelfspecError(f"{what}: no 'plain' records, so no speedup; run strategies=[plain, {strategy}]")
    return row


def quartiles(values) -> tuple[float, float] | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    if len(values) == 1:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def metric_points(ax, xs, records_list, strategy: str, metric: str, what: str, color, label, marker="o",
                  linestyle="-"):
    """Summary value of each run as a line with markers, and the prompts' 25-75% range as whiskers."""
    ys = [strategy_summary(records, strategy, what)[metric] for records in records_list]
    ax.plot(xs, [float("nan") if y is None else y for y in ys], marker=marker, color=color, label=label,
            linestyle=linestyle)
    spread_whiskers(ax, xs, [[getattr(r, metric) for r in records if r.strategy == strategy]
                             for records in records_list], color)
    return ys


def spread_whiskers(ax, xs, values_list, color) -> None:
    """At each x a whisker over the 25-75% range of its values (None values ignored; none at all: no whisker)."""
    for x, values in zip(xs, values_list):
        spread = quartiles(values)
        if spread is not None:
            ax.vlines(x, *spread, color=color, linewidth=1, alpha=0.6)


def metric_axes(axes, metrics) -> None:
    for ax, metric in zip(axes, metrics):
        label, limits = METRICS[metric]
        ax.set_ylabel(label)
        if limits:
            ax.set_ylim(*limits)
        if metric == "speedup":
            ax.axhline(1.0, color="0.4", linestyle="--", linewidth=1, label="plain decoding")


def bars_with_prompts(ax, xs, heights, per_prompt, color, label, width):
    """Bars at the summary values, one dot per prompt (deterministic jitter)."""
    ax.bar(xs, [float("nan") if h is None else h for h in heights], width=width, color=color, alpha=0.85,
           label=label)
    for x, values in zip(xs, per_prompt):
        values = [v for v in values if v is not None]
        offsets = [(((i * 0.618) % 1) - 0.5) * width * 0.6 for i in range(len(values))]
        ax.plot([x + o for o in offsets], values, linestyle="none", marker="o", markersize=2.5, color="0.15",
                alpha=0.55, label="_prompt")
