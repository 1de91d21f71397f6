"""Paper-style figures from run records: each function takes records (dicts as read by
`selfspec.records.read_records`), trials (trials.jsonl rows) or a skip set, and returns a matplotlib Figure.

Figures are built without pyplot (no global figure state, any backend); `fig.savefig("x.png")` renders with
Agg. Every figure names the model and the date of its records in its title when given them. Empty or
malformed input raises SelfspecError with a one-line message.
"""

import functools
import statistics
import textwrap
from collections import Counter

import matplotlib
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator, PercentFormatter

from selfspec.errors import SelfspecError
from selfspec.records import summarize

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
RECORD_FIELDS = ("strategy", "question_id", "category", "new_tokens", "elapsed_s", "drafted", "accepted",
                 "verify_steps", "emitted", "acceptance_rate", "mean_accepted_tokens", "speedup")
STEP_FIELDS = ("drafted", "accepted", "threshold")
SPREAD_NOTE = "whiskers: 25–75% of prompts"


# --- checks --------------------------------------------------------------------------------------------------

def check_records(records, what: str = "records") -> list[dict]:
    """The records, or SelfspecError naming the first problem: not a non-empty list of records.jsonl rows."""
    if not isinstance(records, list) or not records:
        raise SelfspecError(f"{what}: no records to plot (expected a non-empty list of records.jsonl rows)")
    for index, record in enumerate(records):
        if not isinstance(record, dict):
            raise SelfspecError(f"{what}: item {index} is a {type(record).__name__}, not a record dict")
        missing = [key for key in RECORD_FIELDS if key not in record]
        if missing:
            raise SelfspecError(f"{what}: item {index} lacks {', '.join(missing)} (not a records.jsonl row?)")
        if not isinstance(record["elapsed_s"], (int, float)) or record["elapsed_s"] <= 0:
            raise SelfspecError(f"{what}: item {index} has elapsed_s={record['elapsed_s']!r}; it must be > 0")
    return records


def _unit_runs(items, key: str, extra: tuple, strategy: str, what: str, noun: str) -> list[tuple]:
    """Check {key, *extra, records} dicts whose `key` lies in [0, 1]; return (value, records, item) each."""
    fields = (*extra, key, "records")
    checked = []
    for index, item in enumerate(items):
        if not isinstance(item, dict) or any(k not in item for k in fields):
            raise SelfspecError(f"{what}: {noun} {index} is not a {{{', '.join(fields)}}} dict")
        value = _number(item[key], f"{what}: {noun} {index} {key}")
        if not 0 <= value <= 1:
            raise SelfspecError(f"{what}: {noun} {index} has {key} {value} outside [0, 1]")
        records = check_records(item["records"], f"{what}: {noun} {index}")
        _of_strategy(records, strategy, f"{what}: {noun} {index}")
        checked.append((value, records, item))
    return checked


def _of_strategy(records: list[dict], strategy: str, what: str) -> list[dict]:
    mine = [r for r in records if r["strategy"] == strategy]
    if not mine:
        found = ", ".join(dict.fromkeys(r["strategy"] for r in records))
        raise SelfspecError(f"{what}: no records of strategy {strategy!r} (found: {found})")
    return mine


def _steps(record: dict, what: str) -> list[dict]:
    steps = record.get("steps")
    if not isinstance(steps, list):
        raise SelfspecError(f"{what}: record {record['question_id']!r} has no 'steps' list")
    for step in steps:
        if not isinstance(step, dict) or any(key not in step for key in STEP_FIELDS):
            raise SelfspecError(f"{what}: a step of {record['question_id']!r} lacks {', '.join(STEP_FIELDS)}")
    return steps


def _nonempty_list(items, what: str, expected: str) -> list:
    if not isinstance(items, list) or not items:
        raise SelfspecError(f"{what}: nothing to plot (expected a non-empty list of {expected})")
    return items


def _number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SelfspecError(f"{what}: {value!r} is not a number")
    return float(value)


# --- shared pieces ---------------------------------------------------------------------------------------------

def _styled(plot):
    """Run a plot function under STYLE: matplotlib reads rcParams when each artist is made."""
    @functools.wraps(plot)
    def wrapper(*args, **kwargs):
        with matplotlib.rc_context(STYLE):
            return plot(*args, **kwargs)
    return wrapper


def _figure(width: float, height: float) -> Figure:
    return Figure(figsize=(width, height), layout="constrained")


def _subplots(fig: Figure, nrows: int, ncols: int, **kwargs):
    return [ax for row in fig.subplots(nrows, ncols, squeeze=False, **kwargs) for ax in row]


def _title(fig: Figure, title: str, model: str | None, date, *notes: str) -> None:
    """Title, then one line: model, date of the records, notes."""
    meta = " · ".join(str(part) for part in (model and f"model: {model}", date and f"records: {date}", *notes)
                      if part)
    width = int(fig.get_figwidth() * 72 / (0.5 * STYLE["figure.titlesize"]))  # characters that fit the width
    lines = textwrap.wrap(meta, width, break_long_words=False) if meta else []
    fig.suptitle("\n".join([title, *lines]))


def _figure_legend(fig: Figure, axes) -> None:
    """One legend for all panels, under them: every labelled artist once."""
    handles = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    wide = sum(len(label) for label in handles) > 80
    fig.legend(handles.values(), handles.keys(), loc="outside lower center",
               ncols=min(2 if wide else 4, len(handles)))


def _summary(records: list[dict], strategy: str, what: str) -> dict:
    row = summarize(records)[strategy]
    if row["speedup"] is None:
        raise SelfspecError(f"{what}: no 'plain' records, so no speedup; run strategies=[plain, {strategy}]")
    return row


def _quartiles(values) -> tuple[float, float] | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    if len(values) == 1:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def _metric_points(ax, xs, records_list, strategy: str, metric: str, what: str, color, label, marker="o",
                   linestyle="-"):
    """Summary value of each run as a line with markers, and the prompts' 25-75% range as whiskers."""
    ys = [_summary(records, strategy, what)[metric] for records in records_list]
    ax.plot(xs, [float("nan") if y is None else y for y in ys], marker=marker, color=color, label=label,
            linestyle=linestyle)
    for x, records in zip(xs, records_list):
        spread = _quartiles(r[metric] for r in records if r["strategy"] == strategy)
        if spread is not None:
            ax.vlines(x, *spread, color=color, linewidth=1, alpha=0.6)
    return ys


def _metric_axes(axes, metrics) -> None:
    for ax, metric in zip(axes, metrics):
        label, limits = METRICS[metric]
        ax.set_ylabel(label)
        if limits:
            ax.set_ylim(*limits)
        if metric == "speedup":
            ax.axhline(1.0, color="0.4", linestyle="--", linewidth=1, label="plain decoding")


# --- draft-exit threshold --------------------------------------------------------------------------------------

@_styled
def plot_threshold_sweep(settings: list[dict], *, strategy: str = "self_spec", model: str | None = None,
                         date=None) -> Figure:
    """Acceptance rate, tokens per verification and speedup against the draft-exit threshold.

    settings: one dict per run, {"policy": "threshold" | "adaptive" | ..., "threshold": float in [0, 1] (the
    fixed threshold, or the adaptive policy's initial one), "records": [...]}; a line per policy.
    """
    what = "threshold sweep"
    _nonempty_list(settings, what, "{policy, threshold, records} dicts, one per run")
    by_policy: dict[str, list] = {}
    for threshold, records, setting in _unit_runs(settings, "threshold", ("policy",), strategy, what, "setting"):
        by_policy.setdefault(str(setting["policy"]), []).append((threshold, records))

    metrics = ("acceptance_rate", "mean_accepted_tokens", "speedup")
    fig = _figure(9.0, 3.1)
    axes = _subplots(fig, 1, 3, sharex=True)
    for number, (policy, points) in enumerate(sorted(by_policy.items(), key=lambda kv: kv[0] != "threshold")):
        points.sort(key=lambda p: p[0])
        dodge = 0.006 * (number - (len(by_policy) - 1) / 2)  # keep whiskers of the policies apart
        xs = [t + dodge for t, _ in points]
        label = {"threshold": "fixed threshold", "adaptive": "adaptive (x: initial threshold)"}.get(policy, policy)
        for ax, metric in zip(axes, metrics):
            _metric_points(ax, xs, [r for _, r in points], strategy, metric, what, COLORS[number % len(COLORS)], label,
                           marker="os^D"[number % 4])
    _metric_axes(axes, metrics)
    for ax in axes:
        ax.set_xlabel("draft-exit threshold (draft probability)")
        ax.set_xlim(-0.04, 1.04)
    _figure_legend(fig, axes)
    n_prompts = len({r["question_id"] for _, pts in by_policy.items() for _, rs in pts for r in rs})
    _title(fig, "Draft-exit threshold: fixed vs adaptive", model, date, f"{n_prompts} prompts", SPREAD_NOTE)
    return fig


@_styled
def plot_adaptive_trace(records: list[dict], *, strategy: str = "self_spec", target_acceptance: float | None = None,
                        window: int = 16, model: str | None = None, date=None) -> Figure:
    """The draft-exit threshold (top) and acceptance (bottom: per step, and over the last `window` steps) over
    the verification steps of consecutive prompts, in record order; thin lines mark prompts, labels categories."""
    what = "adaptive trace"
    records = _of_strategy(check_records(records, what), strategy, what)
    if window < 1:
        raise SelfspecError(f"{what}: window={window} must be >= 1")
    thresholds, drafted, accepted, starts = [], [], [], []
    for record in records:
        starts.append((len(thresholds), record["category"], record["question_id"]))
        for step in _steps(record, what):
            thresholds.append(_number(step["threshold"], f"{what}: threshold"))
            drafted.append(step["drafted"])
            accepted.append(step["accepted"])
    if not any(drafted):
        raise SelfspecError(f"{what}: strategy {strategy!r} drafted no tokens in these records; nothing to trace")

    steps = range(1, len(thresholds) + 1)
    rate_steps = [i + 1 for i, d in enumerate(drafted) if d]
    rates = [accepted[i - 1] / drafted[i - 1] for i in rate_steps]
    running = []
    for i in range(len(drafted)):
        d, a = sum(drafted[max(0, i - window + 1):i + 1]), sum(accepted[max(0, i - window + 1):i + 1])
        running.append(a / d if d else float("nan"))

    fig = _figure(8.0, 4.4)
    top, bottom = _subplots(fig, 2, 1, sharex=True)
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
    _figure_legend(fig, [top, bottom])
    _title(fig, f"Adaptive draft exit over {len(records)} consecutive prompts", model, date,
           f"strategy {strategy}", f"{len(thresholds)} verification steps")
    return fig


@_styled
def plot_accepted_histogram(records: list[dict], *, strategies: list[str] | None = None, model: str | None = None,
                            date=None) -> Figure:
    """Share of verification steps that accepted 0, 1, 2, ... draft tokens, one bar group per strategy
    (default: every strategy that drafted); steps that drafted nothing are left out."""
    what = "accepted-tokens histogram"
    records = check_records(records, what)
    names = strategies or [s for s in dict.fromkeys(r["strategy"] for r in records)
                           if any(r["drafted"] for r in records if r["strategy"] == s)]
    if not names:
        raise SelfspecError(f"{what}: no strategy drafted tokens in these records (plain decoding only?)")
    counts = {}
    for name in names:
        steps = [s for r in _of_strategy(records, name, what) for s in _steps(r, what) if s["drafted"]]
        if not steps:
            raise SelfspecError(f"{what}: strategy {name!r} has no verification step with drafted tokens")
        counts[name] = Counter(s["accepted"] for s in steps)
    top = max(max(c) for c in counts.values())
    fig = _figure(max(5.0, min(9.0, 2.5 + 0.45 * (top + 1))), 3.0)
    (ax,) = _subplots(fig, 1, 1)
    width = 0.8 / len(names)
    for number, (name, count) in enumerate(counts.items()):
        total = sum(count.values())
        mean = sum(k * v for k, v in count.items()) / total
        xs = [k + (number - (len(names) - 1) / 2) * width for k in range(top + 1)]
        ax.bar(xs, [100 * count.get(k, 0) / total for k in range(top + 1)], width=width, color=COLORS[number % len(COLORS)],
               label=f"{name} (mean {mean:.2f}, {total} steps)")
    ax.set_xlabel("accepted draft tokens in a verification step")
    ax.set_ylabel("share of verification steps (%)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(axis="x", visible=False)
    ax.legend(loc="best")
    _title(fig, "Accepted draft tokens per verification step", model, date)
    return fig


# --- skip sets ------------------------------------------------------------------------------------------------

@_styled
def plot_skip_ratio(runs: list[dict], *, strategy: str = "self_spec", model: str | None = None, date=None) -> Figure:
    """Acceptance rate, tokens per verification and speedup against the share of sublayers skipped.

    runs: one dict per run, {"skipped_fraction": float in [0, 1], "records": [...]}, with "searched": True for
    a run of a searched skip set; a marker per random set, a line through the mean of each size, a star per
    searched set.
    """
    what = "skip ratio"
    _nonempty_list(runs, what, "{skipped_fraction, records} dicts, one per run")
    checked = sorted(_unit_runs(runs, "skipped_fraction", (), strategy, what, "run"), key=lambda p: p[0])
    points = [(fraction, records) for fraction, records, item in checked if not item.get("searched")]
    searched = [(fraction, records) for fraction, records, item in checked if item.get("searched")]

    metrics = ("acceptance_rate", "mean_accepted_tokens", "speedup")
    fig = _figure(9.0, 3.1)
    axes = _subplots(fig, 1, 3, sharex=True)
    for ax, metric in zip(axes, metrics):
        xs = [100 * f for f, _ in points]
        ys = _metric_points(ax, xs, [r for _, r in points], strategy, metric, what, COLORS[0], "one skip set",
                            linestyle="none")
        by_size: dict[float, list] = {}
        for x, y in zip(xs, ys):
            if y is not None:
                by_size.setdefault(x, []).append(y)
        ax.plot(list(by_size), [statistics.mean(v) for v in by_size.values()], color=COLORS[1],
                label="mean per size")
        if searched:
            _metric_points(ax, [100 * f for f, _ in searched], [r for _, r in searched], strategy, metric, what,
                           COLORS[2], "searched skip set", marker="*", linestyle="none")
        ax.xaxis.set_major_formatter(PercentFormatter(decimals=0))
        ax.set_xlabel("sublayers skipped (% of 2 × layers)")
    _metric_axes(axes, metrics)
    _figure_legend(fig, axes)
    _title(fig, "Draft depth: share of sublayers skipped", model, date,
           f"{len(points)} random skip sets" + (f" + {len(searched)} searched" if searched else ""), SPREAD_NOTE)
    return fig


@_styled
def plot_skip_mask(attn: list[int], mlp: list[int], num_layers: int, *, title: str = "Skip mask",
                   model: str | None = None, date=None) -> Figure:
    """Heat-map of a skip set: attention and MLP rows x layers, skipped sublayers coloured."""
    what = "skip mask"
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise SelfspecError(f"{what}: num_layers={num_layers!r} must be a positive integer")
    rows = []
    for kind, ids in (("attn", attn), ("mlp", mlp)):
        if not isinstance(ids, (list, tuple)):
            raise SelfspecError(f"{what}: {kind} must be a list of layer ids, got {ids!r}")
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers:
                raise SelfspecError(f"{what}: {kind} layer id {i!r} is outside 0..{num_layers - 1}")
        rows.append([1 if i in ids else 0 for i in range(num_layers)])
    fig = _figure(min(10.0, max(6.0, 1.8 + 0.24 * num_layers)), 2.1)
    (ax,) = _subplots(fig, 1, 1)
    ax.imshow(rows, cmap=ListedColormap(["#eeeeee", "#c0392b"]), vmin=0, vmax=1, aspect="auto",
              interpolation="nearest")
    ax.set_yticks([0, 1], ["attention", "MLP"])
    step = 1 if num_layers <= 24 else 2 if num_layers <= 48 else 4
    ax.set_xticks(range(0, num_layers, step))
    ax.set_xticks([i - 0.5 for i in range(1, num_layers)], minor=True)
    ax.set_yticks([0.5], minor=True)
    ax.grid(False)
    ax.grid(which="minor", color="white", linewidth=1.5)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel("layer")
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.legend(handles=[Patch(color="#c0392b", label="skipped"), Patch(color="#eeeeee", label="kept")],
              loc="upper left", bbox_to_anchor=(1.01, 1.0))
    skipped = len(attn) + len(mlp)
    _title(fig, title, model, date, f"{skipped} of {2 * num_layers} sublayers skipped "
                                    f"({skipped / (2 * num_layers):.0%})")
    return fig


# --- search ---------------------------------------------------------------------------------------------------

OBJECTIVE_LABELS = {
    "tokens_per_s": "decode speed (tokens/s)",
    "acceptance": "tokens per verification step",
    "pareto": "expected speedup (× plain, estimate)",
}


def check_trials(trials, what: str = "trials") -> list[dict]:
    """The trials (trials.jsonl rows), last row per trial number, in number order; SelfspecError if malformed."""
    _nonempty_list(trials, what, "trials.jsonl rows")
    by_number = {}
    for index, trial in enumerate(trials):
        if not isinstance(trial, dict) or "number" not in trial or "state" not in trial:
            raise SelfspecError(f"{what}: item {index} lacks 'number'/'state' (not a trials.jsonl row?)")
        if trial["state"] == "COMPLETE" and not (isinstance(trial.get("values"), list) and trial["values"]):
            raise SelfspecError(f"{what}: COMPLETE trial {trial['number']} has no 'values' list")
        by_number[trial["number"]] = trial
    return [by_number[n] for n in sorted(by_number)]


def _complete(trials: list[dict], what: str) -> list[dict]:
    complete = [t for t in trials if t["state"] == "COMPLETE"]
    if not complete:
        states = Counter(t["state"] for t in trials)
        raise SelfspecError(f"{what}: no COMPLETE trial ({', '.join(f'{n} {s}' for s, n in states.items())})")
    return complete


def _trial_value(trial: dict, what: str) -> float:
    """The single objective's value; for two objectives, the expected speedup the search ranks the front by."""
    if len(trial["values"]) == 1:
        return _number(trial["values"][0], f"{what}: trial {trial['number']} value")
    value = (trial.get("metrics") or {}).get("expected_speedup")
    return _number(value, f"{what}: trial {trial['number']} metrics.expected_speedup")


@_styled
def plot_search_history(trials: list[dict], *, objective: str | None = None, model: str | None = None,
                        date=None) -> Figure:
    """Objective value per trial and the best so far (maximised); pruned trials marked along the bottom.
    objective: tokens_per_s | acceptance | pareto (labels the y axis; default from the number of values)."""
    what = "search history"
    trials = check_trials(trials, what)
    complete = _complete(trials, what)
    objective = objective or ("pareto" if len(complete[0]["values"]) > 1 else None)
    xs = [t["number"] for t in complete]
    ys = [_trial_value(t, what) for t in complete]
    best, best_so_far = float("-inf"), []
    for y in ys:
        best = max(best, y)
        best_so_far.append(best)
    fig = _figure(6.0, 3.2)
    (ax,) = _subplots(fig, 1, 1)
    ax.plot(xs, ys, linestyle="none", marker="o", color=COLORS[0], alpha=0.7, label="trial")
    ax.plot(xs + [trials[-1]["number"]], best_so_far + [best_so_far[-1]], drawstyle="steps-post", color=COLORS[1],
            label="best so far")
    pruned = [t["number"] for t in trials if t["state"] == "PRUNED"]
    if pruned:
        ax.plot(pruned, [0.03] * len(pruned), linestyle="none", marker="x", color="0.5",
                transform=ax.get_xaxis_transform(), label="pruned (no value)")
    ax.set_xlabel("trial")
    ax.set_ylabel(OBJECTIVE_LABELS.get(objective, "objective value"))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    _figure_legend(fig, [ax])
    best_trial = complete[ys.index(max(ys))]["number"]
    _title(fig, "Skip-set search: optimisation history", model, date,
           f"{len(trials)} trials ({len(complete)} complete)", f"best: #{best_trial}")
    return fig


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats in both coordinates (both maximised), by first coordinate."""
    front = [i for i, (x, y) in enumerate(points)
             if not any(x2 >= x and y2 >= y and (x2, y2) != (x, y) for x2, y2 in points)]
    return sorted(front, key=lambda i: points[i])


@_styled
def plot_pareto_front(trials: list[dict], *, chosen: int | None = None, model: str | None = None,
                      date=None) -> Figure:
    """Share of sublayers skipped (draft cost saved) against tokens per verification, over the complete trials;
    the non-dominated ones joined, the chosen trial number starred."""
    what = "pareto front"
    complete = _complete(check_trials(trials, what), what)
    points = []
    for trial in complete:
        metrics = trial.get("metrics") or {}
        if "skipped_fraction" not in metrics or "mean_accepted_tokens" not in metrics:
            raise SelfspecError(f"{what}: trial {trial['number']} metrics lack skipped_fraction/mean_accepted_tokens")
        points.append((_number(metrics["skipped_fraction"], what), _number(metrics["mean_accepted_tokens"], what)))
    front = pareto_front(points)
    fig = _figure(5.2, 3.6)
    (ax,) = _subplots(fig, 1, 1)
    ax.plot([100 * x for x, _ in points], [y for _, y in points], linestyle="none", marker="o", color="0.6",
            alpha=0.7, label="trial")
    ax.plot([100 * points[i][0] for i in front], [points[i][1] for i in front], marker="o", color=COLORS[1],
            label="Pareto front")
    numbers = [t["number"] for t in complete]
    if chosen is not None and chosen in numbers:
        x, y = points[numbers.index(chosen)]
        ax.plot([100 * x], [y], linestyle="none", marker="*", markersize=13, color=COLORS[0],
                label=f"chosen by the search (#{chosen})")
    ax.xaxis.set_major_formatter(PercentFormatter(decimals=0))
    ax.set_xlabel("sublayers skipped (% of 2 × layers)")
    ax.set_ylabel("tokens per verification step")
    ax.legend(loc="best")
    _title(fig, "Skip-set search: skipped share vs acceptance", model, date, f"{len(points)} complete trials")
    return fig


# --- strategies and sampling ----------------------------------------------------------------------------------

def _bars_with_prompts(ax, xs, heights, per_prompt, color, label, width):
    """Bars at the summary values, one dot per prompt (deterministic jitter)."""
    ax.bar(xs, [float("nan") if h is None else h for h in heights], width=width, color=color, alpha=0.85,
           label=label)
    for x, values in zip(xs, per_prompt):
        values = [v for v in values if v is not None]
        offsets = [(((i * 0.618) % 1) - 0.5) * width * 0.6 for i in range(len(values))]
        ax.plot([x + o for o in offsets], values, linestyle="none", marker="o", markersize=2.5, color="0.15",
                alpha=0.55, label="_prompt")


@_styled
def plot_strategy_speedups(records: list[dict], *, model: str | None = None, date=None) -> Figure:
    """Speedup over plain decoding per prompt category (and all prompts) for each non-plain strategy: bars at the
    category's total tokens/s ratio, a dot per prompt."""
    what = "strategy speedups"
    records = check_records(records, what)
    names = [s for s in dict.fromkeys(r["strategy"] for r in records) if s != "plain"]
    if not names:
        raise SelfspecError(f"{what}: only plain decoding in these records; nothing to compare")
    summary = summarize(records)
    categories = list(dict.fromkeys(r["category"] for r in records))
    groups = categories + (["all"] if len(categories) > 1 else [])
    fig = _figure(min(11.0, max(5.5, 1.5 + 0.75 * len(groups) * max(1, len(names) / 3))), 3.4)
    (ax,) = _subplots(fig, 1, 1)
    width = 0.8 / len(names)
    for number, name in enumerate(names):
        if summary[name]["speedup"] is None:
            raise SelfspecError(f"{what}: no 'plain' records, so no speedup; run strategies=[plain, {name}]")
        xs = [g + (number - (len(names) - 1) / 2) * width for g in range(len(groups))]
        heights = [(summary[name] if group == "all" else summary[name]["by_category"].get(group, {})).get("speedup")
                   for group in groups]
        per_prompt = [[r["speedup"] for r in records if r["strategy"] == name and group in ("all", r["category"])]
                      for group in groups]
        _bars_with_prompts(ax, xs, heights, per_prompt, COLORS[number % len(COLORS)], name, width)
    n = Counter(r["category"] for r in records if r["strategy"] == names[0])
    labels = [f"{g}\n(n={n[g] if g != 'all' else sum(n.values())})" for g in groups]
    ax.set_xticks(range(len(groups)), labels, rotation=30 if len(groups) > 8 else 0)
    ax.grid(axis="x", visible=False)
    ax.axhline(1.0, color="0.4", linestyle="--", linewidth=1, label="plain decoding")
    ax.set_ylabel(METRICS["speedup"][0])
    ax.set_xlabel("prompt category (n = prompts)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    _title(fig, "Speedup by strategy and prompt category", model, date, "dots: single prompts")
    return fig


@_styled
def plot_sampling(runs: list[dict], *, strategy: str = "self_spec", model: str | None = None, date=None) -> Figure:
    """Acceptance rate, tokens per verification and speedup per sampling setting (greedy, temperature/top-p):
    bars at each run's summary value, a dot per prompt.

    runs: one dict per run, {"label": "greedy" | "T=0.7, top-p 0.9" | ..., "records": [...]}.
    """
    what = "sampling"
    _nonempty_list(runs, what, "{label, records} dicts, one per run")
    for index, run in enumerate(runs):
        if not isinstance(run, dict) or "label" not in run or "records" not in run:
            raise SelfspecError(f"{what}: run {index} is not a {{label, records}} dict")
        _of_strategy(check_records(run["records"], f"{what}: run {index}"), strategy, f"{what}: run {index}")
    metrics = ("acceptance_rate", "mean_accepted_tokens", "speedup")
    fig = _figure(max(7.5, 2.5 * len(runs) + 3), 3.2)
    axes = _subplots(fig, 1, 3)
    for ax, metric in zip(axes, metrics):
        for number, run in enumerate(runs):
            value = _summary(run["records"], strategy, what)[metric]
            values = [r[metric] for r in run["records"] if r["strategy"] == strategy]
            _bars_with_prompts(ax, [number], [value], [values], COLORS[number % len(COLORS)], f"_{run['label']}", 0.6)
        ax.set_xticks(range(len(runs)), [textwrap.fill(str(run["label"]), 14) for run in runs])
        ax.grid(axis="x", visible=False)
    _metric_axes(axes, metrics)
    _figure_legend(fig, axes)
    n_prompts = len({r["question_id"] for run in runs for r in run["records"]})
    _title(fig, "Greedy decoding vs sampling", model, date, f"strategy {strategy}", f"{n_prompts} prompts",
           "dots: single prompts")
    return fig
