"""Sweeps of one setting: acceptance rate, tokens per verification and speedup against the draft-exit threshold
or the share of sublayers skipped, a point per run."""

import statistics

from matplotlib.figure import Figure
from matplotlib.ticker import PercentFormatter

from selfspec.errors import SelfspecError
from selfspec.plots.common import (COLORS, METRIC_PANELS, SPREAD_NOTE, figure_legend, metric_axes, metric_points,
                                   new_figure, nonempty, of_strategy, set_title, styled, subplots)
from selfspec.records.runs import Run

POLICY_LABELS = {"threshold": "fixed threshold", "adaptive": "adaptive (x: initial threshold)"}


@styled
def plot_threshold_sweep(runs: list[Run], *, strategy: str = "self_spec", model: str | None = None,
                         date=None) -> Figure:
    """Acceptance rate, tokens per verification and speedup against each run's draft_threshold (the fixed
    threshold, or the adaptive policy's initial one); a line per draft_policy."""
    what = "threshold sweep"
    for run in nonempty(runs, what, "runs"):
        of_strategy(run.records, strategy, what)
    by_policy: dict[str, list[Run]] = {}
    for run in runs:
        by_policy.setdefault(run.draft_policy, []).append(run)

    fig = new_figure(9.0, 3.1)
    axes = subplots(fig, 1, 3, sharex=True)
    for number, (policy, points) in enumerate(sorted(by_policy.items(), key=lambda kv: kv[0] != "threshold")):
        points.sort(key=lambda run: run.draft_threshold)
        dodge = 0.006 * (number - (len(by_policy) - 1) / 2)  # keep whiskers of the policies apart
        xs = [run.draft_threshold + dodge for run in points]
        for ax, metric in zip(axes, METRIC_PANELS):
            metric_points(ax, xs, [run.records for run in points], strategy, metric, what,
                          COLORS[number % len(COLORS)], POLICY_LABELS.get(policy, policy), marker="os^D"[number % 4])
    metric_axes(axes, METRIC_PANELS)
    for ax in axes:
        ax.set_xlabel("draft-exit threshold (draft probability)")
        ax.set_xlim(-0.04, 1.04)
    figure_legend(fig, axes)
    n_prompts = len({r.question_id for run in runs for r in run.records})
    set_title(fig, "Draft-exit threshold: fixed vs adaptive", model, date, f"{n_prompts} prompts", SPREAD_NOTE)
    return fig


@styled
def plot_skip_ratio(runs: list[Run], *, strategy: str = "self_spec", model: str | None = None, date=None) -> Figure:
    """Acceptance rate, tokens per verification and speedup against each run's skipped_fraction: a marker per
    random skip set, a line through the mean of each size, a star per run of the searched set
    (skip_set="searched")."""
    what = "skip ratio"
    for run in nonempty(runs, what, "runs"):
        if run.skipped_fraction is None:
            raise SelfspecError(f"{what}: run {run.path or ''} has no skip.attn/skip.mlp lists or layer count "
                                f"(skip_num_layers); run it with experiment=skip_ratio")
        of_strategy(run.records, strategy, what)
    runs = sorted(runs, key=lambda run: run.skipped_fraction)
    random = [run for run in runs if run.skip_set != "searched"]
    searched = [run for run in runs if run.skip_set == "searched"]

    fig = new_figure(9.0, 3.1)
    axes = subplots(fig, 1, 3, sharex=True)
    for ax, metric in zip(axes, METRIC_PANELS):
        xs = [100 * run.skipped_fraction for run in random]
        ys = metric_points(ax, xs, [run.records for run in random], strategy, metric, what, COLORS[0],
                           "one skip set", linestyle="none")
        by_size: dict[float, list] = {}
        for x, y in zip(xs, ys):
            if y is not None:
                by_size.setdefault(x, []).append(y)
        ax.plot(list(by_size), [statistics.mean(v) for v in by_size.values()], color=COLORS[1],
                label="mean per size")
        if searched:
            metric_points(ax, [100 * run.skipped_fraction for run in searched], [run.records for run in searched],
                          strategy, metric, what, COLORS[2], "searched skip set", marker="*", linestyle="none")
        ax.xaxis.set_major_formatter(PercentFormatter(decimals=0))
        ax.set_xlabel("sublayers skipped (% of 2 × layers)")
    metric_axes(axes, METRIC_PANELS)
    figure_legend(fig, axes)
    set_title(fig, "Draft depth: share of sublayers skipped", model, date,
              f"{len(random)} random skip sets" + (f" + {len(searched)} searched" if searched else ""), SPREAD_NOTE)
    return fig
