"""Reading records, runs and searches back typed (one SelfspecError naming file:line and the field for a bad
line), and `make figures` over run folders."""

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from selfspec import plots
from selfspec.errors import SelfspecError
from selfspec.plots import figures as figs
from selfspec.evaluation.summarize import write_summary
from selfspec.records import runs as runs_
from selfspec.records.prompt_records import (PromptRecord, RecordedStep, read_jsonl, read_records, summarize,
                                             verdict)
from selfspec.settings import SkipSet

from helpers import FIGURES, record, run_records


def write_lines(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def write_run(folder: Path, records, config="model: {name: tiny_llama}\n"):
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "config.yaml").write_text(config)
    write_lines(folder / "records.jsonl", [asdict(r) for r in records])


def test_read_records_gives_typed_records_and_steps_and_ignores_fields_it_does_not_read(tmp_path):
    row = asdict(record("self_spec", "a"))
    row["steps"][0]["draft_s"] = 0.01  # StepRecord's timings stay in the file
    path = write_lines(tmp_path / "records.jsonl", [row, "", asdict(record("plain", "a"))])
    first, plain = read_records(path)
    assert isinstance(first, PromptRecord) and first == record("self_spec", "a")
    assert first.steps[0] == RecordedStep(drafted=3, accepted=2, emitted=3, threshold=0.5)
    assert plain.acceptance_rate is None and plain.output_text == ""
    assert read_jsonl(path) == [row, asdict(record("plain", "a"))]  # dicts, as written


@pytest.mark.parametrize("change,message", [
    (lambda row: row.pop("question_id"), "records.jsonl:2: field 'question_id' is missing"),
    (lambda row: row.update(elapsed_s="1.0"), "records.jsonl:2: field 'elapsed_s' is '1.0', not a number"),
    (lambda row: row.update(new_tokens=True), "records.jsonl:2: field 'new_tokens' is True, not an integer"),
    (lambda row: row.update(steps=None), "records.jsonl:2: field 'steps' is None, not a list"),
    (lambda row: row["steps"][1].pop("threshold"), "records.jsonl:2: field 'steps'[1]: field 'threshold' is missing"),
    (lambda row: row["steps"].append(7), "records.jsonl:2: field 'steps'[3]: int is not a JSON object"),
])
def test_a_malformed_record_ends_in_one_error_naming_file_line_and_field(tmp_path, change, message):
    bad = asdict(record("self_spec", "b"))
    change(bad)
    path = write_lines(tmp_path / "records.jsonl", [asdict(record("plain", "a")), bad])
    with pytest.raises(SelfspecError) as error:
        read_records(path)
    assert str(error.value) == f"{tmp_path}/{message}"


def test_a_line_that_is_not_json_names_file_and_line(tmp_path):
    write_lines(tmp_path / "records.jsonl", [asdict(record("plain", "a")), "{oops"])
    with pytest.raises(SelfspecError, match=r"records.jsonl:2: not a JSON line"):
        runs_.load_run(tmp_path)


def test_read_trials_keeps_the_last_line_of_a_trial_in_number_order_and_checks_complete_trials(tmp_path):
    path = write_lines(tmp_path / "trials.jsonl", [
        {"number": 1, "state": "RUNNING", "values": None, "metrics": None},
        {"number": 0, "state": "PRUNED", "values": None, "metrics": None, "pruned": "skips too many"},
        {"number": 1, "state": "COMPLETE", "values": [1.2], "metrics": {"skipped_fraction": 0.25, "speedup": 1.1}}])
    assert runs_.read_trials(path) == [runs_.Trial(0, "PRUNED"),
                                       runs_.Trial(1, "COMPLETE", [1.2], runs_.TrialMetrics(skipped_fraction=0.25))]
    write_lines(path, [{"number": 0, "state": "COMPLETE", "values": None}])
    with pytest.raises(SelfspecError, match=r"trials.jsonl:1: COMPLETE trial 0 has no values$"):
        runs_.read_trials(path)
    write_lines(path, [{"state": "COMPLETE"}])
    with pytest.raises(SelfspecError, match=r"trials.jsonl:1: field 'number' is missing$"):
        runs_.read_trials(path)


def test_load_search_reads_trials_the_best_skip_set_and_the_objective(tmp_path):
    write_lines(tmp_path / "trials.jsonl", [{"number": 0, "state": "COMPLETE", "values": [3.0]}])
    search = runs_.load_search(tmp_path)
    assert search.best is None and search.objective is None and len(search.trials) == 1
    (tmp_path / "best_skip.yaml").write_text("attn: [1]\nmlp: [0, 2]\nnum_layers: 4\nmodel: m\n"
                                             "metrics: {objective: pareto, trial: 0}\n")
    search = runs_.load_search(tmp_path)
    assert (search.best, search.num_layers, search.model) == (SkipSet(attn=(1,), mlp=(0, 2)), 4, "m")
    assert (search.objective, search.best_trial) == ("pareto", 0)
    (tmp_path / "best_skip.yaml").write_text("attn: [9]\nmlp: []\nnum_layers: 4\n")
    with pytest.raises(SelfspecError, match=r"best_skip.yaml: attn: layer id 9 is out of range"):
        runs_.load_search(tmp_path)
    with pytest.raises(SelfspecError, match="no trials.jsonl"):
        runs_.load_search(tmp_path / "nothing")


def test_load_runs_reads_a_sweep_in_job_order_and_latest_picks_the_newest(tmp_path):
    sweep = tmp_path / "experiments" / "threshold_sweep" / "2025-03-04_05-06-07"
    for job in (0, 2, 10):
        config = f"model: {{name: m}}\ndraft: {{policy: threshold, threshold: 0.{job}}}\n"
        write_run(sweep / str(job), run_records(), config)
    write_run(tmp_path / "experiments" / "threshold_sweep" / "2025-01-01_00-00-00", run_records())
    assert runs_.latest(tmp_path, "threshold_sweep") == sweep
    assert runs_.latest(tmp_path, "sampling") is None
    runs = runs_.load_runs(sweep)
    assert [r.path.name for r in runs] == ["0", "2", "10"]
    assert runs[0].model == "m" and runs[0].date == "2025-03-04 05:06"
    assert [(r.draft_policy, r.draft_threshold) for r in runs] == [("threshold", 0.0), ("threshold", 0.2),
                                                                  ("threshold", 0.1)]
    assert runs[0].records == run_records()
    with pytest.raises(SelfspecError, match="no records.jsonl in it or in its subfolders"):
        runs_.load_runs(tmp_path / "nothing")


def test_run_settings_come_from_the_config_with_the_default_threshold_and_labels():
    run = runs_.run_from_config([], {"draft": {"policy": "adaptive", "threshold": None, "target_acceptance": 0.7}})
    assert (run.draft_policy, run.draft_threshold, run.target_acceptance) == ("adaptive", 0.8, 0.7)
    sampled = runs_.run_from_config([], {"draft": {"threshold": None}, "sampling": {"temperature": 0.7, "top_p": 0.9,
                                                                                     "top_k": 0}})
    assert (sampled.draft_policy, sampled.draft_threshold, sampled.sampling_label) == ("?", 0.5, "T=0.7, top-p 0.9")
    assert runs_.run_from_config([], {"sampling": {"temperature": 0.0}}).sampling_label == "greedy"
    skip = runs_.run_from_config([], {"skip": {"attn": [1, 2], "mlp": [0]}, "skip_num_layers": 6,
                                      "skip_set": "searched"})
    assert (skip.skipped_fraction, skip.skip_set) == (0.25, "searched")
    assert runs_.run_from_config([], {"skip": {"attn": [1], "mlp": []}}).skipped_fraction is None


def test_find_records_prefers_the_given_path_then_outputs_then_the_sample(tmp_path):
    assert runs_.find_records("strategies", tmp_path) == tmp_path
    write_run(tmp_path / "experiments" / "strategies" / "2025-01-01_00-00-00", run_records())
    assert runs_.find_records("strategies", outputs=tmp_path).name == "2025-01-01_00-00-00"
    assert runs_.find_records("sampling", outputs=tmp_path).is_relative_to(runs_.SAMPLE_RECORDS)
    with pytest.raises(SelfspecError, match="experiment 'bench' is unknown"):
        runs_.find_records("bench")


def test_records_date_falls_back_to_the_file_time(tmp_path):
    (tmp_path / "records.jsonl").write_text("")
    assert len(runs_.records_date(tmp_path / "records.jsonl")) == len("2025-01-01 00:00")


def test_make_figures_draws_the_shipped_samples_labelled_where_outputs_have_no_records(tmp_path):
    write_run(tmp_path / "experiments" / "strategies" / "2025-01-01_00-00-00", run_records())
    lines = []
    made = figs.make_figures(tmp_path, tmp_path / "figures", log=lines.append)
    assert set(made) == {name for group in figs.FIGURE_GROUPS for name in FIGURES[group]}
    assert (tmp_path / "figures" / "strategies_speedup.png").stat().st_size > 10_000
    assert (tmp_path / "figures" / "strategies_speedup.pdf").read_bytes().startswith(b"%PDF")
    for name, fig in made.items():
        from_sample = not name.startswith("strategies")
        assert ("(sample records)" in fig.get_suptitle()) == from_sample, name
    assert sum("drawing the shipped sample records" in line for line in lines) == len(figs.FIGURE_GROUPS) - 1  # every experiment but one
    assert any("python run.py -m experiment=threshold_sweep" in line for line in lines)
    assert f"{tmp_path / 'figures' / 'strategies_speedup'}.{{png,pdf}} <- {tmp_path}/experiments/strategies/" \
           "2025-01-01_00-00-00" in lines


def test_make_figures_reports_bad_records_and_goes_on(tmp_path):
    write_run(tmp_path / "experiments" / "strategies" / "2025-01-01_00-00-00", run_records(strategies=("plain",)))
    bad = tmp_path / "experiments" / "sampling" / "2025-01-01_00-00-00" / "0"
    write_run(bad, run_records())
    write_lines(bad / "records.jsonl", [{"strategy": "plain"}])
    lines = []
    assert figs.make_figures(tmp_path, tmp_path / "figures", log=lines.append, samples=None) == {}
    assert any(line.startswith("strategies: skipped, strategy speedups: only plain decoding") for line in lines)
    assert f"sampling: skipped, {bad / 'records.jsonl'}:1: field 'question_id' is missing" in lines


def test_log_figures_logs_one_image_per_figure():
    import wandb

    class Run:
        logged = {}

        def log(self, row):
            self.logged.update(row)

    run = Run()
    figs.log_figures(run, {"a": plots.plot_skip_mask(SkipSet(attn=(0,)), 2)})
    assert list(run.logged) == ["figures/a"] and isinstance(run.logged["figures/a"], wandb.Image)


def test_summary_md_gives_each_categorys_speedup_and_tokens_per_verification(tmp_path):
    """A mix's summary.md ends with a table per prompt category (all first), each cell the speedup over plain and the
    tokens per verification of summary.json's by_category; prompts of one category get no such table."""
    summary = summarize(run_records(strategies=("plain", "self_spec"), categories=("code", "writing", "math")))
    write_summary(tmp_path, summary, "m, 6 prompts, greedy")
    text = (tmp_path / "summary.md").read_text()
    head, table = text.split("Speedup over plain decoding per prompt category (tokens per verification):\n\n")
    assert head.startswith("m, 6 prompts, greedy\n\n| strategy | tokens_per_s")
    rows = table.strip().splitlines()
    assert rows[0] == "| strategy | all | code | writing | math |" and len(rows) == 4
    spec = summary["self_spec"]
    cells = [spec, *(spec["by_category"][cat] for cat in ("code", "writing", "math"))]
    assert rows[3] == "| self_spec | " + " | ".join(f"{c['speedup']:.2f} ({c['mean_accepted_tokens']:.2f})"
                                                    for c in cells) + " |"
    assert rows[2].startswith("| plain | 1.00 (1.00) | 1.00 (1.00)")
    assert len({f"{c['speedup']:.2f}" for c in cells}) > 1  # the categories' speedups differ: each is its own
    write_summary(tmp_path, summarize(run_records(categories=("code",))), "m, 2 prompts, greedy")
    assert "per prompt category" not in (tmp_path / "summary.md").read_text()


def test_verdict_names_the_fastest_and_says_why_slower_strategies_lost():
    summary = {"plain": {"speedup": 1.0, "mean_accepted_tokens": 1.0},
               "self_spec": {"speedup": 0.8, "mean_accepted_tokens": 2.0, "acceptance_rate": 0.5},
               "self_spec_hybrid": {"speedup": 1.25, "mean_accepted_tokens": 1.5, "acceptance_rate": 0.4},
               "hf_generate": {"speedup": 0.95, "mean_accepted_tokens": 1.0, "acceptance_rate": None}}
    assert verdict(summary) == ("self_spec_hybrid was fastest at 1.25x plain decoding; self_spec ran 0.80x: its "
                                "steps emitted 2.00 tokens each but took 2.50 plain steps' time (drafting cost "
                                "more than it saved); hf_generate ran 0.95x without drafting.")
    assert verdict({"plain": summary["plain"]}) == ""
    slower = {"plain": summary["plain"], "self_spec": summary["self_spec"]}
    assert verdict(slower).startswith("plain decoding was fastest; self_spec ran 0.80x")
