"""Aggregate tokens/s against batch size, every batch size in one process: the batch targets' ratios (plain
decoding at batch 4 over batch 1; each strategy over plain decoding at the same batch size) measured side by side,
so the machine's drift between the jobs of `python run.py -m experiment=batch` does not enter them.

    python experiments/batch_throughput.py [hydra overrides, e.g. 'strategies=[plain,self_spec_tree]' repeats=2]

The prompts are experiment=batch's (the mix's evaluation halves, 2 a set, 14 prompts; `data.limit`, `sampling.*`
override them). Per repeat, each batch size in turn, each strategy decodes all prompts (the strategies in reverse
order every other repeat): batch size 1 one prompt at a time, above it `batch_size` rows refilled as rows end
(decoding/batch.py), and plain decoding also in fixed batches that wait for their longest row (`plain, fixed
batches`). Every output must equal plain decoding's at batch size 1 (greedy settings). Prints the median over repeats.
"""

import statistics
import sys
from dataclasses import replace
from pathlib import Path

from hydra import compose, initialize_config_dir

from selfspec.data.prompt_sets import encode_prompt, load_prompt_set
from selfspec.decoding.batch import generate_batch
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.results import GenerationResult
from selfspec.decoding.strategies import Strategy, cost_meter, make_strategy
from selfspec.evaluation.task import DraftVocabularies
from selfspec.models.devices import output_device
from selfspec.models.layouts import num_layers
from selfspec.models.loading import load_model
from selfspec.models.skip_config import resolve_skip
from selfspec.settings import from_config
from selfspec.timing import clock

BATCH_SIZES = (1, 2, 4, 8)
FIXED = "plain, fixed batches"


def decode(strategy: Strategy, prompts: list[list[int]], batch_size: int,
           fixed: bool = False) -> list[GenerationResult]:
    if batch_size == 1:
        return [strategy.generate(ids) for ids in prompts]
    if fixed:
        return [r for first in range(0, len(prompts), batch_size)
                for r in generate_batch(strategy.model, prompts[first:first + batch_size], strategy.options)]
    return strategy.generate_batch(prompts, batch_size=batch_size)


def tokens_per_verification(results: list[GenerationResult]) -> float:
    return sum(step.emitted for r in results for step in r.steps) / sum(len(r.steps) for r in results)


def main(overrides: list[str]) -> None:
    with initialize_config_dir(str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        settings = from_config(compose("config", overrides=[
            "data=mix", "data.split=evaluation", "data.limit=2", "sampling.max_new_tokens=96",
            "strategies=[plain,self_spec_cost,self_spec_hybrid,self_spec_tree]", *overrides]))
    loaded = load_model(settings.model)
    skip, _ = resolve_skip(settings.skip, num_layers(loaded.model))
    costs = cost_meter(loaded.model, settings.draft)
    draft_vocabulary = DraftVocabularies(loaded)(settings.draft.vocab_size)  # as run.py drafts
    strategies = {name: make_strategy(name, loaded.model,
                                      GenerationOptions(settings.sampling, end_ids=loaded.end_ids),
                                      skip=skip, draft=settings.draft, draft_vocabulary=draft_vocabulary, costs=costs)
                  for name in dict.fromkeys(["plain", *settings.strategies])}
    prompts = [encode_prompt(loaded.tokenizer, p) for p in load_prompt_set(settings.data)]
    warm_up = [ids[:32] for ids in prompts[:max(BATCH_SIZES)]]
    for strategy in strategies.values():  # allocator, kernels, and each batch size's measured verify costs
        for batch_size in BATCH_SIZES:
            short = replace(strategy.options, sampling=replace(strategy.options.sampling, max_new_tokens=8))
            decode(replace(strategy, options=short), warm_up, batch_size)
    print(f"{loaded.name}: {len(prompts)} prompts, {settings.sampling.max_new_tokens} new tokens, "
          f"{settings.repeats} repeat(s)", flush=True)
    expected = None
    speeds: dict[tuple[str, int], list[float]] = {}
    device = output_device(loaded.model)
    for repeat in range(settings.repeats):
        for batch_size in BATCH_SIZES:
            runs = [(name, name, False) for name in strategies] + ([(FIXED, "plain", True)] if batch_size > 1 else [])
            for label, name, fixed in runs[::-1] if repeat % 2 else runs:  # a drift in time hits no one place
                start = clock(device)
                results = decode(strategies[name], prompts, batch_size, fixed)
                seconds = clock(device) - start
                outputs = [r.new_tokens for r in results]
                expected = expected or outputs
                if settings.sampling.greedy and outputs != expected:
                    raise AssertionError(f"{label} at batch size {batch_size} differs from plain decoding")
                speeds.setdefault((label, batch_size), []).append(sum(map(len, outputs)) / seconds)
                print(f"batch size {batch_size}, {label}: {speeds[label, batch_size][-1]:.1f} tokens/s, "
                      f"{tokens_per_verification(results):.2f} tokens per verification", flush=True)
    median = {key: statistics.median(values) for key, values in speeds.items()}
    labels = [*strategies, FIXED]
    print("aggregate tokens/s; in brackets over plain decoding at the same batch size, and plain's over batch 1")
    print("| batch size | " + " | ".join(labels) + " |\n" + "|---" * (len(labels) + 1) + "|")
    for batch_size in BATCH_SIZES:
        plain = median["plain", batch_size]
        cells = [f"{plain:.1f} ({plain / median['plain', 1]:.2f} of batch 1)"]
        cells += [f"{median[label, batch_size]:.1f} ({median[label, batch_size] / plain:.2f})"
                  if (label, batch_size) in median else "-" for label in labels[1:]]
        print(f"| {batch_size} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
