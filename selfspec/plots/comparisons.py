"""Bars at summary values with a dot per prompt: strategies per prompt category, greedy decoding vs sampling."""

import textwrap
from collections import Counter

from matplotlib.figure import Figure

from selfspec.errors import SelfspecError
from selfspec.plots.common import (COLORS, METRIC_PANELS, METRICS, bars_with_prompts, figure_legend, metric_axes,
                                   new_figure, nonempty, of_strategy, set_title, strategy_summary, styled, subplots)
from selfspec.records.prompt_records import PromptRecord, summarize
from selfspec.records.runs import Run


@styled
def plot_strategy_speedups(records: list[PromptRecord], *, model: str | None = None, date=None) -> Figure:
    """Speedup over plain decoding per prompt category (and all prompts) for each non-plain strategy: bars at the
    category's total tokens/s ratio, a dot per prompt."""
    what = "strategy speedups"
    names = [s for s in dict.fromkeys(r.strategy for r in nonempty(records, what, "records")) if s != "plain"]
    if not names:
        raise SelfspecError(f"{what}: only plain decoding in these records; nothing to compare")
    summary = summarize(records)
    categories = list(dict.fromkeys(r.category for r in records))
    groups = categories + (["all"] if len(categories) > 1 else [])
    fig = new_figure(min(11.0, max(5.5, 1.5 + 0.75 * len(groups) * max(1, len(names) / 3))), 3.4)
    (ax,) = subplots(fig, 1, 1)
    width = 0.8 / len(names)
    for number, name in enumerate(names):
        strategy_summary(records, name, what)
        xs = [g + (number - (len(names) - 1) / 2) * width for g in range(len(groups))]
        heights = [(summary[name] if group == "all" else summary[name]["by_category"].get(group, {})).get("speedup")
                   for group in groups]
        per_prompt = [[r.speedup for r in records if r.strategy == name and group in ("all", r.category)]
                      for group in groups]
        bars_with_prompts(ax, xs, heights, per_prompt, COLORS[number % len(COLORS)], name, width)
    n = Counter(r.category for r in records if r.strategy == names[0])
    labels = [f"{g}\n(n={n[g] if g != 'all' else sum(n.values())})" for g in groups]
    ax.set_xticks(range(len(groups)), labels, rotation=30 if len(groups) > 8 else 0)
    ax.grid(axis="x", visible=False)
    ax.axhline(1.0, color="0.4", linestyle="--", linewidth=1, label="plain decoding")
    ax.set_ylabel(METRICS["speedup"][0])
    ax.set_xlabel("prompt category (n = prompts)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    set_title(fig, "Speedup by strategy and prompt category", model, date, "dots: single prompts")
    return fig


@styled
def plot_sampling(runs: list[Run], *, strategy: str = "self_spec", model: str | None = None, date=None) -> Figure:
    """Acceptance rate, tokens per verification and speedup per sampling setting (each run's sampling_label:
    greedy, temperature/top-p): bars at each run's summary value, a dot per prompt."""
    what = "sampling"
    for run in nonempty(runs, what, "runs"):
        of_strategy(run.records, strategy, what)
    fig = new_figure(max(7.5, 2.5 * len(runs) + 3), 3.2)
    axes = subplots(fig, 1, 3)
    for ax, metric in zip(axes, METRIC_PANELS):
        for number, run in enumerate(runs):
            value = strategy_summary(run.records, strategy, what)[metric]
            values = [getattr(r, metric) for r in run.records if r.strategy == strategy]
            bars_with_prompts(ax, [number], [value], [values], COLORS[number % len(COLORS)], f"_{run.sampling_label}",
                              0.6)
        ax.set_xticks(range(len(runs)), [textwrap.fill(run.sampling_label, 14) for run in runs])
        ax.grid(axis="x", visible=False)
    metric_axes(axes, METRIC_PANELS)
    figure_legend(fig, axes)
    n_prompts = len({r.question_id for run in runs for r in run.records})
    set_title(fig, "Greedy decoding vs sampling", model, date, f"strategy {strategy}", f"{n_prompts} prompts",
              "dots: single prompts")
    return fig
