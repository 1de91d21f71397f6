"""What banned words cost when they never complete: tokens/s with 100 banned words against none, same prompts.

    python experiments/banned_words_overhead.py [hydra overrides, e.g. model=gemma3_270m data.limit=2]

Each prompt is decoded by each strategy (the config's `strategies`) without and with 100 words that the model does not
write (so both decode the same tokens, which the script checks), interleaved, after one untimed warm-up each. The
difference is the watch's work: decoding each new token's text, the automaton over it, and the look-ahead over drafts
(decoding/text_rules.py). Prints tokens/s and the ratio per strategy.
"""

import random
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from selfspec.data.prompt_sets import encode_prompt, load_prompt_set
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.strategies import cost_meter, make_strategy
from selfspec.decoding.text_rules import text_rules
from selfspec.models.layouts import num_layers
from selfspec.models.loading import load_model
from selfspec.models.skip_config import resolve_skip
from selfspec.settings import from_config

WORDS = 100


def unlikely_words(count: int, seed: int = 0) -> list[str]:
    """`count` made-up words (a rare pair of letters, then four more) that no model writes unprompted."""
    letters = random.Random(seed)
    return ["qx" + "".join(letters.choice("bcdfghjkz") for _ in range(4)) for _ in range(count)]


def main(overrides: list[str]) -> None:
    with initialize_config_dir(str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        settings = from_config(compose("config", overrides=["data=mix", "data.limit=1", *overrides]))
    loaded = load_model(settings.model)
    skip, _ = resolve_skip(settings.skip, num_layers(loaded.model))
    rules = text_rules(loaded.model, loaded.tokenizer, unlikely_words(WORDS))
    costs = cost_meter(loaded.model, settings.draft)
    prompts = [encode_prompt(loaded.tokenizer, p) for p in load_prompt_set(settings.data)]
    print(f"{loaded.name}: {len(prompts)} prompts, {settings.sampling.max_new_tokens} new tokens, {WORDS} banned words")
    print("| strategy | tokens/s, no banned words | tokens/s, 100 banned words | ratio |\n|---|---|---|---|")
    for name in settings.strategies:
        pair = [make_strategy(name, loaded.model,
                              GenerationOptions(settings.sampling, end_ids=loaded.end_ids, rules=with_rules),
                              skip=skip, draft=settings.draft, costs=costs) for with_rules in (None, rules)]
        for strategy in pair:
            strategy.generate(prompts[0][:32])  # warm-up
        tokens, seconds = [0, 0], [0.0, 0.0]
        for ids in prompts:
            outputs = []
            for i, strategy in enumerate(pair):
                result = strategy.generate(ids, torch.Generator().manual_seed(0))
                tokens[i], seconds[i] = tokens[i] + len(result.new_tokens), seconds[i] + result.elapsed_s
                outputs.append(result.new_tokens)
            assert outputs[0] == outputs[1], "a banned word completed: pick rarer words"
        speed = [t / s for t, s in zip(tokens, seconds)]
        print(f"| {name} | {speed[0]:.2f} | {speed[1]:.2f} | {speed[1] / speed[0]:.3f} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
