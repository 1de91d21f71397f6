"""The copiers replayed over plain decoding's greedy outputs: the tokens per verification the cost-aware copiers
reach on them and the speedup modelled with this machine's c(q), per category, free of the noise of a timed run
(identical steps vary from prompt to prompt within a run). It tunes the copy settings (`draft.ngram_size`,
`tree_nodes`, `tree_depth`, `tree_width`) on the calibration halves:

    make bench LIMIT=10 OUT=<dir> ARGS="repeats=1 data.split=calibration 'strategies=[plain]'"
    python experiments/copy_replay.py <dir> data.split=calibration data.limit=10 \
        -- draft.ngram_size=2 draft.tree_depth=5 -- draft.ngram_size=3 draft.tree_depth=10

The overrides before the first `--` are every variant's and must select the prompts the records hold (`data.*`,
`model=`); each `--` starts a variant (none: the defaults). c(q) is measured once, so the variants are compared at the
same costs: the policies' choices follow c(q), and the meter's readings move from run to run. The copiers are
`prompt_lookup_tree`'s trie and `self_spec_hybrid`'s chain copier, built as those strategies build them. Each step
is verified as greedy verification does (the draft's longest path equal to plain decoding's next tokens) and updates
the copier as the loop does; the loop's own costs (`observe_verify_ms`) are not followed, so the modelled speedup
reads above a live run's: compare variants by it, not runs. Steps without a copy are plain steps (the hybrid's model
draft is not replayed).
"""

import collections
import json
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from selfspec.data.formats import Prompt
from selfspec.data.prompt_sets import encode_prompt, load_prompt_set
from selfspec.decoding.costs import CostMeter
from selfspec.decoding.drafters import Draft, GenerationContext
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.strategies import make_strategy
from selfspec.decoding.tree import tree_paths
from selfspec.models.attention_masks import chain
from selfspec.models.layouts import num_layers
from selfspec.models.loading import load_model
from selfspec.models.skip_config import resolve_skip
from selfspec.settings import from_config


def replay(drafter, context: GenerationContext, prompt: list[int], output: list[int]) -> list[tuple[int, int]]:
    """(tokens emitted, draft nodes verified) per verification of decoding `output` after `prompt` with `drafter`,
    drafting as far as the loop would (max_new_tokens) where the output ended sooner; the first output token is the
    prefill's. Greedy verification keeps the draft's longest path equal to the output's next tokens."""
    drafter.begin(context)
    steps, done = [], 1
    while done < len(output):
        most = min(drafter.max_tokens, context.settings.max_new_tokens - done - 1)
        draft = drafter.draft(prompt + output[:done], most) if most > 0 else Draft()
        paths = tree_paths(draft.parents if draft.parents is not None else chain(len(draft.tokens)))
        path = max((path for path in paths if [draft.tokens[i] for i in path] == output[done:done + len(path)]),
                   key=len)
        if draft.tokens and draft.parents is not None:
            drafter.update(max(map(len, paths)), len(path), path, draft.source)
        elif draft.tokens:
            drafter.update(len(draft.tokens), len(path), source=draft.source)
        steps.append((min(len(path) + 1, len(output) - done), len(draft.tokens)))
        done += steps[-1][0]
    return steps


def plain_rows(records: Path, prompts: dict[str, Prompt], selected_by: list[str]) -> list[dict]:
    """The rows of records/records.jsonl that decoded the first turn of `prompts` plainly (the overrides
    `selected_by` chose them); exits in one line where the file is missing or holds none."""
    if not (records / "records.jsonl").is_file():
        sys.exit(f"{records}/records.jsonl does not exist: give the folder of a run that decoded plain (make bench "
                 f"OUT=<dir> ARGS=\"'strategies=[plain]'\")")
    plain = [row for row in map(json.loads, (records / "records.jsonl").open())
             if row["strategy"] == "plain" and row["question_id"] in prompts and row["turn"] == 0]
    if not plain:
        sys.exit(f"{records}/records.jsonl holds no plain decoding of the prompts {selected_by} select")
    return plain


def main(records: Path, overrides: list[str]) -> None:
    chunks = [[]]  # the common overrides, then one list a variant
    for argument in overrides:
        if argument == "--":
            chunks.append([])
        else:
            chunks[-1].append(argument)
    common, variants = chunks[0], chunks[1:] or [[]]
    with initialize_config_dir(str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        settings = [from_config(compose("config", overrides=["data=mix", *common, *variant])) for variant in variants]
    prompts = {prompt.question_id: prompt for prompt in load_prompt_set(settings[0].data)}
    plain = plain_rows(records, prompts, common)
    loaded = load_model(settings[0].model)
    skip, _ = resolve_skip(settings[0].skip, num_layers(loaded.model))
    meter = CostMeter(loaded.model, max(max(s.draft.max_tokens, s.draft.ngram_tokens, s.draft.tree_nodes)
                                        for s in settings) + 1)
    verify_ms = meter.costs(None).verify_ms
    print(meter.summary())
    context = GenerationContext(None, settings[0].sampling, end_ids=loaded.end_ids)  # copiers read no cache
    categories = ["all", *sorted({row["category"] for row in plain})]
    print(f"{len(plain)} prompts; per copier and category: modelled speedup (tokens per verification)\n")
    print("| variant | copier | " + " | ".join(categories) + " |\n|---|---|" + "---|" * len(categories))
    for variant, setting in zip(variants, settings):
        copiers = {name: make_strategy(name, loaded.model,
                                       GenerationOptions(setting.sampling, end_ids=loaded.end_ids), skip=skip,
                                       draft=setting.draft, costs=meter).drafter for name in ("prompt_lookup_tree", "self_spec_hybrid")}
        copiers["self_spec_hybrid"] = copiers["self_spec_hybrid"].ngram  # its copies alone
        for name, drafter in copiers.items():
            totals = collections.defaultdict(lambda: [0, 0, 0.0])  # category: emitted, verifications, verify ms
            for row in plain:
                steps = replay(drafter, context, encode_prompt(loaded.tokenizer, prompts[row["question_id"]]),
                               row["output_ids"])
                for category in ("all", row["category"]):
                    totals[category][0] += sum(emitted for emitted, _ in steps)
                    totals[category][1] += len(steps)
                    totals[category][2] += sum(verify_ms[nodes] for _, nodes in steps)
            cells = [f"{emitted * verify_ms[0] / ms:.3f} ({emitted / steps:.2f})"
                     for emitted, steps, ms in (totals[category] for category in categories)]
            label = " ".join(variant) or "defaults"
            print(f"| {label} | `{name}` | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(Path(sys.argv[1]), sys.argv[2:])
