"""Per-prompt records (JSON lines, appended as they finish) and the per-strategy summary."""

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path


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
    gated_steps: int = 0  # verifications that did not draft because of draft.target_gate
    peak_mem_mb: float | None = None  # peak memory growth during generate, MiB, max over repeats (CPU: peak RSS)
    output_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    steps: list[dict] = field(default_factory=list)  # StepRecord fields, one per verification


def append_record(path: Path, record: PromptRecord) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(asdict(record)) + "\n")


def read_records(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summarize(records: list[dict]) -> dict:
    """Per strategy (keys of summary.json): tokens_per_s, speedup, acceptance_rate, mean_accepted_tokens,
    outputs_match_plain, n_prompts, new_tokens; plus the same per prompt category under `by_category`."""
    summary = {}
    for name in dict.fromkeys(r["strategy"] for r in records):
        mine = [r for r in records if r["strategy"] == name]
        summary[name] = _aggregate(mine, [r for r in records if r["strategy"] == "plain"])
        summary[name]["by_category"] = {
            cat: _aggregate([r for r in mine if r["category"] == cat],
                            [r for r in records if r["strategy"] == "plain" and r["category"] == cat])
            for cat in dict.fromkeys(r["category"] for r in mine)}
    return summary


def _aggregate(mine: list[dict], plain: list[dict]) -> dict:
    tokens = sum(r["new_tokens"] for r in mine)
    tokens_per_s = tokens / sum(r["elapsed_s"] for r in mine)
    plain_tps = sum(r["new_tokens"] for r in plain) / sum(r["elapsed_s"] for r in plain) if plain else None
    drafted = sum(r["drafted"] for r in mine)
    matches = [r["matches_plain"] for r in mine if r["matches_plain"] is not None]
    return {
        "tokens_per_s": tokens_per_s,
        "speedup": tokens_per_s / plain_tps if plain_tps else None,
        "acceptance_rate": sum(r["accepted"] for r in mine) / drafted if drafted else None,
        "mean_accepted_tokens": sum(r["emitted"] for r in mine) / max(1, sum(r["verify_steps"] for r in mine)),
        "outputs_match_plain": sum(matches) / len(matches) if matches else None,
        "n_prompts": len(mine),
        "new_tokens": tokens,
        "peak_mem_mb": max((r["peak_mem_mb"] for r in mine if r.get("peak_mem_mb") is not None), default=None),
        "median_prompt_speedup": statistics.median(s) if (s := [r["speedup"] for r in mine
                                                                 if r["speedup"] is not None]) else None,
    }


def markdown_table(summary: dict) -> str:
    columns = ["tokens_per_s", "speedup", "acceptance_rate", "mean_accepted_tokens", "outputs_match_plain",
               "n_prompts", "new_tokens", "peak_mem_mb"]
    lines = ["| strategy | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, row in summary.items():
        lines.append(f"| {name} | " + " | ".join(_fmt(row.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)
