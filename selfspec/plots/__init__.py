"""Paper-style figures from typed run records: each function takes records (`selfspec.records.prompt_records.PromptRecord`),
runs (`selfspec.records.runs.Run`), search trials (`selfspec.records.runs.Trial`), a skip set or the server load test's
cells (`selfspec.records.serve_load.LoadCell`), and returns a matplotlib Figure.

Figures are built without pyplot (no global figure state, any backend); `fig.savefig("x.png")` renders with
Agg. Every figure names the model and the date of its records in its title when given them. Input with nothing
to plot raises SelfspecError with a one-line message; malformed files fail earlier, in the loaders.
"""

from selfspec.plots.common import STYLE
from selfspec.plots.comparisons import plot_sampling, plot_strategy_speedups
from selfspec.plots.field import plot_field_speedups
from selfspec.plots.search import pareto_front, plot_pareto_front, plot_search_history, plot_skip_mask
from selfspec.plots.serving import plot_serve_load
from selfspec.plots.steps import plot_accepted_histogram, plot_adaptive_trace
from selfspec.plots.sweeps import (batch_table, plot_batch_speedup, plot_batch_throughput, plot_skip_ratio,
                                   plot_threshold_sweep)

__all__ = ["STYLE", "batch_table", "pareto_front", "plot_accepted_histogram", "plot_adaptive_trace",
           "plot_batch_speedup", "plot_batch_throughput", "plot_field_speedups", "plot_pareto_front", "plot_sampling", "plot_search_history",
           "plot_serve_load", "plot_skip_mask", "plot_skip_ratio", "plot_strategy_speedups", "plot_threshold_sweep"]
