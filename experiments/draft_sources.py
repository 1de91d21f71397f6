"""What decides speed on two prompt sets, side by side: for each run folder of `make bench` (records.jsonl and
settings.json), per category, the prompt length, how much of plain decoding's output a copy could supply (its
3-grams already in the prompt, or earlier in the output itself), and what each draft source of a strategy
delivered (self_spec_tree's n-gram copies, token store and model draft): the share of the output's tokens it
supplied and its accepted tokens per draft.

    make bench DATA=spec_bench LIMIT=5 OUT=<a> ARGS="repeats=1 'strategies=[plain,self_spec_tree]'"
    make bench DATA=mix LIMIT=5 OUT=<b> ARGS="repeats=1 'strategies=[plain,self_spec_tree]'"
    python experiments/draft_sources.py <a> <b> [--strategy self_spec_tree]

Only first turns are read (a second turn's prompt holds the strategy's own first answer).
"""

import argparse
import collections
import json
from pathlib import Path
from statistics import mean

from selfspec.data.prompt_sets import encode_prompt, load_prompt_set
from selfspec.models.loading import load_model
from selfspec.settings import DataSettings, ModelSettings

SOURCES = ("ngram", "store", "model")


def ngrams(ids: list[int], n: int = 3) -> set[tuple[int, ...]]:
    return {tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)}


def copy_shares(prompt: list[int], output: list[int], n: int = 3) -> tuple[float, float]:
    """The shares of `output`'s positions n-1.. whose n-gram (ending there) is in `prompt`, and that occurred earlier
    in `output` itself (repetition)."""
    in_prompt, repeated, seen = 0, 0, set()
    prompt_grams = ngrams(prompt, n)
    positions = range(n - 1, len(output))
    for i in positions:
        gram = tuple(output[i - n + 1:i + 1])
        in_prompt += gram in prompt_grams
        repeated += gram in seen
        seen.add(gram)
    return in_prompt / max(len(positions), 1), repeated / max(len(positions), 1)


def source_tally(steps: list[dict]) -> dict[str, tuple[int, int, int]]:
    """Per draft source: (drafts, tokens accepted, tokens emitted by its steps)."""
    tally = collections.defaultdict(lambda: [0, 0, 0])
    for step in steps:
        source = step["source"] or "none"
        tally[source][0] += 1
        tally[source][1] += step["accepted"]
        tally[source][2] += step["emitted"]
    return tally


def folder_rows(folder: Path, strategy: str) -> list[dict]:
    settings = json.loads((folder / "settings.json").read_text())
    data = DataSettings(**settings["data"])
    loaded = load_model(ModelSettings(**settings["model"]))
    prompts = {prompt.question_id: prompt for prompt in load_prompt_set(data)}
    records = [json.loads(line) for line in (folder / "records.jsonl").open()]
    plain = {r["question_id"]: r for r in records if r["strategy"] == "plain" and r["turn"] == 0}
    rows = []
    for record in records:
        if record["strategy"] != strategy or record["turn"] != 0 or record["question_id"] not in plain:
            continue
        prompt = encode_prompt(loaded.tokenizer, prompts[record["question_id"]])
        output = plain[record["question_id"]]["output_ids"]
        in_prompt, repeated = copy_shares(prompt, output)
        rows.append(dict(set=data.name, category=record["category"], prompt_tokens=len(prompt), in_prompt=in_prompt,
                         repeated=repeated, emitted=record["new_tokens"], steps=record["steps"],
                         elapsed_s=record["elapsed_s"], plain_s=plain[record["question_id"]]["elapsed_s"]))
    return rows


def table(rows: list[dict]) -> None:
    print("| set | category | prompts | prompt tokens | 3-grams in prompt | repeated in output | speedup | "
          + " | ".join(f"{s}: share of output, accepted per draft" for s in SOURCES) + " |")
    print("|---|---|---:|---:|---:|---:|---:|" + "---:|" * len(SOURCES))
    groups = collections.defaultdict(list)
    for row in rows:
        groups[row["set"] if isinstance(row["set"], str) else "+".join(row["set"]), row["category"]].append(row)
        groups[row["set"] if isinstance(row["set"], str) else "+".join(row["set"]), "all"].append(row)
    for (name, category), members in sorted(groups.items()):
        tally = source_tally([step for row in members for step in row["steps"]])
        emitted = sum(row["emitted"] for row in members)
        cells = []
        for source in SOURCES:
            drafts, accepted, _ = tally.get(source, (0, 0, 0))
            cells.append(f"{accepted / emitted:.0%}, {accepted / drafts:.2f}" if drafts else "-")
        print(f"| {name} | {category} | {len(members)} | {mean(r['prompt_tokens'] for r in members):.0f} | "
              f"{mean(r['in_prompt'] for r in members):.0%} | {mean(r['repeated'] for r in members):.0%} | "
              f"{sum(r['plain_s'] for r in members) / sum(r['elapsed_s'] for r in members):.2f}x | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--strategy", default="self_spec_tree")
    args = parser.parse_args()
    table([row for folder in args.folders for row in folder_rows(folder, args.strategy)])


if __name__ == "__main__":
    main()
