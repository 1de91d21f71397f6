"""The token store: what followed a context's longest suffix in the model's own generations, counted as a brute-force
count does; saved and refused for another model as a trained part is; and as self_spec_tree's draft where the
context has no copy, lossless in greedy decoding (tests/test_every_strategy.py) and sampled exactly
(tests/test_tree_sampling.py)."""

import random
from collections import Counter
from dataclasses import replace

import pytest
import torch
from helpers import pinned

from selfspec.decoding.costs import DraftCosts
from selfspec.decoding.draft_exit import CostAwareExit
from selfspec.decoding.drafters import (GenerationContext, HybridDrafter, NgramTreeDrafter, SkippedModel,
                                       StoreTreeDrafter, TreeDrafter)
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.speculative import generate
from selfspec.errors import SelfspecError
from selfspec.models.cache import new_cache
from selfspec.models.tiny import tiny_model
from selfspec.models.token_store import TokenStore, load_token_store, loaded_token_store, save_token_store
from selfspec.settings import default_settings, make_skip_set

GREEDY = replace(default_settings().sampling, max_new_tokens=24)


def brute_force(sequences: list[list[int]], context: list[int], max_n: int) -> tuple[int, Counter]:
    """(n, what followed): the longest suffix of `context` (n <= max_n) found inside one of `sequences`; 0 and all
    tokens else."""
    for n in range(min(max_n, len(context)), 0, -1):
        tail = context[-n:]
        found = Counter(seq[i + n] for seq in sequences for i in range(len(seq) - n) if seq[i:i + n] == tail)
        if found:
            return n, found
    return 0, Counter(t for seq in sequences for t in seq)


@pytest.mark.parametrize("vocab_size", [7, 49_152, 262_144])  # 4-grams in 64 bits for SmolLM2's vocabulary, 3 for Gemma-3's
def test_next_counts_are_what_followed_the_longest_suffix(vocab_size):
    rng = random.Random(vocab_size)
    alphabet = [0, 1, 2, 3, vocab_size - 1]  # few ids, so that contexts recur; the largest id packs into the top bits
    sequences = [[rng.choice(alphabet) for _ in range(rng.randrange(1, 30))] for _ in range(20)]
    store = TokenStore.of(sequences, vocab_size)
    assert store.max_n == 64 // vocab_size.bit_length() and len(store) == sum(map(len, sequences)) + len(sequences)
    for _ in range(300):
        context = [rng.choice(alphabet + [4]) for _ in range(rng.randrange(1, 8))]  # 4 is in no sequence
        n, ids, counts = store.longest_match(context)
        assert (n, dict(zip(ids.tolist(), counts.tolist()))) == brute_force(sequences, context, store.max_n), context
    logits = store.next_logits(sequences[0][:3])  # (vocab_size,)
    ids, counts = store.next_counts(sequences[0][:3])
    assert logits.shape == (vocab_size,) and torch.isinf(logits).sum() == vocab_size - len(ids)
    torch.testing.assert_close(torch.softmax(logits, 0)[ids], torch.tensor(counts / counts.sum(), dtype=torch.float32))


def test_a_match_never_runs_across_two_sequences():
    store = TokenStore.of([[1, 2], [3, 4]], 10)
    assert store.next_counts([2])[0].tolist() == [1, 2, 3, 4]  # nothing followed 2: the unigram counts
    assert store.next_counts([2, 3])[0].tolist() == [4]  # (2, 3) never occurs: 3 alone matches


def test_a_store_is_refused_for_another_model_and_a_missing_shipped_one_warns(tmp_path, capsys):
    llama, gemma2 = tiny_model("llama", num_layers=2), tiny_model("gemma2", num_layers=2)
    path = tmp_path / "store.pt"
    save_token_store(path, [[1, 2, 3], [4, 5]], llama, commit="abc")
    store = load_token_store(path, llama)
    assert store.next_counts([2])[0].tolist() == [3] and store.vocab_size == llama.get_output_embeddings().weight.shape[0]
    with pytest.raises(SelfspecError, match="draft.store=.*was trained for another model"):
        load_token_store(path, gemma2)
    with pytest.raises(SelfspecError, match="draft.store=.*does not exist"):
        load_token_store(tmp_path / "missing.pt", llama)
    assert loaded_token_store(llama, "shipped") is None  # no store ships for a tiny random model
    assert "no token store ships for this model" in capsys.readouterr().err


def test_out_of_range_ids_are_refused():
    with pytest.raises(ValueError, match=r"ids in \[0, 10\)"):
        TokenStore.of([[3, 10]], 10)


@pytest.mark.usefixtures("one_thread")
def test_the_tree_takes_the_store_where_nothing_is_copied_and_each_source_learns_its_own_rate(tiny, tokenizer):
    """The model's own greedy output as the store: where the context has no copy the store drafts, and is right; the
    output equals plain decoding; the store's policy learns from its drafts, the copier's from its copies."""
    prompts = [tokenizer(text).input_ids for text in ("Once upon a time", "def add(a, b):", "1, 2, 3,")]
    outputs = [generate(tiny, ids, GenerationOptions(GREEDY)).new_tokens for ids in prompts]
    store = TokenStore.of(outputs, tiny.get_output_embeddings().weight.shape[0])
    costs = DraftCosts(tuple(10.0 + 0.5 * q for q in range(16)), 0.0)
    skip = make_skip_set([1], [2], 6)
    hybrid = HybridDrafter(NgramTreeDrafter(tiny, 2, 6, 4, 3, pinned(CostAwareExit(6, costs=costs))),
                           TreeDrafter(SkippedModel(tiny, skip), pinned(CostAwareExit(4, costs=replace(costs, draft_ms=8.0))),
                                           nodes=6, depth=4),
                           StoreTreeDrafter(tiny, store, pinned(CostAwareExit(6, costs=costs)), nodes=6, depth=4,
                                            width=3, branch_below=0.6))
    for ids, plain in zip(prompts, outputs):
        result = generate(tiny, ids, GenerationOptions(GREEDY), hybrid)
        assert result.new_tokens == plain
        sources = Counter(step.source for step in result.steps if step.accepted)
        assert sources["store"] > 0
    judged = max(policy.first_counts.judged for policy in hybrid.store.policies.by_n.values())
    assert judged > 2  # verified store drafts, beyond the prior's 2


def test_failed_drafts_after_short_suffixes_do_not_stop_the_drafts_after_long_ones(tiny):
    """The store tree learns its rate apart per length of the longest suffix the store holds: drafts after a 1-token
    suffix that verification keeps rejecting stop being drafted, while a draft after a 4-token suffix is drafted at
    once, step after step (with one rate for both it would wait for a probe)."""
    store = TokenStore.of([[1, 2, 3, 4, 5, 6]], tiny.get_output_embeddings().weight.shape[0])
    assert store.max_n >= 4
    policy = pinned(CostAwareExit(5, costs=DraftCosts(tuple(10.0 + 2 * q for q in range(9)), 0.0)))  # +20% a token
    drafter = StoreTreeDrafter(tiny, store, policy, nodes=6, depth=4, width=3, branch_below=0.6)
    drafter.begin(GenerationContext(new_cache(tiny, 32), GREEDY))
    short_suffix, long_suffix = [40, 41, 3], [1, 2, 3, 4]
    assert store.longest_match(short_suffix)[0] == 1 and store.longest_match(long_suffix)[0] == 4
    drafted = []
    for _ in range(30):
        draft = drafter.draft(short_suffix, 5)
        drafted.append(bool(draft.tokens))
        if draft.tokens:
            drafter.update(len(draft.tokens), 0, [])
    assert drafted[0] and sum(drafted[-16:]) <= 2  # idle but for probes
    assert all(drafter.draft(long_suffix, 5).tokens[:1] == [5] for _ in range(3))
    assert drafter.threshold == 0.5  # the 4-token suffixes' rate: its prior, untouched by the 1-token failures
