"""Precision honesty: in bfloat16 the match with plain decoding is measured (fraction, first differing token), not
assumed; every timer reads one clock that waits for CUDA."""

import re
from dataclasses import replace
from pathlib import Path

import torch

from selfspec import timing
from selfspec.api.decoder import DEFAULT_DRAFT, DEFAULT_SAMPLING
from selfspec.data.prompt_sets import encode_prompt, load_prompts
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.strategies import make_strategy
from selfspec.evaluation.evaluate import evaluate
from selfspec.models.tiny import tiny_model
from selfspec.records.prompt_records import first_difference, read_records
from selfspec.settings import SkipSet

PACKAGE = Path(__file__).resolve().parents[1] / "selfspec"


def test_first_difference_is_where_two_outputs_part():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 9, 3], [1, 2, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2 and first_difference([1, 2, 3], [1, 2]) == 2
    assert first_difference([], [4]) == 0


def test_bfloat16_runs_measure_the_match_fraction_and_where_outputs_part(tmp_path, tokenizer):
    # wide enough that a multi-token verify rounds differently from one-token steps, so some output may part
    model = tiny_model("llama", num_layers=4, hidden_size=256, init_std=0.05).to(torch.bfloat16)
    sampling = replace(DEFAULT_SAMPLING, max_new_tokens=20)
    draft = replace(DEFAULT_DRAFT, policy="fixed", max_tokens=4, ngram_tokens=10)
    strategies = [make_strategy(name, model, GenerationOptions(sampling, end_ids=(2,)),
                                skip=SkipSet(attn=(1,), mlp=(2,)), draft=draft)
                  for name in ("plain", "self_spec_fixed")]
    prompts = load_prompts("chat", limit=3)
    summary = evaluate(strategies, prompts, [encode_prompt(tokenizer, p) for p in prompts], tokenizer, tmp_path,
                       warmup=False)
    records = read_records(tmp_path / "records.jsonl")
    plain = {r.question_id: r.output_ids for r in records if r.strategy == "plain"}
    spec = [r for r in records if r.strategy == "self_spec_fixed"]
    for r in spec:
        reference, d = plain[r.question_id], r.first_difference
        assert r.matches_plain == (r.output_ids == reference) == (d is None)
        if d is not None:
            assert r.output_ids[:d] == reference[:d]
            assert d == min(len(r.output_ids), len(reference)) or r.output_ids[d] != reference[d]
    fraction = summary["self_spec_fixed"]["outputs_match_plain"]
    assert 0.0 <= fraction <= 1.0 and fraction == sum(r.matches_plain for r in spec) / len(spec)
    parted = sorted(r.first_difference for r in spec if r.first_difference is not None)
    assert summary["self_spec_fixed"]["median_first_difference"] == (
        (parted[(len(parted) - 1) // 2] + parted[len(parted) // 2]) / 2 if parted else None)


def test_the_clock_waits_for_cuda_only_on_a_cuda_device(monkeypatch):
    synchronized = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synchronized.append(device))
    first = timing.clock("cpu")
    assert synchronized == [] and timing.clock(torch.device("cpu")) >= first
    timing.clock("cuda:1")
    assert synchronized == [torch.device("cuda:1")]


def test_every_timer_reads_the_one_clock():
    readers = [f"{path.relative_to(PACKAGE)}:{number}" for path in sorted(PACKAGE.rglob("*.py"))
               if path.name != "timing.py"
               for number, line in enumerate(path.read_text().splitlines(), start=1)
               if re.search(r"\b(perf_counter|monotonic|process_time)\(", line)]
    assert readers == []
