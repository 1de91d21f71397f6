"""Answers in Spec-Bench's `model_answer` format (spec_bench_answers=true), so its evaluation/speed.py can read our
strategies beside other methods' answers, and a summary in the shape of Spec-Bench's leaderboard (data=spec_bench).

One file per strategy, `<run dir>/model_answer/<model>-<strategy>.jsonl`, one line per prompt, as Spec-Bench's
evaluation/eval.py writes them: question_id, category, answer_id, model_id, choices (one choice, index 0, with a
per-turn list each of turns, decoding_steps, new_tokens, wall_time, and the flat accept_lengths of every
verification), tstamp.
"""

import json
import time
import uuid
from pathlib import Path

from selfspec.data.conversation import answer_text
from selfspec.data.prompt_sets import SPEC_BENCH_TASKS, spec_bench_categories
from selfspec.errors import SelfspecError
from selfspec.records.prompt_records import PromptRecord
from selfspec.records.run_dir import write_file


def answer_rows(records: list[PromptRecord], tokenizer, model_id: str) -> dict[str, list[dict]]:
    """Per strategy, one answer per prompt (in record order), its turns in turn order."""
    turns: dict[str, dict[str, list[PromptRecord]]] = {}
    for record in records:
        turns.setdefault(record.strategy, {}).setdefault(record.question_id, []).append(record)
    return {strategy: [_answer(sorted(mine, key=lambda r: r.turn), tokenizer, f"{model_id}-{strategy}")
                       for mine in by_prompt.values()]
            for strategy, by_prompt in turns.items()}


def _answer(turns: list[PromptRecord], tokenizer, model_id: str) -> dict:
    first = turns[0]
    question_id = int(first.question_id) if first.question_id.isdigit() else first.question_id  # Spec-Bench: ints
    return {
        "question_id": question_id,
        "category": _question_category(first),
        "answer_id": uuid.uuid4().hex[:22],  # Spec-Bench: shortuuid.uuid(), 22 characters
        "model_id": model_id,
        "choices": [{
            "index": 0,
            "turns": [answer_text(tokenizer, r.output_ids) for r in turns],
            "decoding_steps": [r.verify_steps for r in turns],  # full-model verifications after the prefill
            "new_tokens": [r.new_tokens for r in turns],
            "wall_time": [r.elapsed_s for r in turns],  # seconds, prefill included
            "accept_lengths": [step.emitted for r in turns for step in r.steps],  # tokens per verification
        }],
        "tstamp": time.time(),
    }


def _question_category(record: PromptRecord) -> str:
    """The category Spec-Bench's question file gives: data=spec_bench records its 80 MT-bench questions under their
    task type, mt_bench, but its speed.py finds them by their MT-bench category (writing, roleplay, ...)."""
    if record.category == "mt_bench":
        return spec_bench_categories().get(record.question_id, record.category)
    return record.category


def write_answers(out_dir: Path, records: list[PromptRecord], tokenizer, model_id: str) -> list[Path]:
    """Write every strategy's answer file under out_dir/model_answer (replacing earlier ones); returns the paths."""
    folder = out_dir / "model_answer"
    try:
        folder.mkdir(exist_ok=True)
    except OSError as err:
        raise SelfspecError(f"cannot make {folder}: {err.strerror}") from None
    paths = []
    for strategy, rows in answer_rows(records, tokenizer, model_id).items():
        paths.append(folder / f"{model_id}-{strategy}.jsonl")
        write_file(paths[-1], "".join(json.dumps(row) + "\n" for row in rows))
    return paths


def leaderboard_table(summary: dict) -> str:
    """Each strategy's speedup over plain decoding per Spec-Bench task type, its mean accepted tokens (tokens per
    verification, the bonus token included: 1.00 for plain decoding) and its overall speedup, in the columns of
    Spec-Bench's Leaderboard.md; empty unless summary.json's `by_category` holds exactly the six task types."""
    if {task for row in summary.values() for task in row.get("by_category", {})} != set(SPEC_BENCH_TASKS):
        return ""
    columns = [*SPEC_BENCH_TASKS.values(), "#Mean Accepted Tokens", "Overall"]
    lines = ["| strategy | " + " | ".join(columns) + " |", "|---" + "|:---:" * len(columns) + "|"]
    for name, row in summary.items():
        speedups = [speedup_cell(row["by_category"].get(task)) for task in SPEC_BENCH_TASKS]
        lines.append(f"| {name} | " + " | ".join([*speedups, f"{row['mean_accepted_tokens']:.2f}", speedup_cell(row)])
                     + " |")
    return "\n".join(lines)


def speedup_cell(row: dict | None) -> str:
    """A leaderboard cell: a summary row's speedup over plain decoding, `-` where it has none."""
    return "-" if row is None or row.get("speedup") is None else f"{row['speedup']:.2f}x"
