"""experiment=field: every training-free method of the registry on Spec-Bench-shaped prompts, reported in the shape
of Spec-Bench's leaderboard.

The methods are chosen by what they are built from, not listed: `strategies=[field]` stands for plain decoding and
every registered strategy of ours (transformers' own generate baselines are not methods) that builds from the model
alone, with no second model, trained head, token store or adapter; one that needs such a part is left out with one
warning line saying what it needs, and a strategy registered later joins by itself.

The prompts fall under Spec-Bench's six task types: its own file (data=spec_bench) and a Spec-Bench or MT-bench
question.jsonl (data=jsonl) carry them or MT-bench's eight categories (its mt_bench task type), and the shipped sets
take the category Spec-Bench's file gives their counterpart (`SHIPPED_CATEGORIES`); HumanEval has none there and keeps
a column of its own, `code`. Records and answer files keep those categories, so Spec-Bench's speed.py reads them.
"""

import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

from selfspec.data.formats import Prompt
from selfspec.data.prompt_sets import MT_BENCH_CATEGORIES, SPEC_BENCH_TASKS, load_prompt_set
from selfspec.decoding.strategies import REGISTRY
from selfspec.errors import SelfspecError, SelfspecWarning
from selfspec.evaluation.spec_bench import speedup_cell
from selfspec.records.prompt_records import PromptRecord, summarize
from selfspec.settings import DataSettings

T = TypeVar("T")
FIELD = "field"  # strategies=[field]: plain and every strategy that builds from the model alone
SHIPPED_CATEGORIES = {  # shipped set -> the category of its Spec-Bench counterpart; None: its prompts' own
    "chat": None,  # single-turn requests in MT-bench's eight categories: Multi-turn Conversation's column
    "translate": "translation", "summarize": "summarization", "qa": "qa", "math": "math_reasoning",
    "retrieval": "rag",
    "humaneval": "code"}  # no counterpart in Spec-Bench: a column of its own


def field_strategies(build: Callable[[str], T]) -> list[T]:
    """Plain decoding, then every non-HF registered strategy that `build(name)` makes; one that raises
    SelfspecError (it needs a part the run has not got) is left out with a warning line."""
    built = []
    for spec in REGISTRY.values():
        if spec.hf_baseline:
            continue
        try:
            built.append(build(spec.name))
        except SelfspecError as err:
            warnings.warn(f"experiment=field leaves out {spec.name}: {str(err).splitlines()[0]}", SelfspecWarning)
    return built


def field_prompts(data: DataSettings) -> list[Prompt]:
    """The prompts of `data` (load_prompt_set), set by set, a shipped set's under its SHIPPED_CATEGORIES."""
    return [replace(p, category=SHIPPED_CATEGORIES.get(name) or p.category)
            for name in data.names for p in load_prompt_set(replace(data, name=name))]


def by_task_type(records: list[PromptRecord]) -> list[PromptRecord]:
    """The records, each under its Spec-Bench task type: MT-bench's categories are its mt_bench."""
    return [replace(r, category="mt_bench") if r.category in MT_BENCH_CATEGORIES else r for r in records]


def lossless_mark(name: str, row: dict, greedy: bool) -> str:
    """Whether a strategy's outputs were all plain decoding's, from the run's own check of every record."""
    matched = row.get("outputs_match_plain")
    if name == "plain" or matched is None:
        return "reference"
    if not greedy:
        return "sampled, distribution-checked by tests"
    equal = round(matched * row["n_turns"])
    return f"{'yes' if matched == 1 else 'no'} ({equal}/{row['n_turns']} equal plain's)"


def field_table(records: list[PromptRecord], greedy: bool) -> str:
    """Spec-Bench's leaderboard of a run's records: a row per method, its speedup over plain decoding per task type
    (its six columns, then any other category), mean accepted tokens, overall speedup and lossless mark."""
    summary = summarize(by_task_type(records))
    categories = {task for row in summary.values() for task in row["by_category"]}
    others = sorted(categories - set(SPEC_BENCH_TASKS))
    columns = [*SPEC_BENCH_TASKS.values(), *(f"{c} (not in Spec-Bench)" for c in others),
               "#Mean Accepted Tokens", "Overall", "Lossless"]
    lines = ["| method | " + " | ".join(columns) + " |", "|---" + "|:---:" * len(columns) + "|"]
    for name, row in summary.items():
        cells = [speedup_cell(row["by_category"].get(task)) for task in [*SPEC_BENCH_TASKS, *others]]
        cells += [f"{row['mean_accepted_tokens']:.2f}", speedup_cell(row), lossless_mark(name, row, greedy)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
