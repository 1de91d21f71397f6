"""data=spec_bench: Spec-Bench's 480 prompts, their calibration and evaluation halves per task type, answer files with
Spec-Bench's own categories, and a summary in the shape of its leaderboard."""

import json
from collections import Counter

import pytest

from selfspec.data.prompt_sets import (MT_BENCH_CATEGORIES, SPEC_BENCH_TASKS, load_prompt_set, load_prompts,
                                       spec_bench_categories, split_prompts)
from selfspec.errors import SelfspecError
from selfspec.evaluation.spec_bench import leaderboard_table, write_answers
from selfspec.evaluation.summarize import write_summary
from selfspec.records.prompt_records import summarize
from selfspec.settings import DataSettings

from helpers import main_in_process, record, run_records, run_settings


def halves(**data) -> dict[str, list]:
    return {split: load_prompt_set(DataSettings(name="spec_bench", split=split, **data))
            for split in ("calibration", "evaluation")}


def test_spec_bench_is_480_prompts_six_task_types_of_80():
    prompts = load_prompts("spec_bench")
    assert len(prompts) == 480 and len({p.question_id for p in prompts}) == 480
    assert Counter(p.category for p in prompts) == {task: 80 for task in SPEC_BENCH_TASKS}
    assert all(p.chat for p in prompts)
    assert {len(p.turns) for p in prompts if p.category == "mt_bench"} == {2}  # MT-bench: two turns each
    assert {len(p.turns) for p in prompts if p.category != "mt_bench"} == {1}
    mt_bench = [spec_bench_categories()[p.question_id] for p in prompts if p.category == "mt_bench"]
    assert Counter(mt_bench) == {category: 10 for category in MT_BENCH_CATEGORIES}


def test_halves_are_disjoint_balanced_per_task_type_and_mt_bench_category_and_stable():
    calibration, evaluation = halves().values()
    ids = [{p.question_id for p in half} for half in (calibration, evaluation)]
    assert not ids[0] & ids[1] and ids[0] | ids[1] == {p.question_id for p in load_prompts("spec_bench")}
    for half in (calibration, evaluation):
        assert Counter(p.category for p in half) == {task: 40 for task in SPEC_BENCH_TASKS}
        mt_bench = Counter(spec_bench_categories()[p.question_id] for p in half if p.category == "mt_bench")
        assert mt_bench == {category: 5 for category in MT_BENCH_CATEGORIES}
    assert [p.question_id for p in calibration[:3]] == ["81", "83", "85"]  # each task type's 1st, 3rd, 5th, ...
    assert [p.question_id for p in evaluation if p.category == "rag"][:3] == ["482", "484", "486"]
    assert halves() == {"calibration": calibration, "evaluation": evaluation}
    # training splits the whole set at once (split_prompts): the same halves
    assert split_prompts(load_prompts("spec_bench"), "calibration") == calibration


def test_limit_and_offset_count_per_task_type_as_per_set_of_mix():
    evaluation = halves(limit=2, offset=1)["evaluation"]
    assert [(p.question_id, p.category) for p in evaluation[:4]] == [
        ("84", "mt_bench"), ("86", "mt_bench"), ("164", "translation"), ("166", "translation")]
    assert Counter(p.category for p in evaluation) == {task: 2 for task in SPEC_BENCH_TASKS}
    assert len(halves(offset=39)["evaluation"]) == 6
    with pytest.raises(SelfspecError, match="data.offset=40 leaves no prompts in the calibration split of "
                                        "spec_bench's task 'mt_bench'; lower it"):
        halves(offset=40)


def test_data_spec_bench_composes_and_make_bench_reports_on_the_evaluation_half():
    data = run_settings("data=spec_bench").data
    assert data.names == ["spec_bench"] and data.split == "all" and data.turns == "all" and data.limit == 3
    bench = run_settings("experiment=bench", "data=spec_bench", "data.limit=1").data
    assert bench.names == ["spec_bench"] and bench.split == "evaluation" and bench.limit == 1
    search = run_settings("data=spec_bench", "search=optuna").search.data
    assert search.names == ["spec_bench"] and search.split == "calibration"


def test_answer_files_carry_spec_benchs_own_categories(tmp_path, tokenizer):
    records = [record("self_spec", "82", "mt_bench"), record("self_spec", "162", "translation")]
    (path,) = write_answers(tmp_path, records, tokenizer, "m")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(row["question_id"], row["category"]) for row in rows] == [(82, "writing"), (162, "translation")]


def test_the_summary_reports_spec_benchs_six_task_types_as_its_leaderboard(tmp_path):
    summary = summarize(run_records(categories=tuple(SPEC_BENCH_TASKS), per_category=1))
    header, rule, plain, spec = leaderboard_table(summary).splitlines()
    assert header == ("| strategy | Multi-turn Conversation | Translation | Summarization | Question Answering | "
                      "Mathematical Reasoning | Retrieval-aug. Generation | #Mean Accepted Tokens | Overall |")
    assert plain == "| plain | " + "1.00x | " * 6 + "1.00 | 1.00x |"
    row = summary["self_spec"]
    cells = spec.strip("| ").split(" | ")
    assert cells[0] == "self_spec" and cells[-2:] == [f"{row['mean_accepted_tokens']:.2f}", f"{row['speedup']:.2f}x"]
    assert cells[1] == f"{row['by_category']['mt_bench']['speedup']:.2f}x"
    assert "Multi-turn Conversation" in write_summary(tmp_path, summary, "title")
    assert leaderboard_table(summarize(run_records(categories=("qa", "translation")))) == ""  # other sets: by category


@pytest.mark.slow  # run.py's main, in this process
def test_a_tiny_run_over_spec_bench_reports_the_six_task_types(tmp_path, monkeypatch, capsys):
    code, stderr = main_in_process(monkeypatch, capsys, "experiment=bench", "model=tiny_llama", "logger=none",
                                   "data=spec_bench", "data.limit=1", "strategies=[plain,self_spec_fixed]",
                                   "repeats=1", "warmup=false", "sampling.max_new_tokens=4",
                                   "spec_bench_answers=true", f"hydra.run.dir={tmp_path}")
    assert code == 0, stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert list(summary["self_spec_fixed"]["by_category"]) == list(SPEC_BENCH_TASKS)
    assert summary["plain"]["n_prompts"] == 6 and summary["plain"]["n_turns"] == 7  # mt_bench: both turns
    assert "| self_spec_fixed | " in (tmp_path / "summary.md").read_text().split("Retrieval-aug. Generation")[1]
    answers = (tmp_path / "model_answer" / "tiny_llama-plain.jsonl").read_text()
    rows = [json.loads(line) for line in answers.splitlines()]
    assert [(row["question_id"], row["category"], len(row["choices"][0]["turns"])) for row in rows] == [
        (82, "writing", 2), (162, "translation", 1), (242, "summarization", 1), (322, "qa", 1),
        (402, "math_reasoning", 1), (482, "rag", 1)]
