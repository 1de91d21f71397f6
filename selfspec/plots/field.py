"""The field (experiment=field): each method's speedup over plain decoding per Spec-Bench task type, as a grid."""

import textwrap

from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure

from selfspec.data.prompt_sets import SPEC_BENCH_TASKS
from selfspec.errors import SelfspecError
from selfspec.evaluation.field import by_task_type
from selfspec.plots.common import new_figure, nonempty, set_title, styled, subplots
from selfspec.records.prompt_records import PromptRecord, summarize


@styled
def plot_field_speedups(records: list[PromptRecord], *, greedy: bool = True, model: str | None = None,
                        date=None) -> Figure:
    """A row per method (plain left out), a column per task type (Spec-Bench's six in its leaderboard's order,
    then any other category, then all prompts): each cell's colour and label its speedup, red below 1, blue above;
    `*` after a method's name: some of its outputs differ from plain decoding's (greedy runs only: sampled outputs
    differ by chance)."""
    records = by_task_type(nonempty(records, "field speedups", "records"))
    summary = summarize(records)
    names = [name for name in summary if name != "plain"]
    if not names:
        raise SelfspecError("field speedups: only plain decoding in these records; nothing to compare")
    present = {r.category for r in records}
    tasks = [t for t in SPEC_BENCH_TASKS if t in present] + sorted(present - set(SPEC_BENCH_TASKS))
    grid = [[_speedup(summary[name]["by_category"].get(task)) for task in tasks] + [_speedup(summary[name])]
            for name in names]  # (methods, task types + 1)
    fig = new_figure(1.6 + 1.05 * (len(tasks) + 1), 1.0 + 0.32 * len(names))
    (ax,) = subplots(fig, 1, 1)
    values = [v for row in grid for v in row if v is not None]
    spread = max(abs(v - 1.0) for v in values) if values else 0.0
    norm = TwoSlopeNorm(1.0, 1.0 - spread - 0.01, 1.0 + spread + 0.01)
    image = ax.imshow([[1.0 if v is None else v for v in row] for row in grid], cmap="RdBu", norm=norm,
                      aspect="auto")
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            ax.text(j, i, "-" if value is None else f"{value:.2f}", ha="center", va="center", fontsize=7.5)
    ax.set_xticks(range(len(tasks) + 1), [textwrap.fill(SPEC_BENCH_TASKS.get(t, t), 13) for t in tasks] + ["Overall"])
    marked = [name + ("" if _lossless(summary[name]) or not greedy else " *") for name in names]
    ax.set_yticks(range(len(names)), marked)
    ax.grid(visible=False)
    fig.colorbar(image, ax=ax, label="speedup (× plain tokens/s)")
    set_title(fig, "Speedup by method and Spec-Bench task type", model, date, "*: outputs differ from plain's")
    return fig


def _speedup(row: dict | None) -> float | None:
    return None if row is None else row.get("speedup")


def _lossless(row: dict) -> bool:
    return row.get("outputs_match_plain") in (None, 1.0)
