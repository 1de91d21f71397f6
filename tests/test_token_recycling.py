"""Token Recycling (decoding/drafters/token_recycling.py): the template, the table's update from a verification,
greedy output and cache equal to plain decoding's, and sampled output distributed as plain sampling's."""

from collections import defaultdict
from dataclasses import replace

import pytest
import torch

from selfspec.decoding.drafters import Draft, TokenRecyclingDrafter
from selfspec.decoding.drafters.base import Verification
from selfspec.decoding.drafters.token_recycling import tree_template
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.speculative import generate
from selfspec.decoding.tree import tree_paths
from selfspec.models.tiny import tiny_model
from selfspec.settings import default_settings

from helpers import chi_square_pvalue, decode_checking_cache, exact_pair_distribution

SAMPLING = default_settings().sampling
pytestmark = pytest.mark.usefixtures("one_thread")


def test_template_is_a_prefix_closed_tree_within_its_limits():
    template = tree_template(nodes=12, depth=3, width=2)
    parents = [parent for parent, _ in template]
    paths = tree_paths(parents)  # raises unless every parent comes before its child
    assert len(template) == 12 and max(map(len, paths)) == 3 and max(rank for _, rank in template) == 1
    for i, (parent, rank) in enumerate(template):  # rank r's elder sibling is in the tree before it
        assert rank == 0 or (parent, rank - 1) in template[:i]
    assert template[:2] == [(-1, 0), (0, 0)]  # the top candidate's chain first


def test_every_fed_tokens_row_takes_the_top_candidates_after_it_the_accepted_path_last(tiny):
    drafter = TokenRecyclingDrafter(tiny, nodes=4, depth=2, width=2)
    vocab = drafter.vocab_size
    target = torch.zeros(4, vocab)  # rows: after the last token 7, after draft tokens 3, 9, 3
    for row, (best, second) in enumerate([(3, 5), (11, 12), (13, 14), (15, 16)]):
        target[row, best], target[row, second] = 2.0, 1.0
    draft = Draft([3, 9, 3], parents=[-1, -1, 1])
    drafter.observe_verification(Verification(7, draft, [0], target, 11))  # token 3 twice: node 0 is accepted
    assert drafter.table[7].tolist() == [3, 5] and drafter.table[9].tolist() == [13, 14]
    assert drafter.table[3].tolist() == [11, 12]
    assert drafter.table[0].tolist() == [-1, -1]
    drafter.begin(type("Context", (), {"settings": SAMPLING})())
    drafted = drafter.draft([1, 7], max_tokens=2)
    assert drafter.template == [(-1, 0), (0, 0), (-1, 1), (0, 1)]
    assert (drafted.tokens, drafted.parents) == ([3, 11, 5, 12], [-1, 0, -1, 0])
    assert drafter.draft([1, 7], max_tokens=1).tokens == [3, 5]


def test_greedy_equals_plain_with_an_exact_cache_and_recycles_across_prompts(tiny, tokenizer):
    """Greedy output and the cache equal plain decoding's every step; the table, empty at first and kept from one
    prompt to the next, gets drafts accepted."""
    drafter = TokenRecyclingDrafter(tiny, nodes=8, depth=4, width=4)
    options = GenerationOptions(replace(SAMPLING, max_new_tokens=24))
    accepted = 0
    for text in ["The cat sat on the mat. The cat", "def fib(n):\n    return fib(n - 1)", "The cat sat on"]:
        ids = tokenizer(text).input_ids
        assert decode_checking_cache(tiny, ids, options, drafter) == generate(tiny, ids, options).new_tokens
        accepted += generate(tiny, ids, options, drafter).accepted
    assert accepted > 0


MODEL = tiny_model("llama", num_layers=2, hidden_size=32, seed=3, init_std=0.3).double()


@pytest.mark.slow
def test_sampled_output_is_distributed_as_plain_sampling():
    """Chi-square goodness of fit of new tokens 2 and 3 against plain sampling's exact distribution, the table's
    one-hot drafts branching at the root (a hot table: every generation leaves its candidates)."""
    prompt, settings = [5, 40, 77], replace(SAMPLING, temperature=1.0, top_k=3, max_new_tokens=3)
    drafter = TokenRecyclingDrafter(MODEL, nodes=6, depth=2, width=3)
    gen, counts, branched = torch.Generator().manual_seed(0), defaultdict(int), 0
    for _ in range(1000):
        result = generate(MODEL, prompt, GenerationOptions(settings, generator=gen), drafter)
        counts[tuple(result.new_tokens[1:3])] += 1
        branched += any(step.tree_size > step.tree_depth for step in result.steps)
    exact = exact_pair_distribution(MODEL, prompt, settings)
    assert set(counts) <= set(exact) and branched > 500
    assert chi_square_pvalue(counts, exact) > 0.001
