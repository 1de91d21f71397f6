"""run.py end to end on tiny models: records, summary, table, W&B offline history."""

import json

import pytest

from helpers import run_py
from wandb_history import history

pytestmark = pytest.mark.slow  # run.py in a subprocess, end to end

SUMMARY_KEYS = {"tokens_per_s", "speedup", "acceptance_rate", "mean_accepted_tokens", "outputs_match_plain",
                "n_prompts", "new_tokens"}
TINY_RUN = ["data.limit=2", "sampling.max_new_tokens=24"]  # every run.py call here starts with these


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_gemma2"])
def test_run_writes_records_summary_and_table(tmp_path, model):
    result = run_py(*TINY_RUN, f"model={model}", "model.dtype=float64", "logger=none", "data.name=chat",
                    "strategies=[plain,self_spec,self_spec_fixed,two_model]", "draft_model=tiny_llama",
                    out_dir=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert list(summary) == ["plain", "self_spec", "self_spec_fixed", "two_model"]
    for name, row in summary.items():
        assert SUMMARY_KEYS <= set(row)
        assert row["n_prompts"] == 2 and row["new_tokens"] > 0
        assert row["outputs_match_plain"] == 1.0  # greedy: lossless
    assert summary["plain"]["speedup"] == pytest.approx(1.0)
    assert summary["self_spec"]["acceptance_rate"] is not None and summary["plain"]["acceptance_rate"] is None
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert len(records) == 8 and {r["question_id"] for r in records} == {"chat-01", "chat-02"}
    spec = [r for r in records if r["strategy"] == "self_spec"]
    for r in spec:
        assert sum(s["emitted"] for s in r["steps"]) + 1 == r["new_tokens"]
        assert r["accepted"] == sum(s["accepted"] for s in r["steps"]) <= r["drafted"]
        assert all(0 <= s["threshold"] <= 1 for s in r["steps"])
    assert "| self_spec |" in result.stdout and "prompts: 100%" in result.stderr
    assert (tmp_path / "summary.md").exists()


def test_run_with_hf_baselines_records_peak_memory(tmp_path):
    result = run_py(*TINY_RUN, "model=tiny_llama", "model.dtype=float64", "logger=none", "data.name=chat",
                    "draft_model=tiny_llama", "strategies=[plain,self_spec,hf_generate,hf_prompt_lookup,hf_early_exit,"
                    "hf_assistant]", "hf.early_exit_layer=3", out_dir=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert list(summary) == ["plain", "self_spec", "hf_generate", "hf_prompt_lookup", "hf_early_exit", "hf_assistant"]
    assert all(row["outputs_match_plain"] == 1.0 and row["peak_mem_mb"] is not None for row in summary.values())
    assert summary["hf_early_exit"]["acceptance_rate"] is not None


def test_sampling_run_records_acceptance(tmp_path):
    result = run_py(*TINY_RUN, "model=tiny_llama", "logger=none", "sampling=sample", "strategies=[plain,self_spec]",
                    out_dir=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert 0 <= summary["self_spec"]["acceptance_rate"] <= 1


def test_offline_wandb_run_logs_steps_prompts_and_summary(tmp_path):
    result = run_py(*TINY_RUN, "model=tiny_llama", "logger=wandb", "logger.mode=offline", out_dir=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    rows = history(run_dir)
    keys = set().union(*rows)
    for key in ("self_spec/verify_step", "self_spec/step_acceptance", "self_spec/step_threshold",
                "self_spec/prompt_tokens_per_s", "self_spec/prompt_speedup", "plain/prompt_tokens_per_s", "prompt"):
        assert key in keys, key
    thresholds = [row["self_spec/step_threshold"] for row in rows if "self_spec/step_threshold" in row]
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert thresholds == [s["threshold"] for r in records if r["strategy"] == "self_spec" for s in r["steps"]]


def test_banned_words_and_stop_strings_hold_for_every_strategy_and_are_recorded(tmp_path):
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]  # a tiny random model's bytes hit some of them
    result = run_py(*TINY_RUN, "model=tiny_llama", "model.dtype=float64", "logger=none", "data.name=chat",
                    "strategies=[plain,self_spec,self_spec_tree]", f"constraints.banned_words=[{','.join(letters)}]",
                    "sampling.stop=['0','1','2','3','4','5','6','7','8','9']", out_dir=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert all(row["outputs_match_plain"] == 1.0 for row in summary.values())
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert sum(r["rollbacks"] for r in records if r["strategy"] == "plain") >= 1
    for r in records:
        assert not set(r["output_text"].lower()) & set(letters) and not any(c.isdigit() for c in r["output_text"])
        assert r["finish_reason"] == "stop" if r["new_tokens"] < 24 else r["finish_reason"] in ("stop", "length")
