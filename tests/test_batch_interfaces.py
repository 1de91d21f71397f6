"""Batches from the outside: the Python API takes a list of prompts, run.py takes batch_size, and each prompt's record
says who it was decoded beside."""

import json
from collections import defaultdict

import pytest

from selfspec.api.decoder import SelfSpeculativeDecoder
from selfspec.errors import SelfspecError

from helpers import main_in_process

PROMPTS = ["def fib(n):", "The cat sat on the mat. The cat", "hello"]


@pytest.fixture(scope="module")
def decoder(tiny, tokenizer):
    return SelfSpeculativeDecoder(tiny, tokenizer, skip={"attn": [1], "mlp": [2]})


def test_a_list_of_prompts_decodes_as_a_batch_each_row_as_alone(decoder):
    batch = decoder.generate(PROMPTS, max_new_tokens=20)
    assert [c.token_ids for c in batch] == [decoder.generate(p, max_new_tokens=20).token_ids for p in PROMPTS]
    assert [c.text for c in batch] == [decoder.generate(p, max_new_tokens=20).text for p in PROMPTS]
    # sampled: row i draws from seed + i, the same draws as alone (float64: the batch's logits are the row's own)
    sampled = decoder.generate(PROMPTS, max_new_tokens=12, temperature=0.9, seed=5)
    assert [c.token_ids for c in sampled] == [decoder.generate(p, max_new_tokens=12, temperature=0.9, seed=5 + i)
                                              .token_ids for i, p in enumerate(PROMPTS)]
    streamed = defaultdict(list)
    for row, chunk in decoder.stream(PROMPTS, max_new_tokens=20):
        chunk.onto(streamed[row])
    assert [[t.id for t in streamed[row]] for row in range(3)] == [c.token_ids for c in batch]


@pytest.mark.parametrize("prompts, message", [
    (["text", [5, 6]], "the batch mixes text and token ids; a batch takes prompts of one kind"),
    ([[{"role": "user", "content": "hi"}], "text"], "the batch mixes chat messages and text"),
    (["text", ""], "prompt encodes to no tokens"),
])
def test_a_bad_batch_ends_in_one_line(decoder, prompts, message):
    with pytest.raises(SelfspecError, match=message):
        decoder.generate(prompts, max_new_tokens=4)


RUN = ["model=tiny_llama", "logger=none", "data.name=humaneval", "data.limit=4", "sampling.max_new_tokens=8",
       "warmup=false"]


def test_run_py_decodes_batches_and_records_each_prompts_neighbours(tmp_path, monkeypatch, capsys):
    code, stderr = main_in_process(monkeypatch, capsys, *RUN, "batch_size=3", "strategies=[plain,self_spec_hybrid]",
                                   f"hydra.run.dir={tmp_path}")
    assert code == 0, stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert len(records) == 8 and all(r["matches_plain"] for r in records)
    first = [r for r in records if r["strategy"] == "plain"]
    ids = [r["question_id"] for r in first]
    assert all(r["batch_size"] == 3 and r["batch_group"] == ids for r in first)  # the fourth joins as a row ends
    assert first[0]["batch_neighbours"][:2] == ids[1:3] and ids[0] not in first[0]["batch_neighbours"]
    assert len({r["batch_elapsed_s"] for r in first}) == 1  # the group's wall time
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["plain"]["batch_size"] == 3 and summary["plain"]["aggregate_tokens_per_s"] > 0


@pytest.mark.parametrize("overrides, message", [
    (["batch_size=0"], "batch_size=0 must be >= 1"),
    (["batch_size=2", "strategies=[plain,hf_generate]"], "batch_size=2: strategies hf_generate are transformers'"),
])
def test_bad_batch_sizes_end_in_one_line(tmp_path, monkeypatch, capsys, overrides, message):
    code, stderr = main_in_process(monkeypatch, capsys, *RUN, *overrides, f"hydra.run.dir={tmp_path}")
    assert code == 2 and stderr.strip().splitlines()[-1].startswith("selfspec: error: ")
    assert message in stderr
