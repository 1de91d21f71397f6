"""Lookahead decoding (decoding/drafters/lookahead.py): the lookahead branch's shape, the window's Jacobi step and
n-gram pool, greedy output and cache equal to plain decoding's, and sampled output distributed as plain sampling's."""

from collections import defaultdict
from dataclasses import replace

import pytest
import torch

from selfspec.decoding.drafters import LookaheadDrafter
from selfspec.decoding.drafters.base import Verification
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.speculative import generate
from selfspec.decoding.tree import tree_paths
from selfspec.errors import SelfspecError
from selfspec.models.tiny import tiny_model
from selfspec.settings import default_settings

from helpers import chi_square_pvalue, decode_checking_cache, exact_pair_distribution

SAMPLING = default_settings().sampling
pytestmark = pytest.mark.usefixtures("one_thread")


def scores_choosing(choices: list[int], vocab: int) -> torch.Tensor:
    """(len(choices), vocab) scores whose argmax per row is `choices`."""
    target = torch.zeros(len(choices), vocab)
    target[range(len(choices)), choices] = 1.0
    return target


def test_the_window_advances_a_level_per_step_and_pools_the_n_grams_it_completes(tiny):
    drafter = LookaheadDrafter(tiny, window=3, ngram=3, candidates=2)
    drafter.begin(type("Context", (), {"settings": SAMPLING})())
    drafter.levels = [[10, 11, 12]]
    draft = drafter.draft([1, 2], max_tokens=8)
    assert (draft.tokens, draft.parents) == ([10, 11, 12], [-1, 0, 1])  # level 0: a chain from the root
    drafter.observe_verification(Verification(2, draft, [], scores_choosing([0, 21, 22, 23], drafter.vocab_size), 0))
    assert drafter.levels == [[10, 11, 12], [21, 22, 23]] and drafter.pool == {}
    draft = drafter.draft([1, 2], max_tokens=8)  # level 1 on the diagonals: column c + 1 after level 0's column c
    assert draft.tokens == [10, 21, 11, 22, 12, 23] and draft.parents == [-1, 0, 0, 2, 2, 4]
    assert [len(path) for path in tree_paths(draft.parents)[1:]] == [1, 2, 2, 3, 3, 4]  # node depth = its column + 1
    guesses = [0, 0, 31, 0, 32, 0, 33]  # the argmax after each top-level node (10's diagonal ends at node 1: row 2)
    drafter.observe_verification(Verification(2, draft, [], scores_choosing(guesses, drafter.vocab_size), 0))
    assert drafter.levels == [[21, 22, 23], [31, 32, 33]]
    assert drafter.pool == {10: [(21, 31)], 11: [(22, 32)], 12: [(23, 33)]}
    draft = drafter.draft([1, 10], max_tokens=8)  # the pool's n-gram after 10 first, then the window
    assert draft.tokens[:2] == [21, 31] and draft.parents[:2] == [-1, 0] and len(draft.tokens) == 8
    assert drafter.draft([1, 10], max_tokens=3).tokens == [21, 31]  # a window deeper than the cap waits


def test_the_pool_keeps_the_newest_n_grams_per_first_token(tiny):
    drafter = LookaheadDrafter(tiny, window=2, ngram=2, candidates=2)
    for gram in ([5, 1], [5, 2], [5, 1], [5, 3]):
        drafter.add_ngram(gram)
    assert drafter.pool == {5: [(3,), (1,)]}


def test_an_n_gram_shorter_than_two_is_one_clear_error(tiny):
    with pytest.raises(SelfspecError, match="lookahead_ngram=1 must be >= 2"):
        LookaheadDrafter(tiny, ngram=1)


def test_greedy_equals_plain_with_an_exact_cache_and_accepts_pooled_n_grams(tiny, tokenizer):
    drafter = LookaheadDrafter(tiny, window=4, ngram=3, candidates=3)
    options = GenerationOptions(replace(SAMPLING, max_new_tokens=32))
    accepted = 0
    for text in ["The cat sat on the mat. The cat", "def fib(n):\n    return fib(n - 1)"]:
        ids = tokenizer(text).input_ids
        assert decode_checking_cache(tiny, ids, options, drafter) == generate(tiny, ids, options).new_tokens
        accepted += generate(tiny, ids, options, drafter).accepted
    assert accepted > 0 and drafter.pool


MODEL = tiny_model("llama", num_layers=2, hidden_size=32, seed=3, init_std=0.3).double()


@pytest.mark.slow
def test_sampled_output_is_distributed_as_plain_sampling():
    """Chi-square goodness of fit of new tokens 2 and 3 against plain sampling's exact distribution; the steps
    verify the lookahead branch and, once the pool holds n-grams after their last token, pooled ones beside it
    (7 new tokens: a window of 2 levels is 3 deep, and a step drafts at most the tokens left but one)."""
    prompt, settings = [5, 40, 77], replace(SAMPLING, temperature=1.0, top_k=3, max_new_tokens=7)
    drafter = LookaheadDrafter(MODEL, window=2, ngram=3, candidates=2)
    gen, counts, pooled = torch.Generator().manual_seed(0), defaultdict(int), 0
    for _ in range(1000):
        result = generate(MODEL, prompt, GenerationOptions(settings, generator=gen), drafter)
        counts[tuple(result.new_tokens[1:3])] += 1
        pooled += result.steps[0].tree_size > drafter.window  # a generation's first window is one level of W
    exact = exact_pair_distribution(MODEL, prompt, replace(settings, max_new_tokens=3))
    assert set(counts) <= set(exact) and pooled > 200
    assert chi_square_pvalue(counts, exact) > 0.001
