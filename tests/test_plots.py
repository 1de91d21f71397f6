"""Plot functions on synthetic typed records (axes, series, labels, values) and their one-line errors."""

import dataclasses

import pytest
from matplotlib.figure import Figure

from selfspec import plots
from selfspec.errors import SelfspecError
from selfspec.records.prompt_records import aggregate_tokens_per_s, batch_times, summarize
from selfspec.records.runs import Run, Trial, TrialMetrics, run_from_config
from selfspec.settings import SkipSet

from helpers import record, run_records


def labelled_lines(ax):
    return [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")]


def title(fig: Figure) -> str:
    return fig._suptitle.get_text()


def test_threshold_sweep_has_three_panels_a_line_per_policy_and_the_summary_values():
    runs = [Run(records=run_records(threshold=t), draft_policy="threshold", draft_threshold=t) for t in (0.2, 0.8, 0.5)]
    runs.append(Run(records=run_records(speed=3.0), draft_policy="adaptive", draft_threshold=0.8))
    fig = plots.plot_threshold_sweep(runs, model="tiny_llama", date="2025-01-02")
    acceptance, tokens, speedup = fig.axes
    assert labelled_lines(acceptance) == ["fixed threshold", "adaptive (x: initial threshold)"]
    assert labelled_lines(speedup) == ["fixed threshold", "adaptive (x: initial threshold)", "plain decoding"]
    fixed = acceptance.get_lines()[0]
    assert list(fixed.get_xdata()) == pytest.approx([0.2 - 0.003, 0.5 - 0.003, 0.8 - 0.003])  # sorted, dodged
    expected = summarize(runs[0].records)["self_spec"]["acceptance_rate"]
    assert fixed.get_ydata()[0] == pytest.approx(expected)
    adaptive = summarize(runs[3].records)["self_spec"]
    assert speedup.get_lines()[1].get_ydata()[0] == pytest.approx(adaptive["speedup"])
    assert "acceptance rate" in acceptance.get_ylabel() and "×" in speedup.get_ylabel()
    assert all("threshold" in ax.get_xlabel() for ax in fig.axes)
    assert "tiny_llama" in title(fig) and "2025-01-02" in title(fig)
    assert len(fig.legends) == 1


@pytest.mark.parametrize("records,message", [
    (None, "nothing to plot"),
    ([], "no records of strategy 'self_spec' (found: no records)"),
    (run_records(strategies=("self_spec",)), "no 'plain' records"),
    (run_records(strategies=("plain", "two_model")), "no records of strategy 'self_spec' (found: plain, two_model)"),
])
def test_threshold_sweep_rejects_no_runs_and_runs_without_the_strategy_or_plain_decoding(records, message):
    with pytest.raises(SelfspecError) as error:
        plots.plot_threshold_sweep([] if records is None else [Run(records=records, draft_threshold=0.5)])
    assert message in str(error.value) and "\n" not in str(error.value)


def test_adaptive_trace_plots_every_step_threshold_in_order_and_marks_prompts():
    records = run_records(per_category=3)
    fig = plots.plot_adaptive_trace(records, target_acceptance=0.9, window=2, model="m", date="d")
    top, bottom = fig.axes
    spec = [r for r in records if r.strategy == "self_spec"]
    thresholds = [s.threshold for r in spec for s in r.steps]
    assert list(top.get_lines()[0].get_ydata()) == thresholds
    assert labelled_lines(bottom) == ["acceptance (accepted / drafted) of a step", "over the last 2 steps",
                                      "target 0.9"]
    running = bottom.get_lines()[1].get_ydata()
    assert running[1] == pytest.approx((2 + 0) / (3 + 3))  # accepted / drafted over the window
    boundaries = [line for line in top.get_lines() if line.get_label().startswith("_") and
                  len(set(line.get_xdata())) == 1]
    assert len(boundaries) == len(spec)  # one vertical line per prompt
    (categories,) = top.child_axes
    assert [t.get_text() for t in categories.get_xticklabels()] == ["code", "writing"]  # above their steps
    assert top.get_ylabel() == "threshold" and "verification step" in bottom.get_xlabel()


@pytest.mark.parametrize("records,window,message", [
    ([], 16, "nothing to plot"),
    (run_records(strategies=("plain",)), 16, "no records of strategy 'self_spec'"),
    ([record("self_spec", "a", steps=((0, 0),))], 16, "drafted no tokens"),
    (run_records(), 0, "window=0 must be >= 1"),
])
def test_adaptive_trace_rejects_records_with_nothing_to_trace(records, window, message):
    with pytest.raises(SelfspecError) as error:
        plots.plot_adaptive_trace(records, window=window)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_accepted_histogram_has_a_bar_group_per_drafting_strategy_summing_to_100_percent():
    records = run_records(strategies=("plain", "self_spec_fixed", "self_spec_adaptive"))
    fig = plots.plot_accepted_histogram(records, model="m", date="d")
    (ax,) = fig.axes
    assert len(ax.containers) == 2  # plain drafts nothing
    for bars in ax.containers:
        assert sum(bar.get_height() for bar in bars) == pytest.approx(100)
        assert len(bars) == 5  # 0..4 accepted tokens
    assert ax.containers[0][4].get_height() == pytest.approx(100 / 3)  # one step in three accepted 4
    assert "%" in ax.get_ylabel() and "accepted" in ax.get_xlabel()
    assert "mean 2.00" in ax.get_legend().get_texts()[0].get_text()


def test_accepted_histogram_rejects_plain_only_records():
    with pytest.raises(SelfspecError, match="no strategy drafted tokens"):
        plots.plot_accepted_histogram(run_records(strategies=("plain",)))


def test_skip_ratio_has_a_marker_per_run_a_mean_line_per_size_and_a_star_for_the_searched_set():
    runs = [Run(records=run_records(speed=s), skipped_fraction=f) for f, s in ((0.1, 2), (0.1, 3), (0.5, 1.5))]
    fig = plots.plot_skip_ratio(runs, model="m", date="d")
    assert len(fig.axes) == 3
    for ax in fig.axes:
        assert labelled_lines(ax)[:2] == ["one skip set", "mean per size"]
        assert "%" in ax.get_xlabel()
    mean_line = fig.axes[2].get_lines()[1]
    assert list(mean_line.get_xdata()) == [10.0, 50.0]
    speedups = [summarize(run.records)["self_spec"]["speedup"] for run in runs]
    assert mean_line.get_ydata()[0] == pytest.approx((speedups[0] + speedups[1]) / 2)
    searched_run = Run(records=run_records(speed=4), skipped_fraction=0.2, skip_set="searched")
    searched = plots.plot_skip_ratio(runs + [searched_run], model="m", date="d")
    for ax in searched.axes:
        assert labelled_lines(ax)[:3] == ["one skip set", "mean per size", "searched skip set"]
        assert list(ax.get_lines()[1].get_xdata()) == [10.0, 50.0]  # the searched set is not in the means
        assert list(ax.get_lines()[2].get_xdata()) == [20.0]
    assert searched.axes[2].get_lines()[2].get_ydata()[0] == pytest.approx(
        summarize(searched_run.records)["self_spec"]["speedup"])
    assert "3 random skip sets + 1 searched" in title(searched)


def test_skip_ratio_rejects_no_runs_and_a_run_without_a_skip_set():
    with pytest.raises(SelfspecError, match="has no skip.attn/skip.mlp lists or layer count"):
        plots.plot_skip_ratio([Run(records=run_records())])
    with pytest.raises(SelfspecError, match="nothing to plot"):
        plots.plot_skip_ratio([])


def test_skip_mask_is_attention_and_mlp_rows_by_layers():
    fig = plots.plot_skip_mask(SkipSet(attn=(1, 3), mlp=(3,)), 4, model="m", date="d")
    (ax,) = fig.axes
    assert ax.images[0].get_array().tolist() == [[0, 1, 0, 1], [0, 0, 0, 1]]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["attention", "MLP"]
    assert ax.get_xlabel() == "layer" and "3 of 8 sublayers skipped" in title(fig)
    with pytest.raises(SelfspecError, match="does not fit in num_layers=4"):
        plots.plot_skip_mask(SkipSet(attn=(4,)), 4)
    with pytest.raises(SelfspecError, match="num_layers=0"):
        plots.plot_skip_mask(SkipSet(), 0)


def trials():
    values = [5.0, None, 7.0, 6.0, None, 9.0]
    return [Trial(number, "COMPLETE" if value else "PRUNED", [value] if value else None,
                  TrialMetrics(skipped_fraction=0.1 * number, mean_accepted_tokens=3 - 0.3 * number) if value else None)
            for number, value in enumerate(values)]


def test_search_history_plots_values_and_the_best_so_far():
    fig = plots.plot_search_history(trials(), objective="tokens_per_s", model="m", date="d")
    (ax,) = fig.axes
    assert labelled_lines(ax) == ["trial", "best so far", "pruned (no value)"]
    value, best, pruned = ax.get_lines()
    assert list(value.get_ydata()) == [5.0, 7.0, 6.0, 9.0]
    assert list(best.get_ydata()) == [5.0, 7.0, 7.0, 9.0, 9.0]
    assert list(pruned.get_xdata()) == [1, 4]
    assert ax.get_ylabel() == "decode speed (tokens/s)" and ax.get_xlabel() == "trial"
    assert "best: #5" in title(fig)


def test_search_history_of_a_two_objective_search_plots_the_expected_speedup():
    rows = [Trial(0, "COMPLETE", [0.2, 1.5], TrialMetrics(expected_speedup=1.1)),
            Trial(1, "COMPLETE", [0.3, 1.2], TrialMetrics(expected_speedup=1.3))]
    fig = plots.plot_search_history(rows)
    assert list(fig.axes[0].get_lines()[0].get_ydata()) == [1.1, 1.3]
    assert "expected speedup" in fig.axes[0].get_ylabel()
    with pytest.raises(SelfspecError, match="trial 0 has two values but no metrics.expected_speedup"):
        plots.plot_search_history([Trial(0, "COMPLETE", [0.2, 1.5])])


@pytest.mark.parametrize("rows,message", [
    ([], "nothing to plot"),
    ([Trial(0, "PRUNED"), Trial(1, "FAIL")], "no COMPLETE trial (1 PRUNED, 1 FAIL)"),
])
def test_search_plots_reject_no_trials_and_no_complete_trial(rows, message):
    for plot in (plots.plot_search_history, plots.plot_pareto_front):
        with pytest.raises(SelfspecError) as error:
            plot(rows)
        assert message in str(error.value)


def test_pareto_front_joins_the_non_dominated_trials_and_stars_the_chosen_one():
    assert plots.pareto_front([(0.1, 3.0), (0.2, 2.0), (0.1, 2.5), (0.3, 2.0), (0.3, 1.0)]) == [0, 3]
    rows = trials()  # complete: (skipped, tokens) = (0.0, 3.0), (0.2, 2.4), (0.3, 2.1), (0.5, 1.5)
    rows[3].metrics.skipped_fraction = 0.1  # (0.1, 2.1): dominated by (0.2, 2.4)
    fig = plots.plot_pareto_front(rows, chosen=5, model="m", date="d")
    (ax,) = fig.axes
    assert labelled_lines(ax) == ["trial", "Pareto front", "chosen by the search (#5)"]
    front = ax.get_lines()[1]
    assert list(front.get_xdata()) == pytest.approx([0.0, 20.0, 50.0])
    assert "%" in ax.get_xlabel() and "tokens per verification" in ax.get_ylabel()
    with pytest.raises(SelfspecError, match="trial 0 metrics lack skipped_fraction"):
        plots.plot_pareto_front([Trial(0, "COMPLETE", [1.0], TrialMetrics())])


def test_strategy_speedups_has_a_bar_per_strategy_and_category_plus_all():
    records = run_records(strategies=("plain", "self_spec_fixed", "self_spec_adaptive"),
                          categories=("code", "writing", "math"))
    fig = plots.plot_strategy_speedups(records, model="m", date="d")
    (ax,) = fig.axes
    assert len(ax.containers) == 2
    summary = summarize(records)
    fixed = ax.containers[0]
    assert [bar.get_height() for bar in fixed] == pytest.approx(
        [summary["self_spec_fixed"]["by_category"][c]["speedup"] for c in ("code", "writing", "math")]
        + [summary["self_spec_fixed"]["speedup"]])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["code\n(n=2)", "writing\n(n=2)", "math\n(n=2)",
                                                          "all\n(n=6)"]
    dots = [line for line in ax.get_lines() if line.get_label() == "_prompt"]
    assert sum(len(line.get_xdata()) for line in dots) == 2 * (6 + 6)  # per category, and again under "all"
    assert "×" in ax.get_ylabel()
    with pytest.raises(SelfspecError, match="only plain decoding"):
        plots.plot_strategy_speedups(run_records(strategies=("plain",)))


def test_sampling_has_three_panels_with_a_bar_per_setting():
    runs = [Run(records=run_records()),
            Run(records=run_records(speed=1.5, steps=((3, 1), (3, 0))), sampling_label="T=0.7, top-p 0.9")]
    fig = plots.plot_sampling(runs, model="m", date="d")
    assert len(fig.axes) == 3
    for ax in fig.axes:
        assert len(ax.containers) == 2
        assert [t.get_text() for t in ax.get_xticklabels()] == ["greedy", "T=0.7, top-p\n0.9"]
    assert fig.axes[0].containers[1][0].get_height() == pytest.approx(1 / 6)
    assert labelled_lines(fig.axes[2]) == ["plain decoding"] and len(fig.legends) == 1
    assert "strategy self_spec" in title(fig) and "4 prompts" in title(fig)
    with pytest.raises(SelfspecError, match="sampling: no records of strategy 'self_spec'"):
        plots.plot_sampling([Run(records=run_records(strategies=("plain",)))])


def batched(records, batch_size):
    """`records` of one run decoded `batch_size` prompts at a time: each strategy's rows in order, a batch's wall
    time 1.5 x its slowest row's time (the last batch may be smaller)."""
    rows = []
    for strategy in dict.fromkeys(r.strategy for r in records):
        mine = [r for r in records if r.strategy == strategy]
        for first in range(0, len(mine), batch_size):
            batch = mine[first:first + batch_size]
            ids = [r.question_id for r in batch]
            wall_s = 1.5 * max(b.elapsed_s for b in batch)
            rows += [dataclasses.replace(r, batch_size=len(batch), batch_elapsed_s=wall_s,
                                         batch_neighbours=[i for i in ids if i != r.question_id]) for r in batch]
    return rows


def batch_runs(sizes=(4, 1, 2)):
    strategies = ("plain", "self_spec_adaptive", "self_spec_tree")
    return [Run(records=batched(run_records(strategies=strategies, per_category=3, speed=1 + size / 2), size),
                batch_size=size) for size in sizes]


def test_batch_figures_draw_a_line_per_strategy_against_the_sorted_batch_sizes():
    runs = batch_runs()
    by_size = sorted(runs, key=lambda run: run.batch_size)
    fig = plots.plot_batch_speedup(runs, model="tiny_llama", date="2025-01-02")
    (ax,) = fig.axes
    assert labelled_lines(ax) == ["self_spec_adaptive", "self_spec_tree", "plain decoding"]
    adaptive = ax.get_lines()[0]
    assert list(adaptive.get_xdata()) == pytest.approx([1, 2, 4], rel=0.05)  # sorted, dodged a little
    assert list(adaptive.get_ydata()) == pytest.approx(
        [summarize(run.records)["self_spec_adaptive"]["speedup"] for run in by_size])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "4"] and "batch size" in ax.get_xlabel()
    assert "×" in ax.get_ylabel() and "tiny_llama" in title(fig) and "2025-01-02" in title(fig)
    assert len(ax.collections) == 2 * 3  # a whisker per strategy and batch size

    fig = plots.plot_batch_throughput(runs, model="tiny_llama", date="2025-01-02")
    (ax,) = fig.axes
    assert labelled_lines(ax) == ["plain", "self_spec_adaptive", "self_spec_tree"]
    for line, strategy in zip(ax.get_lines(), ("plain", "self_spec_adaptive", "self_spec_tree")):
        assert list(line.get_ydata()) == pytest.approx(
            [summarize(run.records)[strategy]["aggregate_tokens_per_s"] for run in by_size])
    assert "tokens/s" in ax.get_ylabel() and "25–75% of batches" in title(fig)
    table = plots.batch_table(runs).splitlines()
    assert len(table) == 2 + 3 * 3 and table[2].startswith("| 1 | plain | ")
    assert table[-1].startswith("| 4 | self_spec_tree |")


@pytest.mark.parametrize("runs,message", [
    ([], "batch speedup: nothing to plot"),
    ([Run(records=run_records(), batch_size=1), Run(records=run_records())],
     "batch speedup: a run has no batch_size in its config; run it with python run.py -m experiment=batch"),
    ([Run(records=run_records(), batch_size=2), Run(records=run_records(), batch_size=2)],
     "several runs of one batch size (batch sizes [2, 2])"),
    ([Run(records=run_records(), batch_size=1), Run(records=run_records(strategies=("plain",)), batch_size=4)],
     "batch speedup at batch_size=4: no records of strategy 'self_spec' (found: plain)"),
    ([Run(records=run_records(strategies=("plain",)), batch_size=1)], "only plain decoding"),
])
def test_batch_figures_reject_runs_without_a_batch_size_or_a_strategy_in_one_line(runs, message):
    with pytest.raises(SelfspecError) as error:
        plots.plot_batch_speedup(runs)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_run_reads_its_batch_size_from_its_config_and_none_without_it():
    assert run_from_config([], {"batch_size": 4}).batch_size == 4
    assert run_from_config([], {}).batch_size is None


def test_aggregate_throughput_counts_each_batch_once():
    records = batched(run_records(strategies=("plain",), per_category=3), 4)  # batches of 4 and 2
    for r in records:
        r.elapsed_s, r.batch_elapsed_s = 1.0, (2.0 if r.batch_size == 4 else 1.0)
    second_turn = [dataclasses.replace(r, turn=1) for r in records]  # the same prompts again: other batches
    assert [(b.new_tokens, b.wall_s) for b in batch_times(records + second_turn)] == [(40, 2.0), (20, 1.0)] * 2
    assert aggregate_tokens_per_s(records) == pytest.approx(60 / 3.0)  # per-row times would give 60 / 6.0
    assert summarize(records + second_turn)["plain"]["aggregate_tokens_per_s"] == pytest.approx(120 / 6.0)
    fig = plots.plot_batch_throughput([Run(records=records, batch_size=4)])
    assert fig.axes[0].get_lines()[0].get_ydata()[0] == pytest.approx(20.0)


def test_serve_load_has_three_panels_over_clients_with_a_colour_per_max_batch():
    from selfspec.records.serve_load import LoadCell

    cells = [LoadCell(batch, clients, 2 * clients, 100 * clients, 2.0, 50.0 * clients / batch ** 0.5, 0.1 * clients,
                      0.2 * clients, 30.0 / clients, 40.0 / clients, float(min(batch, clients)))
             for batch in (8, 1) for clients in (4, 1, 16)]
    fig = plots.plot_serve_load(cells, model="m", date="d")
    throughput, first_token, per_request = fig.axes
    assert labelled_lines(throughput) == ["serve.max_batch=1", "serve.max_batch=8"] and len(fig.legends) == 1
    assert [len(ax.get_lines()) for ax in fig.axes] == [2, 4, 4]  # dashed p95 beside the p50 lines
    assert list(throughput.get_lines()[1].get_xdata()) == [1, 4, 16]
    assert list(throughput.get_lines()[1].get_ydata()) == pytest.approx([50 / 8 ** 0.5, 200 / 8 ** 0.5, 800 / 8 ** 0.5])
    assert list(first_token.get_lines()[1].get_ydata()) == pytest.approx([0.2, 0.8, 3.2])  # max_batch=1's p95
    assert list(per_request.get_lines()[0].get_ydata()) == pytest.approx([30, 7.5, 1.875])
    assert "model: m" in title(fig) and "dashed: p95" in title(fig)
    with pytest.raises(SelfspecError, match="serve load: nothing to plot"):
        plots.plot_serve_load([])
