"""The server under load (`make serve-bench`): throughput and latency over concurrent clients, a line per
serve.max_batch."""

from matplotlib.figure import Figure

from selfspec.plots.common import COLORS, figure_legend, new_figure, nonempty, set_title, styled, subplots
from selfspec.records.serve_load import LoadCell


@styled
def plot_serve_load(cells: list[LoadCell], *, model: str | None = None, date=None) -> Figure:
    """Three panels over the number of concurrent streaming clients, a colour per serve.max_batch: aggregate
    tokens/s; time to first token (p50 solid, p95 dashed); each request's tokens/s (p50 solid, p95 dashed)."""
    cells = sorted(nonempty(cells, "serve load", "load-test cells"), key=lambda c: (c.max_batch, c.clients))
    fig = new_figure(9.5, 3.4)
    axes = subplots(fig, 1, 3)
    panels = [("aggregate tokens/s", [("tokens_per_s", "-")]),
              ("time to first token (s)", [("first_token_p50_s", "-"), ("first_token_p95_s", "--")]),
              ("tokens/s per request", [("request_tokens_per_s_p50", "-"), ("request_tokens_per_s_p95", "--")])]
    batches = sorted({c.max_batch for c in cells})
    for ax, (label, lines) in zip(axes, panels):
        for colour, max_batch in zip(COLORS, batches):
            mine = [c for c in cells if c.max_batch == max_batch]
            for field, style in lines:
                ax.plot([c.clients for c in mine], [getattr(c, field) for c in mine], style, marker="o",
                        color=colour, label=f"serve.max_batch={max_batch}" if style == "-" else "_p95")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({c.clients for c in cells}), labels=[str(n) for n in sorted({c.clients for c in cells})])
        ax.set_xlabel("concurrent streaming clients")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
    set_title(fig, "The server under load: continuous batching against one request at a time", model, date,
              "solid: aggregate or p50, dashed: p95")
    figure_legend(fig, axes)
    return fig
