"""data=spec_bench: Spec-Bench's 480 prompts and their calibration and evaluation halves per task type."""

import json
from collections import Counter

import pytest

from selfspec.data.prompt_sets import (MT_BENCH_CATEGORIES, SPEC_BENCH_TASKS, load_prompt_set, load_prompts,
                                       spec_bench_categories, split_prompts)
from selfspec.errors import SelfspecError
from selfspec.settings import DataSettings

from helpers import run_settings


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
