"""The skip-set search: its optimisation history, the Pareto front of skipped share vs acceptance, and a skip
set as a mask over the layers."""

from collections import Counter

from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator, PercentFormatter

from selfspec.errors import SelfspecError
from selfspec.plots.common import COLORS, figure_legend, new_figure, nonempty, set_title, styled, subplots
from selfspec.records.runs import Trial
from selfspec.settings import SkipSet

OBJECTIVE_LABELS = {
    "tokens_per_s": "decode speed (tokens/s)",
    "acceptance": "tokens per verification step",
    "pareto": "expected speedup (× plain, estimate)",
}


def complete_trials(trials: list[Trial], what: str) -> list[Trial]:
    complete = [t for t in nonempty(trials, what, "trials") if t.state == "COMPLETE"]
    if not complete:
        states = Counter(t.state for t in trials)
        raise SelfspecError(f"{what}: no COMPLETE trial ({', '.join(f'{n} {s}' for s, n in states.items())})")
    return complete


def trial_value(trial: Trial, what: str) -> float:
    """The single objective's value; for two objectives, the expected speedup the search ranks the front by."""
    if len(trial.values) == 1:
        return trial.values[0]
    if trial.metrics is None or trial.metrics.expected_speedup is None:
        raise SelfspecError(f"{what}: trial {trial.number} has two values but no metrics.expected_speedup")
    return trial.metrics.expected_speedup


@styled
def plot_search_history(trials: list[Trial], *, objective: str | None = None, model: str | None = None,
                        date=None) -> Figure:
    """Objective value per trial (trials in number order) and the best so far (maximised); pruned trials marked
    along the bottom. objective: tokens_per_s | acceptance | pareto (labels the y axis; default from the number
    of values)."""
    what = "search history"
    complete = complete_trials(trials, what)
    objective = objective or ("pareto" if len(complete[0].values) > 1 else None)
    xs = [t.number for t in complete]
    ys = [trial_value(t, what) for t in complete]
    best, best_so_far = float("-inf"), []
    for y in ys:
        best = max(best, y)
        best_so_far.append(best)
    fig = new_figure(6.0, 3.2)
    (ax,) = subplots(fig, 1, 1)
    ax.plot(xs, ys, linestyle="none", marker="o", color=COLORS[0], alpha=0.7, label="trial")
    ax.plot(xs + [trials[-1].number], best_so_far + [best_so_far[-1]], drawstyle="steps-post", color=COLORS[1],
            label="best so far")
    pruned = [t.number for t in trials if t.state == "PRUNED"]
    if pruned:
        ax.plot(pruned, [0.03] * len(pruned), linestyle="none", marker="x", color="0.5",
                transform=ax.get_xaxis_transform(), label="pruned (no value)")
    ax.set_xlabel("trial")
    ax.set_ylabel(OBJECTIVE_LABELS.get(objective, "objective value"))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    figure_legend(fig, [ax])
    best_trial = complete[ys.index(max(ys))].number
    set_title(fig, "Skip-set search: optimisation history", model, date,
              f"{len(trials)} trials ({len(complete)} complete)", f"best: #{best_trial}")
    return fig


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats in both coordinates (both maximised), by first coordinate."""
    front = [i for i, (x, y) in enumerate(points)
             if not any(x2 >= x and y2 >= y and (x2, y2) != (x, y) for x2, y2 in points)]
    return sorted(front, key=lambda i: points[i])


@styled
def plot_pareto_front(trials: list[Trial], *, chosen: int | None = None, model: str | None = None,
                      date=None) -> Figure:
    """Share of sublayers skipped (draft cost saved) against tokens per verification, over the complete trials;
    the non-dominated ones joined, the chosen trial number starred."""
    what = "pareto front"
    complete = complete_trials(trials, what)
    points = []
    for trial in complete:
        metrics = trial.metrics
        if metrics is None or metrics.skipped_fraction is None or metrics.mean_accepted_tokens is None:
            raise SelfspecError(f"{what}: trial {trial.number} metrics lack skipped_fraction/mean_accepted_tokens")
        points.append((metrics.skipped_fraction, metrics.mean_accepted_tokens))
    front = pareto_front(points)
    fig = new_figure(5.2, 3.6)
    (ax,) = subplots(fig, 1, 1)
    ax.plot([100 * x for x, _ in points], [y for _, y in points], linestyle="none", marker="o", color="0.6",
            alpha=0.7, label="trial")
    ax.plot([100 * points[i][0] for i in front], [points[i][1] for i in front], marker="o", color=COLORS[1],
            label="Pareto front")
    numbers = [t.number for t in complete]
    if chosen is not None and chosen in numbers:
        x, y = points[numbers.index(chosen)]
        ax.plot([100 * x], [y], linestyle="none", marker="*", markersize=13, color=COLORS[0],
                label=f"chosen by the search (#{chosen})")
    ax.xaxis.set_major_formatter(PercentFormatter(decimals=0))
    ax.set_xlabel("sublayers skipped (% of 2 × layers)")
    ax.set_ylabel("tokens per verification step")
    ax.legend(loc="best")
    set_title(fig, "Skip-set search: skipped share vs acceptance", model, date, f"{len(points)} complete trials")
    return fig


@styled
def plot_skip_mask(skip: SkipSet, num_layers: int, *, title: str = "Skip mask", model: str | None = None,
                   date=None) -> Figure:
    """Heat-map of a skip set: attention and MLP rows x layers, skipped sublayers coloured."""
    if num_layers < 1 or any(not 0 <= i < num_layers for i in (*skip.attn, *skip.mlp)):
        raise SelfspecError(f"skip mask: {skip.as_dict()} does not fit in num_layers={num_layers} layers")
    rows = [[1 if i in ids else 0 for i in range(num_layers)] for ids in (skip.attn, skip.mlp)]
    fig = new_figure(min(10.0, max(6.0, 1.8 + 0.24 * num_layers)), 2.1)
    (ax,) = subplots(fig, 1, 1)
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
    skipped = len(skip.attn) + len(skip.mlp)
    set_title(fig, title, model, date, f"{skipped} of {2 * num_layers} sublayers skipped "
                                       f"({skipped / (2 * num_layers):.0%})")
    return fig
