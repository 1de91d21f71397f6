"""evaluate() takes a run's repeats in turns, every strategy once a round, so a slow spell of the machine falls on
every strategy alike, and records the median run."""

from dataclasses import replace

from selfspec.api.decoder import DEFAULT_DRAFT, DEFAULT_SAMPLING
from selfspec.data.prompt_sets import encode_prompt, load_prompts
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.strategies import make_strategy
from selfspec.evaluation.evaluate import evaluate
from selfspec.models.tiny import tiny_model
from selfspec.records.prompt_records import read_records
from selfspec.settings import SkipSet


def test_repeats_are_taken_in_turns_and_the_median_time_is_recorded(tmp_path, tokenizer, monkeypatch):
    model = tiny_model("llama", num_layers=4)
    sampling = replace(DEFAULT_SAMPLING, max_new_tokens=6)
    strategies = [make_strategy(name, model, GenerationOptions(sampling, end_ids=(2,)),
                                skip=SkipSet(attn=(1,), mlp=(2,)), draft=DEFAULT_DRAFT)
                  for name in ("plain", "self_spec")]
    calls = []
    for strategy in strategies:
        def logged(ids, generator, strategy=strategy, generate=strategy.generate):
            calls.append(strategy.name)
            result = generate(ids, generator)
            result.elapsed_s = (3.0, 1.0, 2.0)[(calls.count(strategy.name) - 1) % 3]  # a prompt's 3 repeats' times
            return result
        monkeypatch.setattr(strategy, "generate", logged)
    prompts = load_prompts("chat", limit=2)
    evaluate(strategies, prompts, [encode_prompt(tokenizer, p) for p in prompts], tokenizer, tmp_path, repeats=3,
             warmup=False)
    assert calls == ["plain", "self_spec"] * 3 * 2  # per prompt, 3 rounds of both strategies
    records = read_records(tmp_path / "records.jsonl")
    assert [r.elapsed_s for r in records] == [2.0] * 4  # the median of 3.0, 1.0 and 2.0
