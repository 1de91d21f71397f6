"""Per-prompt records (JSON lines, appended as they finish), read back typed, and the per-strategy summary."""

import dataclasses
import json
import statistics
import types
import typing
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from selfspec.decoding.results import RecordedStep, StepRecord
from selfspec.errors import SelfspecError, SelfspecWarning
from selfspec.records.run_dir import append_line, is_torn

T = typing.TypeVar("T")


@dataclass
class SkipSetRecord:
    """A skip set a skip strategy drafted with (skip_strategy), from the verification `step` of its generation on."""
    step: int
    attn: list[int]
    mlp: list[int]


def skip_set_at(sets: list[SkipSetRecord], step: int) -> SkipSetRecord | None:
    """The set in force at verification `step` (0-based): the last to start at or before it."""
    started = [each for each in sets if each.step <= step]
    return started[-1] if started else None


@dataclass
class PromptRecord:
    strategy: str
    question_id: str
    category: str
    prompt_tokens: int
    new_tokens: int
    elapsed_s: float  # median over repeats
    tokens_per_s: float
    drafted: int
    accepted: int
    verify_steps: int
    emitted: int  # tokens emitted by verification steps (all but the prefill's token)
    acceptance_rate: float | None
    mean_accepted_tokens: float | None
    speedup: float | None  # tokens/s over plain decoding of the same prompt in this run
    matches_plain: bool | None
    first_difference: int | None = None  # index of the first output token that differs from plain's; None: equal
    turn: int = 0  # which turn of the prompt (data.turns=all records every turn; 0: the first)
    gated_steps: int = 0  # verifications that did not draft because of draft.target_gate
    rollbacks: int = 0  # times a banned word completed and decoding rolled back (constraints.banned_words)
    finish_reason: str = ""  # "stop" (an end id or a stop string) | "length" (max_new_tokens); "": not recorded
    peak_mem_mb: float | None = None  # peak memory growth during generate, MiB, max over repeats (CPU: peak RSS);
    # with batch_size > 1 the whole batch's
    batch_size: int = 1  # rows of the batch it was decoded in (run.py batch_size; fewer where fewer prompts were left)
    batch_neighbours: list[str] = field(default_factory=list)  # the question ids in the batch while it was
    batch_group: list[str] = field(default_factory=list)  # the question ids the batch decoded, one after another as
    # rows ended (evaluate.GROUP_BATCHES); []: not recorded, the batch is it and its neighbours
    batch_elapsed_s: float | None = None  # the group's wall time, median over repeats (elapsed_s: this row's)
    output_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    steps: list[RecordedStep] = field(default_factory=list)  # one per verification (written: every StepRecord field)
    skip_sets: list[SkipSetRecord] = field(default_factory=list)  # skip strategies that choose while decoding: each
    # set and the verification it drafted from (the last timed run's; batch_size 1); []: a fixed skip set or none


@dataclass
class WrittenRecord(PromptRecord):
    """A record as evaluate() writes it, read back whole: its steps keep every StepRecord field (draft source,
    timings), as a resumed run needs them."""
    steps: list[StepRecord] = field(default_factory=list)


def append_record(path: Path, record: PromptRecord) -> None:
    """One whole line (run_dir.append_line): a kill never leaves part of a record."""
    append_line(path, json.dumps(asdict(record)))


def first_difference(output: list[int], reference: list[int]) -> int | None:
    """Index of the first token where `output` and `reference` differ (one ending early counts); None if equal."""
    if output == reference:
        return None
    return next((i for i, (a, b) in enumerate(zip(output, reference)) if a != b), min(len(output), len(reference)))


def read_jsonl(path: str | Path, row_type: type[T] = dict) -> list[T]:
    """The rows of a JSON-lines file, blank lines skipped, each a `row_type` (a dataclass, or dict as written). A
    line that is not JSON, misses a field or has one of the wrong type raises one SelfspecError naming file:line
    and the field; keys the dataclass lacks are ignored (records carry more than the figures read). A torn last
    line (no newline and not JSON: a crash mid-write) is skipped with a warning."""
    rows = []
    text = Path(path).read_text()
    lines = text.splitlines()
    if is_torn(text):
        warnings.warn(f"{path}:{len(lines)}: skipped a torn last line (an interrupted write)", SelfspecWarning)
        lines.pop()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise SelfspecError(f"{path}:{number}: not a JSON line ({err.msg})") from None
        rows.append(row if row_type is dict else _typed_row(row_type, row, f"{path}:{number}"))
    return rows


def read_records(path: str | Path, row_type: type[PromptRecord] = PromptRecord) -> list[PromptRecord]:
    """The records of a records.jsonl, typed (WrittenRecord: with every step field)."""
    return read_jsonl(path, row_type)


def _typed_row(row_type: type[T], row, where: str) -> T:
    """A JSON object as a `row_type` dataclass; SelfspecError naming `where` and the first bad field."""
    if not isinstance(row, dict):
        raise SelfspecError(f"{where}: {type(row).__name__} is not a JSON object")
    hints = typing.get_type_hints(row_type)
    values = {}
    for each in dataclasses.fields(row_type):
        if each.name in row:
            values[each.name] = _typed_value(hints[each.name], row[each.name], f"{where}: field {each.name!r}")
        elif each.default is dataclasses.MISSING and each.default_factory is dataclasses.MISSING:
            raise SelfspecError(f"{where}: field {each.name!r} is missing")
    try:
        return row_type(**values)
    except SelfspecError as err:  # a check across fields in the dataclass's __post_init__
        raise SelfspecError(f"{where}: {err}") from None


_JSON_TYPES = {int: "an integer", float: "a number", str: "text", bool: "true or false", dict: "an object"}


def _typed_value(kind, value, where: str):
    """`value` checked against the type hint `kind` (int, float, str, bool, dict, list[...], X | None, a dataclass);
    dataclasses (also in lists) are built, everything else returned as it is."""
    options = typing.get_args(kind) if typing.get_origin(kind) in (typing.Union, types.UnionType) else (kind,)
    if value is None and type(None) in options:
        return None
    (kind,) = [option for option in options if option is not type(None)]
    if dataclasses.is_dataclass(kind):
        return _typed_row(kind, value, where)
    if typing.get_origin(kind) is list:
        if not isinstance(value, list):
            raise SelfspecError(f"{where} is {value!r}, not a list")
        (item,) = typing.get_args(kind)
        return [_typed_value(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    numeric = kind is float and isinstance(value, int)
    if isinstance(value, bool) != (kind is bool) or not (isinstance(value, kind) or numeric):
        raise SelfspecError(f"{where} is {value!r}, not {_JSON_TYPES[kind]}")
    return value


def summarize(records: list[PromptRecord]) -> dict:
    """Per strategy (keys of summary.json): tokens_per_s (per prompt: its tokens over its own time),
    aggregate_tokens_per_s (all tokens over the batches' wall times: the throughput of batch_size > 1), batch_size,
    speedup, acceptance_rate, mean_accepted_tokens, outputs_match_plain (fraction of records equal to plain's
    output), median_first_difference (over the records that differ: where they part), n_prompts, n_turns (records),
    new_tokens; plus the same per prompt category under `by_category`."""
    summary = {}
    for name in dict.fromkeys(r.strategy for r in records):
        mine = [r for r in records if r.strategy == name]
        summary[name] = _aggregate(mine, [r for r in records if r.strategy == "plain"])
        summary[name]["by_category"] = {
            cat: _aggregate([r for r in mine if r.category == cat],
                            [r for r in records if r.strategy == "plain" and r.category == cat])
            for cat in dict.fromkeys(r.category for r in mine)}
    return summary


def _aggregate(mine: list[PromptRecord], plain: list[PromptRecord]) -> dict:
    tokens = sum(r.new_tokens for r in mine)
    tokens_per_s = tokens / sum(r.elapsed_s for r in mine)
    plain_tps = sum(r.new_tokens for r in plain) / sum(r.elapsed_s for r in plain) if plain else None
    drafted = sum(r.drafted for r in mine)
    matches = [r.matches_plain for r in mine if r.matches_plain is not None]
    parted = [r.first_difference for r in mine if r.first_difference is not None]
    return {
        "tokens_per_s": tokens_per_s,
        "aggregate_tokens_per_s": aggregate_tokens_per_s(mine),
        "batch_size": max(r.batch_size for r in mine),
        "speedup": tokens_per_s / plain_tps if plain_tps else None,
        "acceptance_rate": sum(r.accepted for r in mine) / drafted if drafted else None,
        "mean_accepted_tokens": sum(r.emitted for r in mine) / max(1, sum(r.verify_steps for r in mine)),
        "outputs_match_plain": sum(matches) / len(matches) if matches else None,
        "median_first_difference": statistics.median(parted) if parted else None,
        "n_prompts": len({r.question_id for r in mine}),
        "n_turns": len(mine),
        "new_tokens": tokens,
        "peak_mem_mb": max((r.peak_mem_mb for r in mine if r.peak_mem_mb is not None), default=None),
        "median_prompt_speedup": statistics.median(s) if (s := [r.speedup for r in mine
                                                                 if r.speedup is not None]) else None,
    }


@dataclass
class BatchTime:
    """One batch of one strategy's records: the new tokens of all its rows and its wall time (s)."""
    new_tokens: int
    wall_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s


def batch_times(records: list[PromptRecord]) -> list[BatchTime]:
    """Each batch of one strategy's records once, in order of appearance: a batch's rows share the turn and the
    group of question ids it decoded, and each holds the group's wall time (batch_elapsed_s; a record without it: its own
    elapsed_s, a batch of one)."""
    batches: dict[tuple[int, frozenset[str]], BatchTime] = {}
    for r in records:
        group = r.batch_group or [r.question_id, *r.batch_neighbours]
        batch = batches.setdefault((r.turn, frozenset(group)), BatchTime(0, r.batch_elapsed_s or r.elapsed_s))
        batch.new_tokens += r.new_tokens
    return list(batches.values())


def aggregate_tokens_per_s(records: list[PromptRecord]) -> float:
    """All new tokens of one strategy's records over the wall times of their batches, each batch counted once: the
    throughput of decoding batch_size prompts together (tokens/s)."""
    batches = batch_times(records)
    return sum(b.new_tokens for b in batches) / sum(b.wall_s for b in batches)


def markdown_table(summary: dict) -> str:
    batched = any(row.get("batch_size", 1) > 1 for row in summary.values())
    columns = ["tokens_per_s", *(["aggregate_tokens_per_s"] if batched else []), "speedup", "acceptance_rate",
               "mean_accepted_tokens", "outputs_match_plain", "n_prompts", "new_tokens", "peak_mem_mb"]
    lines = ["| strategy | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, row in summary.items():
        lines.append(f"| {name} | " + " | ".join(_fmt(row.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def category_table(summary: dict) -> str:
    """Each strategy's speedup over plain decoding and its tokens per verification (in brackets), over all prompts and
    per prompt category (summary.json's `by_category`): where a mix gains and where it falls short. Empty for
    prompts of one category."""
    categories = list(dict.fromkeys(cat for row in summary.values() for cat in row.get("by_category", {})))
    if len(categories) < 2:
        return ""
    lines = ["| strategy | all | " + " | ".join(categories) + " |", "|---" * (len(categories) + 2) + "|"]
    for name, row in summary.items():
        cells = [row, *(row.get("by_category", {}).get(cat) for cat in categories)]
        lines.append(f"| {name} | " + " | ".join(_speed_cell(cell) for cell in cells) + " |")
    return "\n".join(lines)


def _speed_cell(row: dict | None) -> str:
    if row is None or row.get("speedup") is None:
        return "-"
    return f"{row['speedup']:.2f} ({row['mean_accepted_tokens']:.2f})"


def verdict(summary: dict) -> str:
    """One sentence under the table: which strategy was fastest and, for each strategy slower than plain decoding,
    why, in measured terms: tokens per verification step against the time of a step in plain steps."""
    timed = {name: row for name, row in summary.items() if name != "plain" and row.get("speedup")}
    if not timed:
        return ""
    best = max(timed, key=lambda name: timed[name]["speedup"])
    parts = [f"{best} was fastest at {timed[best]['speedup']:.2f}x plain decoding" if timed[best]["speedup"] >= 1
             else "plain decoding was fastest"]
    for name, row in timed.items():
        tokens = row["mean_accepted_tokens"]
        if row["speedup"] < 1 and row.get("acceptance_rate") is None:
            parts.append(f"{name} ran {row['speedup']:.2f}x without drafting")
        elif row["speedup"] < 1 and tokens:
            parts.append(f"{name} ran {row['speedup']:.2f}x: its steps emitted {tokens:.2f} tokens each but took "
                         f"{tokens / row['speedup']:.2f} plain steps' time (drafting cost more than it saved)")
    return "; ".join(parts) + "."


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)
