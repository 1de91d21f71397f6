"""Which layers each skip strategy skips over a generation (skip_strategy: records' `skip_sets`)."""

from matplotlib.figure import Figure

from selfspec.errors import SelfspecError
from selfspec.plots.common import new_figure, nonempty, set_title, styled, subplots
from selfspec.records.prompt_records import PromptRecord, skip_set_at


def skipped_matrix(record: PromptRecord, num_layers: int) -> list[list[float]]:
    """(2 num_layers, steps) 1.0 where a sublayer was skipped at a verification step: rows attention 0..L-1, then
    MLP 0..L-1."""
    columns = []
    for step in range(len(record.steps)):
        skip = skip_set_at(record.skip_sets, step)
        skipped = ({i for i in skip.attn}, {num_layers + i for i in skip.mlp}) if skip else (set(), set())
        columns.append([1.0 if row in skipped[0] | skipped[1] else 0.0 for row in range(2 * num_layers)])
    return [list(row) for row in zip(*columns)]


@styled
def plot_skip_choice(records: list[PromptRecord], *, question_id: str | None = None, num_layers: int | None = None,
                     model: str | None = None, date=None) -> Figure:
    """One panel per strategy that recorded skip sets: its skipped attention and MLP sublayers (dark) at every
    verification step of one prompt (`question_id`, default: the first such record's)."""
    what = "skip choice"
    chosen = [r for r in nonempty(records, what, "records") if r.skip_sets]
    if not chosen:
        raise SelfspecError(f"{what}: no record holds skip sets; run a strategy of skip_strategy (self_spec_clasp, "
                            f"self_spec_knapsack, self_spec_swift) with batch_size=1")
    question_id = question_id or chosen[0].question_id
    chosen = [r for r in chosen if r.question_id == question_id]
    if not chosen:
        raise SelfspecError(f"{what}: no record of question_id={question_id!r} holds skip sets; pick another")
    layers = num_layers or 1 + max(i for r in chosen for s in r.skip_sets for i in (*s.attn, *s.mlp, 0))
    fig = new_figure(8.0, 1.2 + 1.6 * len(chosen))
    axes = subplots(fig, len(chosen), 1, sharex=True)
    for ax, record in zip(axes, chosen):
        ax.imshow(skipped_matrix(record, layers), aspect="auto", cmap="Greys", vmin=0, vmax=1, interpolation="nearest",
                  origin="lower")
        ax.set_yticks([0, layers - 1, layers, 2 * layers - 1], ["attn 0", f"attn {layers - 1}", "mlp 0",
                                                                f"mlp {layers - 1}"])
        ax.axhline(layers - 0.5, color="0.5", linewidth=0.6)
        ax.set_title(record.strategy, loc="left")
        ax.grid(visible=False)
    axes[-1].set_xlabel("verification step")
    set_title(fig, "Sublayers each skip strategy skips (dark) over one generation", model, date,
              f"prompt {question_id}")
    return fig
