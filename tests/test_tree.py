"""Token trees: masks, greedy losslessness over random trees and the tree drafters, the cache after a tree step."""

import random
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from selfspec.api.decoder import DEFAULT_DRAFT
from selfspec.decoding.costs import DraftCosts
from selfspec.decoding.draft_exit import CostAwareExit, DraftExit, ThresholdExit
from selfspec.decoding.drafters import (Draft, GenerationContext, HybridDrafter, NgramTreeDrafter, SelfDrafter,
                                        SkippedModel, TreeDrafter, ngram_matches)
from selfspec.decoding.drafters.ngram_tree import add_branch
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.speculative import Generation, generate
from selfspec.decoding.strategies import make_strategy
from selfspec.decoding.tree import forward_tree, tree_attention_mask
from selfspec.errors import SelfspecError
from selfspec.models.cache import forward, new_cache
from selfspec.models.tiny import tiny_model
from selfspec.settings import SkipSet, default_settings, make_skip_set

from helpers import decode_checking_cache, hf_greedy, pinned, run_settings

SAMPLING = default_settings().sampling  # the config's: greedy, 128 new tokens
WINDOW = 8  # sliding window of the tiny Gemma models: shorter than every test sequence
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["llama", "gemma2", "gemma3"])
def model(request):
    return tiny_model(request.param, num_layers=4, sliding_window=WINDOW).double()


class RandomTreeDrafter:
    """Random trees around a known continuation `truth`: each node hangs under a random earlier node (or the
    root) and, while its path is still true, is the true next token with probability `p_true`, else a random
    token. With `obey_depth=False` it ignores the depth asked for, so branches run past max_new_tokens."""
    threshold = 0.0

    def __init__(self, truth: list[int], seed: int, nodes: int = 8, obey_depth: bool = True, p_true: float = 0.5):
        self.truth, self.rng, self.nodes, self.obey_depth = truth, random.Random(seed), nodes, obey_depth
        self.p_true = p_true

    @property
    def max_tokens(self) -> int:
        return self.nodes

    def begin(self, context):
        self.context = context

    def draft(self, tokens, max_tokens):
        draft, paths = Draft(parents=[]), {-1: []}
        for i in range(self.rng.randint(1, self.nodes)):
            parent = self.rng.randint(-1, i - 1)
            if self.obey_depth and len(paths[parent]) >= max_tokens:
                parent = -1
            path = paths[parent] + [i]
            at = len(tokens) + len(path) - 1
            on_truth = tokens + [draft.tokens[j] for j in paths[parent]] == self.truth[:at]
            true_next = on_truth and at < len(self.truth) and self.rng.random() < self.p_true
            draft.tokens.append(self.truth[at] if true_next else self.rng.randrange(3, 259))
            draft.parents.append(parent)
            paths[i] = path
        return draft

    def update(self, drafted, accepted, path=None, source="model"):
        pass

    def observe_verify_ms(self, tokens, ms):
        pass


def test_tree_mask_shows_each_node_the_prefix_its_ancestors_and_itself():
    parents = [-1, -1, 0, 2, 1]  # two branches from the root: 0 -> 2 -> 3 and 1 -> 4
    allowed = tree_attention_mask(parents, 3, torch.float64, "cpu")[0, 0] == 0  # (6, 9)
    expected = [[1, 1, 1, 1, 0, 0, 0, 0, 0],
                [1, 1, 1, 1, 1, 0, 0, 0, 0],
                [1, 1, 1, 1, 0, 1, 0, 0, 0],
                [1, 1, 1, 1, 1, 0, 1, 0, 0],
                [1, 1, 1, 1, 1, 0, 1, 1, 0],
                [1, 1, 1, 1, 0, 1, 0, 0, 1]]
    assert allowed.int().tolist() == expected
    sliding = tree_attention_mask(parents, 3, torch.float64, "cpu", sliding_window=3)[0, 0] == 0
    # a sliding layer hands attention the last window - 1 = 2 prefix keys (cache index 1 on) before the root
    assert sliding.shape == (6, 8)
    # node 3 (row 4) is at position 3 + 3 = 6 and sees positions 4..6: its ancestors at 4 and 5, not the prefix
    assert sliding[4].int().tolist() == [0, 0, 0, 1, 0, 1, 1, 0]
    assert sliding[0].int().tolist() == [1, 1, 1, 0, 0, 0, 0, 0]  # the root at position 3 sees 1..3
    with pytest.raises(ValueError, match="node 1 has parent 1"):
        tree_attention_mask([-1, 1], 3, torch.float64, "cpu")


def test_a_chain_shaped_tree_gives_the_chain_forwards_logits_past_the_sliding_window(model, prompt):
    tokens = prompt + list(range(40, 60))  # longer than the window
    chain, tree = new_cache(model, 64), new_cache(model, 64)
    forward(model, chain, tokens[:-1], 0)
    forward(model, tree, tokens[:-1], 0)
    drafts = [70, 71, 72, 73]
    expected = forward(model, chain, [tokens[-1]] + drafts, len(tokens) - 1)
    logits = forward_tree(model, tree, tokens[-1], Draft(drafts, parents=[-1, 0, 1, 2]), len(tokens) - 1)
    torch.testing.assert_close(logits, expected)


def plain_output(model, prompt, n=30):
    return generate(model, prompt, GenerationOptions(replace(SAMPLING, max_new_tokens=n))).new_tokens


@pytest.fixture(scope="module")
def plain(model, tokenizer):
    """30 tokens of plain greedy decoding after conftest's `prompt`, once per model."""
    return plain_output(model, tokenizer("def fibonacci(n):\n    ").input_ids)


def test_random_trees_keep_greedy_output_and_accept_deep_and_later_branches(model, prompt, plain):
    assert plain == hf_greedy(model, prompt, 30)  # our plain loop is the reference, past the sliding window too
    for seed in range(2):
        result = generate(model, prompt, GenerationOptions(replace(SAMPLING, max_new_tokens=30)),
                          RandomTreeDrafter(prompt + plain, seed))
        assert result.new_tokens == plain, seed
        assert max(s.accepted for s in result.steps) >= 2
        assert all(s.tree_size == s.drafted and s.accepted <= s.tree_depth for s in result.steps)


def test_eos_inside_a_branch_ends_the_output_there(model, prompt, plain):
    eos = plain[12]
    expected = plain[: plain.index(eos) + 1]
    cut_inside = 0
    for seed in range(3):
        drafter = RandomTreeDrafter(prompt + plain, seed, p_true=0.9)
        result = generate(model, prompt, GenerationOptions(replace(SAMPLING, max_new_tokens=30), end_ids=(eos,)),
                          drafter)
        assert result.new_tokens == expected
        cut_inside += result.steps[-1].accepted >= result.steps[-1].emitted  # accepted drafts after EOS dropped
    assert cut_inside > 0


def test_max_new_tokens_cuts_a_branch_that_runs_past_it(model, prompt, plain):
    cut_inside = 0
    for n in (1, 3, 7):
        for seed in range(2):
            settings = replace(SAMPLING, max_new_tokens=n)
            for obey_depth in (False, True):
                drafter = RandomTreeDrafter(prompt + plain, seed, obey_depth=obey_depth, p_true=0.9)
                result = generate(model, prompt, GenerationOptions(settings), drafter)
                assert result.new_tokens == plain[:n]
                cut_inside += bool(result.steps) and result.steps[-1].accepted >= result.steps[-1].emitted
    assert cut_inside > 0


def test_cache_after_every_tree_step_equals_plain_decodings_cache(model, prompt, plain):
    options = GenerationOptions(replace(SAMPLING, max_new_tokens=30))
    assert decode_checking_cache(model, prompt, options, RandomTreeDrafter(prompt + plain, 0)) == plain


def test_tree_drafters_keep_greedy_output_for_several_skip_sets(model, tokenizer):
    prompt = tokenizer("def fib(n):\n    return fib(n - 1) + fib(n - 2)\n\ndef fib").input_ids  # repeats to copy
    rng = random.Random(2)
    for settings, configs in ((replace(SAMPLING, max_new_tokens=20), 2),
                              (replace(SAMPLING, max_new_tokens=20, repetition_penalty=1.3), 1)):
        plain = generate(model, prompt, GenerationOptions(settings)).new_tokens
        for _ in range(configs):
            skip = make_skip_set(rng.sample(range(4), rng.randint(0, 2)), rng.sample(range(4), rng.randint(1, 2)), 4)
            nodes, depth, width = rng.randint(2, 8), rng.randint(1, 5), rng.randint(1, 3)
            tree = TreeDrafter(SkippedModel(model, skip), ThresholdExit(8, 0.3), nodes, depth, width, rng.random())
            ngram = NgramTreeDrafter(model, rng.randint(1, 3), nodes, depth, width)
            for drafter in (tree, ngram, HybridDrafter(ngram, tree)):
                result = generate(model, prompt, GenerationOptions(settings), drafter)
                assert result.new_tokens == plain, (skip, nodes, depth, width, drafter)
                assert all(s.tree_size <= nodes and s.tree_depth <= depth for s in result.steps)


def test_layer_skip_tree_branches_only_where_the_draft_is_unsure(prompt):
    model = tiny_model("llama", num_layers=4).double()
    skip = make_skip_set([1], [2], 4)
    generation = Generation(model, prompt, GenerationOptions(replace(SAMPLING, max_new_tokens=30)))
    tokens, context = prompt + generation.start().tokens, generation.context
    chain = SelfDrafter(model, skip, DraftExit(4))
    never = TreeDrafter(SkippedModel(model, skip), DraftExit(4), nodes=12, depth=4, width=3, branch_below=0.0)
    always = TreeDrafter(SkippedModel(model, skip), DraftExit(4), nodes=12, depth=4, width=3, branch_below=1.0)
    for drafter in (chain, never, always):
        drafter.begin(context)
    expected = chain.draft(tokens, 4).tokens
    assert never.draft(tokens, 4) == Draft(expected, [], "model", [-1, 0, 1, 2])
    wide = always.draft(tokens, 4)
    assert wide.parents == [-1, -1, -1, 0, 0, 0, 3, 3, 3, 6, 6, 6]
    assert [wide.tokens[i] for i in (0, 3, 6, 9)] == expected  # the chain runs through the first children
    assert always.draft(tokens, 2).parents == [-1, -1, -1, 0, 0, 0]  # the depth asked for caps it


    class NoDraft(DraftExit):
        def plan(self, max_tokens):
            return 0  # as the cost-aware exit does where drafting does not pay

    idle = TreeDrafter(SkippedModel(model, skip), NoDraft(4), nodes=12, depth=4, width=3, branch_below=1.0)
    idle.begin(context)
    assert idle.draft(tokens, 4) == Draft()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([3, 5, 256, 65536, 65541, 2**31 - 1]), max_size=40), st.integers(1, 3),
       st.integers(1, 5), st.integers(1, 4))
def test_ngram_search_finds_what_a_scan_of_the_context_finds(tokens, ngram_size, max_tokens, limit):
    """The bytes search (4 bytes a token) against the definition: every earlier occurrence of the last n tokens,
    n = ngram_size down to 1, latest first; ids whose bytes overlap across tokens must not match out of step."""
    expected, seen = [], []
    for n in range(min(ngram_size, len(tokens) - 1), 0, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            continuation = tokens[start + n:start + n + max_tokens]
            if tokens[start:start + n] == tokens[-n:] and continuation not in seen and len(expected) < limit:
                seen.append(continuation)
                expected.append((n, continuation))
    assert ngram_matches(tokens, ngram_size, max_tokens, limit) == expected


def test_ngram_matches_docstring_example():
    tokens = [7, 1, 2, 3, 9, 2, 4, 1, 2, 5, 6, 1, 2]
    assert ngram_matches(tokens, 2, 3, limit=8) == [(2, [5, 6, 1]), (2, [3, 9, 2]), (1, [4, 1, 2])]


def test_ngram_trie_merges_distinct_continuations_within_its_budget():
    tokens = [5, 6, 7, 8, 9, 5, 6, 7, 3, 5, 6, 4, 4, 5, 6]
    # after (5, 6): latest first 4 4 5 6, then 7 3 5 6, then 7 8 9 5; then the 1-gram (6,) adds nothing new
    assert ngram_matches(tokens, 2, 4, limit=8) == [(2, [4, 4, 5, 6]), (2, [7, 3, 5, 6]), (2, [7, 8, 9, 5])]
    assert ngram_matches(tokens, 2, 4, limit=2) == [(2, [4, 4, 5, 6]), (2, [7, 3, 5, 6])]
    draft = Draft(parents=[])
    for branch in ([4, 4, 5, 6], [7, 3, 5, 6], [7, 8, 9, 5], [1, 2]):
        add_branch(draft, branch, nodes=10, width=2)
    assert draft.tokens == [4, 4, 5, 6, 7, 3, 5, 6, 8, 9] and draft.parents == [-1, 0, 1, 2, -1, 4, 5, 6, 4, 8]
    # the root already has two children, so [1, 2] was dropped; the budget cut 7 8 9 5 after 9


def test_tree_strategies_and_settings(prompt):
    model = tiny_model("llama", num_layers=4).double()
    settings = run_settings("draft.tree_nodes=5", "draft.tree_depth=3")
    plain = plain_output(model, prompt, 20)
    for name in ("prompt_lookup_tree", "self_spec_tree"):
        strategy = make_strategy(name, model, GenerationOptions(replace(SAMPLING, max_new_tokens=20)),
                                 skip=SkipSet((1,), (2,)), draft=settings.draft)
        result = strategy.generate(prompt)
        assert result.new_tokens == plain
        assert all(s.tree_size <= 5 and s.tree_depth <= 3 for s in result.steps)
    for key, message in (("draft.tree_width=0", "tree_width=0 must be >= 1"),
                         ("draft.tree_branch_below=1.5", r"tree_branch_below=1.5 is outside \[0, 1\]")):
        with pytest.raises(SelfspecError, match=message):
            run_settings(key)


def rising_costs(step_ms: float = 0.2, draft_ms: float = 0.0, n: int = 10) -> DraftCosts:
    """c(q) = 10 + step_ms (q - 1) ms."""
    return DraftCosts(tuple(10.0 + step_ms * q for q in range(n)), draft_ms)


def test_cost_shaped_ngram_trees_stop_adding_a_branch_kind_that_is_not_accepted(model):
    """After (5, 6): the 2-gram copies 7 8 9 6 3 (the chain); the 1-gram (6,) also copies 3 5 6, a fork beside 7.
    Where verification always takes the chain, the 1-gram fork is rejected each time it is tried, and its kind
    stops being added; where it always takes the fork, the fork stays, and the trie is drafted at every step: the
    chain it beats shortens to one token, which alone would not pay, but the fork beside it does (plan's siblings)."""
    tokens = [5, 6, 7, 8, 9, 6, 3, 5, 6]
    for fork_wins in (False, True):
        drafter = NgramTreeDrafter(model, 2, nodes=8, depth=5, width=3,
                                   exit_policy=CostAwareExit(5, costs=rising_costs()))
        drafter.begin(GenerationContext(new_cache(model, 32), SAMPLING))
        had_fork = []
        for _ in range(20):
            draft = drafter.draft(tokens, 5)
            if not draft.tokens:
                continue
            chain = list(range(len(draft.parents)))
            chain = chain[:next((i for i in chain if draft.parents[i] != i - 1), len(chain))]  # nodes 0 -> 1 -> ...
            assert [draft.tokens[i] for i in chain] == [7, 8, 9, 6, 3][:len(chain)] and chain
            forks = [i for i, parent in enumerate(draft.parents) if parent == -1 and draft.tokens[i] == 3]
            had_fork.append(bool(forks))
            path = forks[:1] + [i for i in range(len(draft.tokens)) if draft.parents[i] == forks[0]][:1] \
                if fork_wins and forks else chain
            drafter.update(max(len(chain), len(path)), len(path), path)
        assert had_fork[0]  # tried at first, at its prior
        assert all(had_fork) and len(had_fork) == 20 if fork_wins else not any(had_fork[-15:])
        fork = drafter.exit_policy.branch_counts[("ngram", 1, 1, True)]
        assert (fork.accepted / fork.judged > 0.9) if fork_wins else fork.accepted == 0.0


def test_cost_shaped_trees_keep_greedy_output_under_random_costs(model, tokenizer):
    prompt = tokenizer("def fib(n):\n    return fib(n - 1) + fib(n - 2)\n\ndef fib").input_ids  # repeats to copy
    rng = random.Random(5)
    branched = set()
    for settings in (replace(SAMPLING, max_new_tokens=40),
                     replace(SAMPLING, max_new_tokens=24, repetition_penalty=1.3)):
        plain = generate(model, prompt, GenerationOptions(settings)).new_tokens
        for _ in range(2):
            verify_ms = (10.0, *(rng.uniform(9.0, 11.5) for _ in range(8)))  # c(q) ms, q = 1..9: dips and rises
            skip = make_skip_set(rng.sample(range(4), rng.randint(0, 2)), rng.sample(range(4), rng.randint(1, 2)), 4)
            nodes, depth, width = rng.randint(4, 8), rng.randint(2, 5), rng.randint(2, 3)
            draft_ms = rng.uniform(0.0, 3.0)
            tree = TreeDrafter(SkippedModel(model, skip), pinned(CostAwareExit(8, costs=DraftCosts(verify_ms, draft_ms))),
                               nodes, depth, width)
            ngram = NgramTreeDrafter(model, rng.randint(1, 3), nodes, depth, width,
                                     pinned(CostAwareExit(8, costs=DraftCosts(verify_ms, 0.0))))
            for drafter in (tree, ngram, HybridDrafter(ngram, tree)):
                result = generate(model, prompt, GenerationOptions(settings), drafter)
                assert result.new_tokens == plain, (verify_ms, skip, nodes, depth, width, drafter)
                assert all(s.tree_size <= nodes and s.tree_depth <= depth for s in result.steps)
                branched |= {s.source for s in result.steps if s.tree_size > s.tree_depth}
    assert branched == {"model", "ngram"}  # both drafters' trees had branches


def test_tree_strategies_take_the_hybrid_policy(prompt):
    model = tiny_model("llama", num_layers=4).double()
    for overrides, shaped in ((["draft.hybrid_policy=cost"], True), (["draft.hybrid_policy=null"], False),
                              (["draft=cost", "draft.hybrid_policy=null"], True)):
        draft = run_settings(*overrides).draft
        lookup, hybrid = (make_strategy(name, model, GenerationOptions(replace(SAMPLING, max_new_tokens=8)),
                                        skip=SkipSet((1,), (2,)), draft=draft).drafter for name in ("prompt_lookup_tree", "self_spec_tree"))
        assert isinstance(lookup.exit_policy, CostAwareExit) == shaped
        assert isinstance(hybrid.ngram.exit_policy, CostAwareExit) == shaped
        assert isinstance(hybrid.fallback.exit_policy, CostAwareExit) == shaped


def test_tree_strategies_past_a_model_wide_sliding_window_equal_plain():
    """Mistral slides every layer by one `config.sliding_window` (no `layer_types`), so its forward takes one mask:
    the tree's sliding mask, not a dict per layer type."""
    from transformers import AutoModelForCausalLM, MistralConfig

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW)
    model = AutoModelForCausalLM.from_config(config).double().eval()
    prompt = list(range(3, 40)) * 2  # repeats itself, so copies have matches; far past the window
    greedy = replace(SAMPLING, max_new_tokens=30)
    draft = replace(DEFAULT_DRAFT, hybrid_policy="fixed", max_tokens=3)
    plain = generate(model, prompt, GenerationOptions(greedy)).new_tokens
    assert plain == hf_greedy(model, prompt, 30)
    for name in ("prompt_lookup_tree", "self_spec_tree"):
        result = make_strategy(name, model, GenerationOptions(greedy), skip=make_skip_set([1], [], 3), draft=draft).generate(prompt)
        assert result.new_tokens == plain and result.drafted > 0, name
