"""Would a store of the model's own generations draft what copying from the context cannot? (issue 27; REST's
datastore, filled with the model's own text). The store: the n-grams (n <= 4) of the continuations that
experiment=train_draft generated from the calibration prompts (read from `train.data_dir`, made there if missing).
Then plain greedy decoding of the held-out prompts, and at every position of each output, the next token as
  - copying predicts it: what followed the latest earlier occurrence of the last 1-3 tokens (prompt lookup);
  - the store predicts it: the commonest successor of the longest stored tail (seen at least twice).
Prints, per category, how often each is right where it predicts, and the store's rate where no copy exists: the
tokens a draft from the store would add to the copies. Model-free drafts cost nearly nothing, so on SmolLM2 a draft
token pays from an acceptance of about c(2)/c(1) - 1 = 0.14 at batch size 1.

    python experiments/self_ngram_store.py train.data_dir=outputs/draft_data/smollm2 [data.limit=4] [model=...]
"""

import sys
from collections import Counter, defaultdict
from pathlib import Path

from hydra import compose, initialize_config_dir

from selfspec.data.prompt_sets import encode_prompt, load_prompt_set
from selfspec.decoding.drafters.ngram import ngram_continuation
from selfspec.decoding.strategies import make_strategy
from selfspec.models.layouts import num_layers
from selfspec.models.loading import load_model
from selfspec.models.skip_config import resolve_skip
from selfspec.settings import from_config
from selfspec.training.draft_data import generate_sequences, training_prompts

ROOT = Path(__file__).resolve().parents[1]
LONGEST, MIN_SEEN = 4, 2


def build_store(sequences: list[list[int]], prompt_lengths: list[int]) -> dict[tuple[int, ...], Counter]:
    """tail (1..LONGEST tokens) -> counts of the token that followed it in a generated continuation."""
    store: dict[tuple[int, ...], Counter] = defaultdict(Counter)
    for seq, start in zip(sequences, prompt_lengths):
        for t in range(start, len(seq)):
            for n in range(1, min(LONGEST, t) + 1):
                store[tuple(seq[t - n:t])][seq[t]] += 1
    return store


def store_prediction(store: dict[tuple[int, ...], Counter], context: list[int]) -> int | None:
    for n in range(min(LONGEST, len(context)), 0, -1):
        successors = store.get(tuple(context[-n:]))
        if successors and sum(successors.values()) >= MIN_SEEN:
            return successors.most_common(1)[0][0]
    return None


def main(overrides: list[str]) -> None:
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        run = from_config(compose("config", overrides=[
            "model=smollm2", "data=mix", "data.split=evaluation", "data.limit=4", "sampling.max_new_tokens=96",
            "logger=none", *overrides]))
    loaded = load_model(run.model)
    data_dir = Path(run.train.data_dir).expanduser() if run.train.data_dir else ROOT / "outputs/draft_data" / loaded.name
    prompts = training_prompts(loaded, run.train, data_dir)
    sequences, prompt_lengths = generate_sequences(loaded, prompts, run.train, data_dir)
    store = build_store(sequences, prompt_lengths)
    print(f"store: {sum(len(s) - p for s, p in zip(sequences, prompt_lengths))} generated tokens of "
          f"{len(prompts)} calibration prompts, {len(store)} tails")
    skip, _ = resolve_skip(run.skip, num_layers(loaded.model))
    plain = make_strategy("plain", loaded.model, run.sampling, loaded.end_ids, skip, run.draft)
    tally: dict[str, Counter] = defaultdict(Counter)
    for prompt in load_prompt_set(run.data):
        ids = encode_prompt(loaded.tokenizer, prompt)
        output = plain.generate(ids).new_tokens
        counts = tally[prompt.category]
        for t, token in enumerate(output):
            context = ids + output[:t]
            copied = ngram_continuation(context, 3, 1)
            stored = store_prediction(store, context)
            counts["positions"] += 1
            counts["copies"] += bool(copied)
            counts["copies right"] += copied == [token]
            counts["stored"] += stored is not None
            counts["stored right"] += stored == token
            counts["stored, no copy"] += not copied and stored is not None
            counts["stored right, no copy"] += not copied and stored == token
    rate = lambda counts, right, tried: f"{counts[right] / max(counts[tried], 1):.2f} ({counts[tried]})"
    print(f"{loaded.name}, {run.data.limit} held-out prompts a set, greedy; right / predicted (positions predicted):")
    print("| category | positions | copy | store | store where no copy |\n|---|---|---|---|---|")
    for category, counts in sorted(tally.items()):
        print(f"| {category} | {counts['positions']} | {rate(counts, 'copies right', 'copies')} | "
              f"{rate(counts, 'stored right', 'stored')} | {rate(counts, 'stored right, no copy', 'stored, no copy')} |")


if __name__ == "__main__":
    main(sys.argv[1:])
