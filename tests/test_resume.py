"""Interrupted runs lose nothing: a resumed run ends with the records and summary of an uninterrupted one, and
`python -m selfspec.summarize` rebuilds the summary of any run."""

import json
import os
import signal
import subprocess
import time
from dataclasses import replace

import pytest

from selfspec.api.decoder import DEFAULT_DRAFT, DEFAULT_SAMPLING
from selfspec.data.prompt_sets import encode_prompt, load_prompts
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.strategies import make_strategy
from selfspec.evaluation import summarize as summarize_cli
from selfspec.evaluation.evaluate import evaluate
from selfspec.models.tiny import tiny_model
from selfspec.records.prompt_records import WrittenRecord, first_difference, read_records, summarize
from selfspec.settings import SkipSet

from helpers import run_py

TIMES = {"elapsed_s", "tokens_per_s", "speedup", "peak_mem_mb", "median_prompt_speedup", "steps", "batch_elapsed_s",
         "aggregate_tokens_per_s"}  # vary run to run


def strategies(model):
    """plain, and two drafters whose state runs on from prompt to prompt (adaptive exit; hybrid routes updates)."""
    sampling = replace(DEFAULT_SAMPLING, max_new_tokens=12)
    draft = replace(DEFAULT_DRAFT, policy="adaptive", max_tokens=4, ngram_tokens=10, hybrid_policy=None)  # adaptive: its
    # state replays exactly; the cost-aware exit follows measured times, so its draft counts differ run to run
    skip = SkipSet(attn=(2, 4), mlp=(3,))
    return [make_strategy(name, model, GenerationOptions(sampling, end_ids=(2,)), skip=skip, draft=draft) for name in ("plain", "self_spec", "self_spec_hybrid")]


def untimed(records) -> list[dict]:
    return [{k: v for k, v in vars(r).items() if k not in TIMES} | {"steps": [(s.drafted, s.accepted, s.emitted,
                                                                              s.threshold) for s in r.steps]}
            for r in records]


def without_times(summary: dict) -> dict:
    return {key: without_times(value) if isinstance(value, dict) else value
            for key, value in summary.items() if key not in TIMES}


def test_a_resumed_evaluation_records_what_an_uninterrupted_one_does(tmp_path, tokenizer):
    model = tiny_model("llama", num_layers=6)
    prompts = load_prompts("chat", limit=2)
    ids = [encode_prompt(tokenizer, p) for p in prompts]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    whole.mkdir(), cut.mkdir()
    expected = evaluate(strategies(model), prompts, ids, tokenizer, whole)
    lines = (whole / "records.jsonl").read_text().splitlines(keepends=True)
    (cut / "records.jsonl").write_text("".join(lines[:4]))  # prompt 1 whole, prompt 2's plain record only
    earlier = read_records(cut / "records.jsonl", WrittenRecord)
    resumed = evaluate(strategies(model), prompts, ids, tokenizer, cut, earlier=earlier)
    assert (cut / "records.jsonl").read_text().splitlines(keepends=True)[:4] == lines[:4]  # kept as written
    assert untimed(read_records(cut / "records.jsonl")) == untimed(read_records(whole / "records.jsonl"))
    assert without_times(resumed) == without_times(expected)
    second = [r for r in read_records(cut / "records.jsonl") if r.question_id == prompts[1].question_id]
    assert second[1].speedup == pytest.approx(second[1].tokens_per_s / second[0].tokens_per_s)  # plain read back


def test_summarize_rebuilds_the_summary_of_an_unfinished_run(tmp_path, capsys):
    records = [json.dumps(record_row(*row)) for row in (("plain", "a", [1, 2, 3], [1, 2, 3]),
                                                        ("self_spec", "a", [1, 2, 4], [1, 2, 3]),
                                                        ("plain", "b", [5, 6], [5, 6]))]
    (tmp_path / "records.jsonl").write_text("\n".join(records) + '\n{"strategy": "self_spec", "quest')  # torn
    (tmp_path / "settings.json").write_text(json.dumps({"model": {"name": "tiny_llama"}, "sampling": {}}))
    with pytest.warns(UserWarning, match="torn last line"):
        summarize_cli.main([str(tmp_path)])
        expected = json.loads(json.dumps(summarize(read_records(tmp_path / "records.jsonl"))))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == expected
    assert summary["plain"]["n_prompts"] == 2 and summary["self_spec"]["n_prompts"] == 1
    assert summary["self_spec"]["outputs_match_plain"] == 0.0 and summary["self_spec"]["median_first_difference"] == 2
    assert (tmp_path / "summary.md").read_text().startswith("tiny_llama, 2 prompts, greedy\n\n| strategy |")
    assert "| self_spec |" in capsys.readouterr().out


def test_summarize_of_a_folder_without_records_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        summarize_cli.main([str(tmp_path)])
    assert stop.value.code == 2
    assert capsys.readouterr().err == f"selfspec: error: {tmp_path}: no records.jsonl; give the folder of a run " \
                                      f"(its hydra.run.dir)\n"


def record_row(strategy, question_id, output, plain_output) -> dict:
    differ = first_difference(output, plain_output)
    return dict(strategy=strategy, question_id=question_id, category="c", prompt_tokens=3, new_tokens=len(output),
                elapsed_s=1.0, tokens_per_s=len(output), drafted=2, accepted=1, verify_steps=2, emitted=2,
                acceptance_rate=0.5, mean_accepted_tokens=1.0, speedup=1.0, matches_plain=differ is None,
                first_difference=differ, output_ids=output, steps=[])


# every run.py call here starts with these
TINY_RUN = ["model=tiny_llama", "logger=none", "data.name=chat", "data.limit=4", "sampling.max_new_tokens=24",
            "strategies=[plain,self_spec]"]


@pytest.mark.slow
def test_a_run_killed_mid_way_and_resumed_ends_as_an_uninterrupted_run(tmp_path):
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    process = run_py(*TINY_RUN, out_dir=killed, wait=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    records = killed / "records.jsonl"
    deadline = time.monotonic() + 300
    while not (records.is_file() and records.read_text().count("\n") >= 1) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    written = records.read_text()
    assert 1 <= written.count("\n") < 8 and written.endswith("\n")  # killed mid-run, whole lines only
    assert not (killed / "summary.json").exists()
    result = run_py(*TINY_RUN, "resume=true", out_dir=killed)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (killed / "records.jsonl").read_text().startswith(written)
    assert run_py(*TINY_RUN, out_dir=whole).returncode == 0
    summaries = [json.loads((d / "summary.json").read_text()) for d in (killed, whole)]
    assert without_times(summaries[0]) == without_times(summaries[1])
    assert summaries[0]["self_spec"]["n_prompts"] == 4 and summaries[0]["self_spec"]["outputs_match_plain"] == 1.0
    assert untimed(read_records(killed / "records.jsonl")) == untimed(read_records(whole / "records.jsonl"))


@pytest.mark.slow
def test_resume_with_another_config_or_an_unusable_run_dir_is_one_line(tmp_path):
    assert run_py(*TINY_RUN, "data.limit=1", out_dir=tmp_path / "run").returncode == 0
    before = (tmp_path / "run" / "records.jsonl").read_text()
    result = run_py(*TINY_RUN, "data.limit=1", "sampling.max_new_tokens=8", "resume=true", out_dir=tmp_path / "run")
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1] == (
        f"selfspec: error: resume=true: {tmp_path / 'run' / 'records.jsonl'} was written with other settings: "
        f"sampling.max_new_tokens=24 (now 8); rerun with those, or without resume=true to start afresh (the earlier "
        f"files are kept)")
    assert (tmp_path / "run" / "records.jsonl").read_text() == before
    (tmp_path / "afile").write_text("")
    result = run_py(*TINY_RUN, out_dir=tmp_path / "afile" / "run")
    assert result.returncode == 2 and result.stderr == (
        f"selfspec: error: output directory {tmp_path / 'afile' / 'run'} cannot be made: {tmp_path / 'afile'} is a "
        f"file, not a folder; choose another with hydra.run.dir=...\n")
