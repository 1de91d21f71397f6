"""Per verification step: the adaptive draft-exit threshold over consecutive prompts, and how many draft tokens
the steps accepted."""

from collections import Counter

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from selfspec.errors import SelfspecError
from selfspec.plots.common import COLORS, figure_legend, new_figure, nonempty, of_strategy, set_title, styled, subplots
from selfspec.records.prompt_records import PromptRecord


@styled
def plot_adaptive_trace(records: list[PromptRecord], *, strategy: str = "self_spec",
                        target_acceptance: float | None = None, window: int = 16, model: str | None = None,
                        date=None) -> Figure:
    """The draft-exit threshold (top) and acceptance (bottom: per step, and over the last `window` steps) over
    the verification steps of consecutive prompts, in record order; thin lines mark prompts, labels categories."""
    what = "adaptive trace"
    records = of_strategy(nonempty(records, what, "records"), strategy, what)
    if window < 1:
        raise SelfspecError(f"{what}: window={window} must be >= 1")
    thresholds, drafted, accepted, starts = [], [], [], []
    for record in records:
        starts.append((len(thresholds), record.category, record.question_id))
        for step in record.steps:
            thresholds.append(step.threshold)
            drafted.append(step.drafted)
            accepted.append(step.accepted)
    if not any(drafted):
        raise SelfspecError(f"{what}: strategy {strategy!r} drafted no tokens in these records; nothing to trace")

    steps = range(1, len(thresholds) + 1)
    rate_steps = [i + 1 for i, d in enumerate(drafted) if d]
    rates = [accepted[i - 1] / drafted[i - 1] for i in rate_steps]
    running = []
    for i in range(len(drafted)):
        d, a = sum(drafted[max(0, i - window + 1):i + 1]), sum(accepted[max(0, i - window + 1):i + 1])
        running.append(a / d if d else float("nan"))

    fig = new_figure(8.0, 4.4)
    top, bottom = subplots(fig, 2, 1, sharex=True)
    top.plot(steps, thresholds, color=COLORS[0], label="draft-exit threshold (on the draft probability)",
             drawstyle="steps-post")
    top.set_ylabel("threshold")
    top.set_ylim(0, 1.02)
    bottom.plot(rate_steps, rates, linestyle="none", marker=".", markersize=3, color="0.55", alpha=0.6,
                label="acceptance (accepted / drafted) of a step")
    bottom.plot(steps, running, color=COLORS[1], label=f"over the last {window} steps")
    if target_acceptance is not None:
        bottom.axhline(target_acceptance, color="0.3", linestyle="--", linewidth=1,
                       label=f"target {target_acceptance:g}")
    bottom.set_ylabel("acceptance rate")
    bottom.set_ylim(-0.02, 1.05)
    bottom.set_xlabel("verification step (prompts in order)")
    bottom.set_xlim(0.5, len(thresholds) + 0.5)
    previous, spans = None, []  # (first step, category) where a category begins
    for start, category, _ in starts:
        new_category = category != previous
        for ax in (top, bottom):
            ax.axvline(start + 0.5, color="0.45" if new_category else "0.85", linewidth=0.8 if new_category else 0.5,
                       zorder=0)
        if new_category:
            spans.append((start, category))
        previous = category
    ends = [start for start, _ in spans[1:]] + [len(thresholds)]
    categories = top.secondary_xaxis("top")  # category names above the plot, centred on their steps
    categories.set_xticks([(start + end) / 2 + 0.5 for (start, _), end in zip(spans, ends)],
                          [category for _, category in spans], fontsize=7, color="0.3")
    categories.tick_params(length=0)
    for ax in (top, bottom):
        ax.grid(axis="x", visible=False)  # vertical lines mark prompts here
    fig.align_ylabels([top, bottom])
    figure_legend(fig, [top, bottom])
    set_title(fig, f"Adaptive draft exit over {len(records)} consecutive prompts", model, date,
           f"strategy {strategy}", f"{len(thresholds)} verification steps")
    return fig


@styled
def plot_accepted_histogram(records: list[PromptRecord], *, strategies: list[str] | None = None,
                            model: str | None = None, date=None) -> Figure:
    """Share of verification steps that accepted 0, 1, 2, ... draft tokens, one bar group per strategy
    (default: every strategy that drafted); steps that drafted nothing are left out."""
    what = "accepted-tokens histogram"
    nonempty(records, what, "records")
    names = strategies or [s for s in dict.fromkeys(r.strategy for r in records)
                           if any(r.drafted for r in records if r.strategy == s)]
    if not names:
        raise SelfspecError(f"{what}: no strategy drafted tokens in these records (plain decoding only?)")
    counts = {}
    for name in names:
        steps = [s for r in of_strategy(records, name, what) for s in r.steps if s.drafted]
        if not steps:
            raise SelfspecError(f"{what}: strategy {name!r} has no verification step with drafted tokens")
        counts[name] = Counter(s.accepted for s in steps)
    top = max(max(c) for c in counts.values())
    fig = new_figure(max(5.0, min(9.0, 2.5 + 0.45 * (top + 1))), 3.0)
    (ax,) = subplots(fig, 1, 1)
    width = 0.8 / len(names)
    for number, (name, count) in enumerate(counts.items()):
        total = sum(count.values())
        mean = sum(k * v for k, v in count.items()) / total
        xs = [k + (number - (len(names) - 1) / 2) * width for k in range(top + 1)]
        ax.bar(xs, [100 * count.get(k, 0) / total for k in range(top + 1)], width=width,
               color=COLORS[number % len(COLORS)], label=f"{name} (mean {mean:.2f}, {total} steps)")
    ax.set_xlabel("accepted draft tokens in a verification step")
    ax.set_ylabel("share of verification steps (%)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(axis="x", visible=False)
    ax.legend(loc="best")
    set_title(fig, "Accepted draft tokens per verification step", model, date)
    return fig
