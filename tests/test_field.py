"""experiment=field: every training-free method chosen from the registry, Spec-Bench's task types for the shipped
sets and a question.jsonl, its leaderboard with lossless marks, its answer files and its figure."""

import json
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from selfspec.data.prompt_sets import MT_BENCH_CATEGORIES, SPEC_BENCH_TASKS
from selfspec.decoding.strategies import REGISTRY
from selfspec.errors import SelfspecError, SelfspecWarning
from selfspec.evaluation.field import by_task_type, field_prompts, field_strategies, field_table, lossless_mark
from selfspec.plots import plot_field_speedups
from selfspec.settings import DataSettings

from helpers import CONF, main_in_process, run_records

QUESTIONS = Path(__file__).parent / "data" / "spec_bench_question.jsonl"  # 7 prompts of Spec-Bench's file
NEEDS_A_PART = {"self_spec_head", "store_tree", "two_model", "kangaroo"}  # a head, a store, a model, an adapter


def table_rows(text: str) -> dict[str, list[str]]:
    """A markdown table's body rows: first cell -> the other cells."""
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("|")]
    return {row[0]: row[1:] for row in rows[2:]}


def test_field_composes_training_free_with_answer_files():
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=field"])
    assert list(cfg.strategies) == ["field"] and cfg.spec_bench_answers and cfg.repeats == 3
    assert cfg.draft.head is None and cfg.draft.store is None and cfg.draft_model is None
    assert cfg.data.name[0] == "humaneval" and cfg.data.split == "evaluation"


def test_strategies_needing_a_missing_part_are_left_out_with_a_line():
    def build(name):
        if name in NEEDS_A_PART:
            raise SelfspecError(f"strategy {name} needs a part\nsecond line")
        return name

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        built = field_strategies(build)
    assert built[0] == "plain"
    assert built == [s.name for s in REGISTRY.values() if not s.hf_baseline and s.name not in NEEDS_A_PART]
    lines = sorted(str(w.message) for w in caught if w.category is SelfspecWarning)
    assert lines == sorted(f"experiment=field leaves out {n}: strategy {n} needs a part" for n in NEEDS_A_PART)


def test_shipped_sets_take_their_spec_bench_counterparts_and_code_keeps_its_own():
    prompts = field_prompts(DataSettings(name=["humaneval", "chat", "summarize", "qa", "math", "translate",
                                               "retrieval"], limit=2, split="evaluation"))
    by_set = {p.question_id.split("-")[0].split("/")[0]: p.category for p in prompts
              if not p.question_id.startswith("chat")}
    assert by_set == {"HumanEval": "code", "summarize": "summarization", "qa": "qa", "math": "math_reasoning",
                      "translate": "translation", "retrieval": "rag"}
    chat = [p.category for p in prompts if p.question_id.startswith("chat")]
    assert len(chat) == 2 and set(chat) <= set(MT_BENCH_CATEGORIES)
    records = by_task_type(run_records(categories=("writing", "math", "math_reasoning", "code")))
    assert {r.category for r in records} == {"mt_bench", "math_reasoning", "code"}  # MT-bench's math: mt_bench


def test_lossless_marks_come_from_the_runs_own_check():
    records = run_records(strategies=("plain", "self_spec", "lossy"), categories=("writing", "rag", "code"))
    records = [replace(r, matches_plain=False) if (r.strategy, r.question_id) == ("lossy", "rag-0") else r
               for r in records]
    rows = table_rows(field_table(records, greedy=True))
    header = field_table(records, greedy=True).splitlines()[0]
    assert header.split(" | ")[1:7] == list(SPEC_BENCH_TASKS.values())
    assert "code (not in Spec-Bench)" in header and header.endswith("| Overall | Lossless |")
    assert list(rows) == ["plain", "self_spec", "lossy"] and all(len(cells) == 10 for cells in rows.values())
    assert [rows[name][-1] for name in rows] == ["reference", "yes (6/6 equal plain's)", "no (5/6 equal plain's)"]
    assert rows["self_spec"][0].endswith("x") and rows["self_spec"][1] == "-"  # writing: mt_bench; no translation
    assert lossless_mark("self_spec", {"outputs_match_plain": 0.0, "n_turns": 4}, greedy=False) == \
        "sampled, distribution-checked by tests"


def test_the_figure_marks_methods_whose_outputs_differ():
    records = run_records(strategies=("plain", "self_spec", "lossy"), categories=("writing", "qa"))
    records = [replace(r, matches_plain=False) if r.strategy == "lossy" else r for r in records]
    ax = plot_field_speedups(records, model="tiny").axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["self_spec", "lossy *"]
    assert [t.get_text() for t in ax.get_xticklabels()][-1] == "Overall" and len(ax.get_xticklabels()) == 3
    sampled = plot_field_speedups(records, greedy=False).axes[0]
    assert [t.get_text() for t in sampled.get_yticklabels()] == ["self_spec", "lossy"]
    with pytest.raises(SelfspecError, match="only plain"):
        plot_field_speedups([r for r in records if r.strategy == "plain"])


@pytest.mark.usefixtures("one_thread")
def test_a_tiny_field_run_on_a_question_file(tmp_path, monkeypatch, capsys, recwarn):
    code, stderr = main_in_process(monkeypatch, capsys, "experiment=field", "model=tiny_llama", "data=jsonl",
                                   f"data.path={QUESTIONS}", "repeats=2", "warmup=false",
                                   "sampling.max_new_tokens=6", f"hydra.run.dir={tmp_path}")
    assert code == 0, stderr[-3000:]
    left_out = {str(w.message).split(":")[0].removeprefix("experiment=field leaves out ") for w in recwarn
                if str(w.message).startswith("experiment=field leaves out ")}
    assert left_out >= NEEDS_A_PART
    methods = [s.name for s in REGISTRY.values() if not s.hf_baseline and s.name not in left_out]
    assert {"self_spec", "self_spec_adaptive", "prompt_lookup", "self_spec_tree"} <= set(methods)

    rows = table_rows((tmp_path / "field.md").read_text())
    assert list(rows) == methods and all(len(cells) == 9 for cells in rows.values())  # 6 task types + 3
    assert all(cell.endswith("x") for cells in rows.values() for cell in cells[:6] + cells[7:8])
    assert [cells[-1] for cells in rows.values()] == ["reference"] + ["yes (7/7 equal plain's)"] * (len(methods) - 1)

    questions = [json.loads(line) for line in QUESTIONS.read_text().splitlines()]
    for method in methods:
        answers = [json.loads(line) for line in
                   (tmp_path / "model_answer" / f"tiny_llama-{method}.jsonl").read_text().splitlines()]
        assert [(a["question_id"], a["category"]) for a in answers] == [(q["question_id"], q["category"])
                                                                          for q in questions]
        for answer in answers:
            assert answer["model_id"] == f"tiny_llama-{method}"
            (choice,) = answer["choices"]
            assert len(choice["turns"]) == len(choice["new_tokens"]) == len(choice["wall_time"]) == 1
            assert isinstance(choice["turns"][0], str) and choice["new_tokens"] == [6] and choice["wall_time"][0] > 0
            assert len(choice["accept_lengths"]) == sum(choice["decoding_steps"])
            assert sum(choice["accept_lengths"]) <= 6
        # Spec-Bench's speed.py: a task type's answers by category (mt_bench: MT-bench's eight), tokens over time
        for task in SPEC_BENCH_TASKS:
            mine = [a for a in answers if (a["category"] in MT_BENCH_CATEGORIES if task == "mt_bench"
                                           else a["category"] == task)]
            assert mine and all(sum(a["choices"][0]["new_tokens"]) / sum(a["choices"][0]["wall_time"]) > 0
                                for a in mine)
