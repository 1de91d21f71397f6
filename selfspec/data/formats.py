"""What a prompt is, and the public record formats it is read from: FastChat/Spec-Bench/MT-bench questions,
ShareGPT conversations, Alpaca instructions, GSM8K questions, HumanEval problems and bare `{"prompt": ...}`.

A file's format is the first in FORMATS whose fields its first record has (`data.format=auto`), or the one named.
Unknown fields are ignored; a record's id is its format's id field when present, else its line (or item) number.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass

from selfspec.errors import SelfspecError

DEFAULT_CATEGORY = "default"  # for question files whose records carry no category
HUMAN_ROLES = ("human", "user")  # ShareGPT's `from` values of the user's turns


@dataclass(frozen=True)
class Prompt:
    """One benchmark request.

    turns: the user turns, all kept (multi-turn decoding reads the later ones). chat: wrap a turn in the tokenizer's
    chat template when it has one (False = raw completion-style text). reference: an optional reference answer for
    the first turn.
    """
    question_id: str
    category: str
    turns: tuple[str, ...]
    chat: bool
    reference: str | None = None

    def __post_init__(self):
        if not isinstance(self.question_id, str) or not self.question_id.strip():
            raise SelfspecError(f"question_id must be a non-empty string, got {short(self.question_id)}")
        if not isinstance(self.category, str):
            raise SelfspecError(f"prompt {self.question_id!r}: category must be a string, got {short(self.category)}")
        if not isinstance(self.turns, tuple) or not self.turns:
            raise SelfspecError(f"prompt {self.question_id!r}: turns must be a non-empty list of strings, "
                                f"got {short(self.turns)}")
        for index, turn in enumerate(self.turns):
            if not isinstance(turn, str) or not turn.strip():
                raise SelfspecError(f"prompt {self.question_id!r}: turn {index} is {short(turn)}; "
                                    f"every turn must be non-empty text")


@dataclass(frozen=True)
class PromptFormat:
    """A record format: the fields that identify it, how its user turns are read, and where its id and reference
    answer live."""
    name: str
    fields: tuple[str, ...]  # every record of this format has these
    turns: Callable[[dict], list]  # the user turns of a record (checked by Prompt)
    id_field: str  # optional in the record: the line number stands in
    reference_field: str | None
    category: str  # when the record has no `category`
    chat: bool = True


def _field_turns(field: str) -> Callable[[dict], list]:
    return lambda record: [record[field]]


def _question_turns(record: dict) -> list:
    turns = record["turns"]
    if not isinstance(turns, list) or not turns:
        raise SelfspecError(f"turns must be a non-empty list of strings, got {short(turns)}")
    return turns


def _alpaca_turns(record: dict) -> list:
    """The instruction, then its input (if any) after a blank line, as Alpaca's own prompt puts them."""
    instruction, given = record["instruction"], record.get("input")
    if given is not None and not isinstance(given, str):
        raise SelfspecError(f"input must be text or absent, got {short(given)}")
    if not isinstance(instruction, str) or not given or not given.strip():
        return [instruction]
    return [f"{instruction}\n\n{given}"]


def _human_turns(record: dict) -> list:
    """The human turns of a ShareGPT conversation in order (the model answers them itself)."""
    conversation = record["conversations"]
    if not isinstance(conversation, list) or not all(isinstance(m, dict) for m in conversation):
        raise SelfspecError(f"conversations must be a list of {{from, value}} objects, got {short(conversation)}")
    turns = [m.get("value") for m in conversation if m.get("from") in HUMAN_ROLES]
    if not turns:
        raise SelfspecError(f"conversations has no turn from {' or '.join(HUMAN_ROLES)}: {short(conversation)}")
    return turns


FORMATS = {f.name: f for f in (  # detection order: the first whose fields a record has
    PromptFormat("fastchat", ("turns",), _question_turns, "question_id", "reference", DEFAULT_CATEGORY),
    PromptFormat("sharegpt", ("conversations",), _human_turns, "id", None, "sharegpt"),
    PromptFormat("alpaca", ("instruction",), _alpaca_turns, "id", "output", "alpaca"),
    PromptFormat("gsm8k", ("question",), _field_turns("question"), "id", "answer", "gsm8k"),
    PromptFormat("humaneval", ("task_id", "prompt"), _field_turns("prompt"), "task_id", "canonical_solution",
                 "humaneval", chat=False),
    PromptFormat("prompt", ("prompt",), _field_turns("prompt"), "id", None, DEFAULT_CATEGORY),
)}


def detect_format(record) -> PromptFormat:
    """The first format whose fields `record` has; SelfspecError naming the fields found when none fits."""
    if isinstance(record, dict):
        for fmt in FORMATS.values():
            if all(name in record for name in fmt.fields):
                return fmt
    raise SelfspecError(f"no prompt format fits {_found(record)}; expected one of: {_expected()}")


def record_prompt(record, fmt: PromptFormat, number: int) -> Prompt:
    """One record of format `fmt` as a Prompt; `number` (its line or item number) is the id when it has none."""
    missing = [name for name in fmt.fields if not isinstance(record, dict) or name not in record]
    if missing:
        raise SelfspecError(f"format {fmt.name} needs {', '.join(missing)}; found {_found(record)}")
    question_id = record.get(fmt.id_field, number)
    if isinstance(question_id, bool) or not isinstance(question_id, (str, int)):
        raise SelfspecError(f"{fmt.id_field} must be a string or an integer, got {short(question_id)}")
    return Prompt(question_id=str(question_id), category=record.get("category", fmt.category),
                  turns=tuple(fmt.turns(record)), chat=fmt.chat,
                  reference=_reference(record.get(fmt.reference_field) if fmt.reference_field else None))


def parse_json(text: str):
    """A JSON value; SelfspecError for anything json refuses (bad syntax, a number too long, nesting too deep)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise SelfspecError(f"invalid JSON ({err.msg}, line {err.lineno} column {err.colno}): {short(text)}") from None
    except (ValueError, RecursionError) as err:
        raise SelfspecError(f"invalid JSON ({short(str(err), 60)}): {short(text)}") from None


def parse_prompt_line(line: str, format_name: str = "auto", number: int = 1) -> Prompt:
    """One JSON line as a Prompt, in the format named (or detected): a Prompt or one SelfspecError line."""
    record = parse_json(line)
    fmt = detect_format(record) if format_name == "auto" else FORMATS[format_name]
    return record_prompt(record, fmt, number)


def _reference(value) -> str | None:
    """A reference answer is never decoded: a string, or the first string of a per-turn list (MT-bench), is kept;
    any other JSON (Spec-Bench's lists of lists for retrieval) is dropped."""
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, str) else None


def _found(record) -> str:
    if isinstance(record, dict):
        return f"fields {short(sorted(record))}"
    return f"{type(record).__name__} {short(record)} (a record is a JSON object)"


def _expected() -> str:
    return "; ".join(f"{fmt.name} {{{', '.join(fmt.fields)}}}" for fmt in FORMATS.values())


def short(value, width: int = 80) -> str:
    """repr of a value, cut to `width` characters, so error messages stay on one line."""
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."
