"""Sweeps of one setting, a point per run: acceptance rate, tokens per verification and speedup against the
draft-exit threshold or the share of sublayers skipped; speedup and aggregate throughput against the batch size."""

import statistics

from matplotlib.figure import Figure
from matplotlib.ticker import NullLocator, PercentFormatter

from selfspec.errors import SelfspecError
from selfspec.plots.common import (COLORS, METRIC_PANELS, SPREAD_NOTE, figure_legend, metric_axes, metric_points,
                                   new_figure, nonempty, of_strategy, set_title, spread_whiskers, styled, subplots)
from selfspec.records.prompt_records import aggregate_tokens_per_s, batch_times, summarize
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


@styled
def plot_batch_speedup(runs: list[Run], *, model: str | None = None, date=None) -> Figure:
    """Speedup over plain decoding at the same batch size against each run's batch_size, a line per drafting
    strategy: the summary speedup (tokens/s over plain's, each row timed on its own), whiskers over the prompts."""
    what = "batch speedup"
    runs, strategies = _by_batch_size(runs, what)
    drafting = [s for s in strategies if s != "plain"]
    if not drafting:
        raise SelfspecError(f"{what}: only plain decoding in these records; nothing to compare")
    fig = new_figure(6.5, 3.4)
    (ax,) = subplots(fig, 1, 1)
    for number, strategy in enumerate(drafting):
        metric_points(ax, _dodged(runs, number, len(drafting)), [run.records for run in runs], strategy, "speedup",
                      what, COLORS[number % len(COLORS)], strategy, marker="os^Dv"[number % 5])
    metric_axes([ax], ["speedup"])
    _batch_axis(ax, runs)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    set_title(fig, "Speedup against batch size", model, date, "over plain decoding at the same batch size",
              f"{_prompts(runs)} prompts", SPREAD_NOTE)
    return fig


@styled
def plot_batch_throughput(runs: list[Run], *, model: str | None = None, date=None) -> Figure:
    """Aggregate tokens/s (all rows' tokens over the batches' wall times, each batch once) against each run's
    batch_size, a line per strategy, plain decoding included; whiskers over the batches' own tokens/s."""
    what = "batch throughput"
    runs, strategies = _by_batch_size(runs, what)
    fig = new_figure(6.5, 3.4)
    (ax,) = subplots(fig, 1, 1)
    drafting = [s for s in strategies if s != "plain"]
    for strategy in strategies:
        number = drafting.index(strategy) if strategy in drafting else None  # the speedup figure's colours
        color = "0.35" if number is None else COLORS[number % len(COLORS)]
        xs = _dodged(runs, strategies.index(strategy), len(strategies))
        mine = [of_strategy(run.records, strategy, what) for run in runs]
        ax.plot(xs, [aggregate_tokens_per_s(records) for records in mine], color=color, label=strategy,
                marker="x" if number is None else "os^Dv"[number % 5], linestyle="--" if number is None else "-")
        spread_whiskers(ax, xs, [[b.tokens_per_s for b in batch_times(records)] for records in mine], color)
    ax.set_ylabel("aggregate throughput (tokens/s, all rows)")
    ax.set_ylim(bottom=0)
    _batch_axis(ax, runs)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    set_title(fig, "Throughput against batch size", model, date, "all tokens over the batches' wall times",
              f"{_prompts(runs)} prompts", "whiskers: 25–75% of batches")
    return fig


def batch_table(runs: list[Run]) -> str:
    """A markdown table, a row per batch size and strategy: aggregate tokens/s (each batch once) and the speedup
    over plain decoding at the same batch size (the figures' values)."""
    runs, strategies = _by_batch_size(runs, "batch table")
    lines = ["| batch size | strategy | aggregate tokens/s | speedup |", "|---|---|---|---|"]
    for run in runs:
        summary = summarize(run.records)
        for strategy in strategies:
            speedup = summary[strategy]["speedup"]
            lines.append(f"| {run.batch_size} | {strategy} | {summary[strategy]['aggregate_tokens_per_s']:.1f} | "
                         f"{'-' if speedup is None else f'{speedup:.2f}'} |")
    return "\n".join(lines)


def _by_batch_size(runs: list[Run], what: str) -> tuple[list[Run], list[str]]:
    """The runs in batch-size order and the strategies of their records (in order of appearance); SelfspecError if
    a run has no batch_size, two runs share one, or a run lacks a strategy."""
    for run in nonempty(runs, what, "runs"):
        if run.batch_size is None:
            raise SelfspecError(f"{what}: {run.path or 'a run'} has no batch_size in its config; run it with "
                                f"python run.py -m experiment=batch")
    sizes = sorted(run.batch_size for run in runs)
    if len(set(sizes)) < len(sizes):
        raise SelfspecError(f"{what}: several runs of one batch size (batch sizes {sizes}); plot one sweep's runs")
    runs = sorted(runs, key=lambda run: run.batch_size)
    strategies = list(dict.fromkeys(r.strategy for run in runs for r in run.records))
    for run in runs:
        for strategy in strategies:
            of_strategy(run.records, strategy, f"{what} at batch_size={run.batch_size}")
    return runs, strategies


def _dodged(runs: list[Run], number: int, count: int) -> list[float]:
    """The runs' batch sizes, line `number` of `count` shifted a little on the log axis: whiskers stay apart."""
    return [run.batch_size * 2 ** (0.05 * (number - (count - 1) / 2)) for run in runs]


def _batch_axis(ax, runs: list[Run]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks([run.batch_size for run in runs], [str(run.batch_size) for run in runs])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("batch size (prompts decoded together)")


def _prompts(runs: list[Run]) -> int:
    return len({r.question_id for run in runs for r in run.records})
