"""`python -m selfspec.summarize <run dir>`: summary.json and summary.md rebuilt from the run's records.jsonl, for any
run, finished or not (a killed run's records are whole lines; a torn last line is skipped with a warning)."""

import argparse
import json
import sys
from pathlib import Path

from selfspec.errors import SelfspecError, print_warnings_as_lines
from selfspec.evaluation.spec_bench import leaderboard_table
from selfspec.records.prompt_records import category_table, markdown_table, read_records, summarize, verdict
from selfspec.records.run_dir import RECORDS_FILE, SETTINGS_FILE, write_file
from selfspec.records.runs import sampling_label


def write_summary(out_dir: Path, summary: dict, title: str) -> str:
    """Write summary.json and summary.md (`title`, then the table, its verdict and, for prompts of several
    categories, the speedups per category: Spec-Bench's leaderboard columns for its six task types) into out_dir;
    returns what summary.md holds after the title."""
    table = f"{markdown_table(summary)}\n\n{verdict(summary)}".strip()
    if leaderboard := leaderboard_table(summary):
        table += f"\n\nSpeedup over plain decoding per Spec-Bench task type, as its leaderboard:\n\n{leaderboard}"
    elif by_category := category_table(summary):
        table += f"\n\nSpeedup over plain decoding per prompt category (tokens per verification):\n\n{by_category}"
    write_file(out_dir / "summary.json", json.dumps(summary, indent=2))
    write_file(out_dir / "summary.md", f"{title}\n\n{table}\n")
    return table


def summary_title(model: str, n_prompts: int, settings: dict) -> str:
    """`<model>, <n> prompts, <sampling>` from the run's settings (as settings.json holds them)."""
    return f"{model}, {n_prompts} prompts, {sampling_label(settings)}"


def summarize_run(run_dir: Path) -> str:
    """Rebuild run_dir's summary files from its records; returns the table."""
    records_path = run_dir / RECORDS_FILE
    if not records_path.is_file():
        raise SelfspecError(f"{run_dir}: no {RECORDS_FILE}; give the folder of a run (its hydra.run.dir)")
    records = read_records(records_path)
    if not records:
        raise SelfspecError(f"{records_path} holds no records yet; nothing to summarize")
    settings_path = run_dir / SETTINGS_FILE
    try:
        settings = json.loads(settings_path.read_text()) if settings_path.is_file() else {}
    except json.JSONDecodeError as err:
        raise SelfspecError(f"{settings_path} is not JSON ({err.msg})") from None
    model = (settings.get("model") or {}).get("name", run_dir.name)
    title = summary_title(model, len({r.question_id for r in records}), settings)
    return write_summary(run_dir, summarize(records), title)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m selfspec.summarize", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a run's output folder (holds records.jsonl)")
    args = parser.parse_args(argv)
    print_warnings_as_lines()
    try:
        print(summarize_run(args.run_dir))
    except SelfspecError as error:
        print(f"selfspec: error: {str(error).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
