"""Answers in Spec-Bench's `model_answer` format (spec_bench_answers=true), so its evaluation/speed.py can read our
strategies beside other methods' answers.

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
        "category": first.category,
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
