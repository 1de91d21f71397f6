"""Sampled token-tree verification (SpecInfer's multi-candidate rule) is distributed exactly as plain sampling."""

from collections import defaultdict
from dataclasses import replace
from itertools import permutations

import pytest
import torch

from selfspec.decoding import tree
from selfspec.decoding.costs import DraftCosts
from selfspec.decoding.draft_exit import CostAwareExit, DraftExit
from selfspec.decoding.drafters import (Draft, HybridDrafter, NgramTreeDrafter, SkippedModel, StoreTreeDrafter,
                                        TreeDrafter)
from selfspec.decoding.drafters.layer_skip_tree import branches
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.sampling import one_hot_q
from selfspec.decoding.speculative import generate
from selfspec.decoding.tree import verify_tree_sampled
from selfspec.models.tiny import tiny_model
from selfspec.models.token_store import TokenStore
from selfspec.settings import default_settings, make_skip_set

from helpers import chi_square_pvalue, exact_pair_distribution

SAMPLING = default_settings().sampling  # the config's: greedy, 128 new tokens
V = 4  # vocabulary of the analytic test
pytestmark = pytest.mark.usefixtures("one_thread")


def random_distribution(gen, zeros: int = 0) -> torch.Tensor:
    d = torch.rand(V, generator=gen, dtype=torch.float64)
    d[torch.randperm(V, generator=gen)[:zeros]] = 0.0
    return d / d.sum()


def without_replacement(q: torch.Tensor, k: int):
    """Every ordered draw of k distinct tokens from q as `branches` samples them: (tokens, probability, each's q)."""
    draws = []
    for tokens in permutations(range(V), k):
        probability, qs, rest = 1.0, [], q
        for t in tokens:
            probability *= float(rest[t])
            qs.append(rest)
            rest = rest.clone()
            rest[t] = 0.0
            rest = rest / rest.sum() if rest.sum() > 0 else rest
        if probability > 0:
            draws.append((tokens, probability, qs))
    return draws


def step_distribution(draft: Draft, p: torch.Tensor, monkeypatch) -> dict[tuple, float]:
    """The exact distribution of what `verify_tree_sampled` emits (accepted path tokens + next token), found by
    running it under every sequence of accept/reject outcomes, each weighted by its probability."""
    emitted, pending = defaultdict(float), [[]]
    while pending:
        script, taken, weight, final = pending.pop(), [], [1.0], []

        def coin(probability, generator):
            if len(taken) < len(script):
                outcome = script[len(taken)]
            else:
                outcome = False
                pending.append(taken + [True])  # the other outcome, run later
            taken.append(outcome)
            weight[0] *= float(probability) if outcome else 1 - float(probability)
            return outcome

        monkeypatch.setattr(tree, "coin", coin)
        monkeypatch.setattr(tree, "sample", lambda target, generator: final.append(target) or -1)
        path, _ = verify_tree_sampled(draft, p, None)
        accepted = tuple(draft.tokens[i] for i in path)
        for token, probability in enumerate(final[0].tolist()):
            emitted[accepted + (token,)] += weight[0] * probability
    return emitted


def first_two_tokens(draft_cases, p0, p1, monkeypatch) -> torch.Tensor:
    """(V, V) joint distribution of the first two new tokens, over the drafts (each with its probability); when a
    step emits one token, the next step samples the second from p1."""
    joint = torch.zeros(V, V, dtype=torch.float64)
    for draft, probability in draft_cases:
        p = torch.stack([p0] + [p1[draft.tokens[i]] if parent == -1 else torch.full((V,), 1.0 / V, dtype=torch.float64)
                                for i, parent in enumerate(draft.parents)])  # (n+1, V): level 2 rows do not matter here
        for tokens, weight in step_distribution(draft, p, monkeypatch).items():
            if len(tokens) >= 2:
                joint[tokens[0], tokens[1]] += probability * weight
            else:
                joint[tokens[0]] += probability * weight * p1[tokens[0]]
    return joint


def layer_skip_trees(q0, q1):
    """Two root children drawn without replacement from q0; the first gets two children from q1[its token]."""
    cases = []
    for (a, b), pa, (qa, qb) in without_replacement(q0, 2):
        for (c, d), pc, (qc, qd) in without_replacement(q1[a], 2):
            cases.append((Draft([a, b, c, d], [qa, qb, qc, qd], "model", [-1, -1, 0, 0]), pa * pc))
    return cases


def one_hot(token: int) -> torch.Tensor:
    return torch.eye(V, dtype=torch.float64)[token]


def held_sparse(cases):
    """The same drafts with every q held sparse, as drafts keep q over a large vocabulary (sampling.kept_q)."""
    return [(replace(draft, probs=[q.to_sparse() for q in draft.probs]), probability) for draft, probability in cases]


def mixed_trees(q0, q1):
    """A copy (one-hot q) first, then a root child sampled from q0 (it may repeat the copy), with a child from q1."""
    return [(Draft([1, y, z], [one_hot(1), q0, q1[y]], "model", [-1, -1, 1]), float(q0[y] * q1[y][z]))
            for y in range(V) for z in range(V) if q0[y] * q1[y][z] > 0]


def test_multi_candidate_rule_emits_exactly_the_target_distribution(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    for trial in range(3):
        p0, q0 = random_distribution(gen, zeros=trial % 2), random_distribution(gen, zeros=1)
        p1 = torch.stack([random_distribution(gen, zeros=trial % 2) for _ in range(V)])
        q1 = torch.stack([random_distribution(gen, zeros=1) for _ in range(V)])
        exact = p0[:, None] * p1  # (V, V): plain sampling of two tokens
        copies = [(Draft([0, 2, 1], [one_hot(0), one_hot(2), one_hot(1)], "ngram", [-1, -1, 0]), 1.0)]
        sparse_copies = [(Draft([0, 2, 1], one_hot_q([0, 2, 1], V, "cpu"), "ngram", [-1, -1, 0]), 1.0)]
        for cases in (layer_skip_trees(q0, q1), copies, mixed_trees(q0, q1)):
            torch.testing.assert_close(first_two_tokens(cases, p0, p1, monkeypatch), exact)
            torch.testing.assert_close(first_two_tokens(held_sparse(cases), p0, p1, monkeypatch), exact)
        torch.testing.assert_close(first_two_tokens(sparse_copies, p0, p1, monkeypatch), exact)
    # the enumeration can tell: forgetting to take a rejected candidate's q out of p is off
    monkeypatch.setattr(tree, "residual", lambda p, q: p)
    assert not torch.allclose(first_two_tokens(layer_skip_trees(q0, q1), p0, p1, monkeypatch), exact)


def test_sampled_branches_are_distinct_with_the_renormalised_q_each_was_drawn_from():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
    chosen = branches(probs, 4, greedy=False, generator=torch.Generator().manual_seed(0))
    tokens = [t for t, _ in chosen]
    assert len(tokens) == 3 and len(set(tokens)) == 3 and 3 not in tokens  # stops once q has no mass left
    rest = probs.clone()
    for token, q in chosen:
        torch.testing.assert_close(q.to_dense(), rest / rest.sum())
        rest[token] = 0.0
    assert branches(probs, 3, greedy=True, generator=None) == [(0, None), (1, None), (2, None)]


def tree_counts(drafter, prompt, n, seed):
    """Counts of (new token 2, new token 3), both decided by one tree step after the prefill's token; and the draft
    sources of the steps that branched (more nodes than their deepest branch)."""
    settings = replace(SAMPLING, temperature=1.0, top_k=3, max_new_tokens=3)
    gen, counts, branched = torch.Generator().manual_seed(seed), defaultdict(int), set()
    for _ in range(n):
        result = generate(MODEL, prompt, GenerationOptions(settings, generator=gen), drafter)
        counts[tuple(result.new_tokens[1:3])] += 1
        branched |= {s.source for s in result.steps if s.tree_size > s.tree_depth}
    return counts, branched


MODEL = tiny_model("llama", num_layers=2, hidden_size=32, seed=3, init_std=0.3).double()
# the first new token is mostly 253, whose earlier occurrences are followed by 253, 157 and 44: a 3-way n-gram trie
COPY_PROMPT = [253, 44, 157, 253, 157, 166, 157, 157, 157, 253]


@pytest.mark.slow
@pytest.mark.parametrize("drafter_kind", ["self_tree", "hybrid_tree", "cost_shaped_tree", "store_tree"])
def test_sampled_tree_verification_matches_plain_sampling_and_a_broken_rule_fails(drafter_kind, monkeypatch):
    """Chi-square goodness of fit of (token 2, token 3) against the exact distribution of plain sampling: the
    layer-skip tree (always two sampled children at each level), and the hybrid (n-gram tries of one-hot copies when
    the first token has earlier occurrences, else that layer-skip tree), and the layer-skip tree whose runner-ups
    the cost-aware policy keeps or drops by their learnt worth (which must not look at the drawn tokens), and the
    token store's tree (two children drawn from its counts at each level; the store: the model's own samples). Leaving
    out the residual update fails (checked on all but the policy's, which branches in too few steps for 500 draws to
    tell)."""
    skip, costs = make_skip_set([], [1], 2), DraftCosts((10.0, 10.5, 11.0, 11.5, 12.0, 12.5, 13.0), 0.5)
    skip_tree = TreeDrafter(SkippedModel(MODEL, skip), DraftExit(2), nodes=6, depth=2, width=2, branch_below=1.0)
    cost_tree = TreeDrafter(SkippedModel(MODEL, skip), CostAwareExit(2, costs=costs), nodes=6, depth=2, width=2)
    samples = replace(SAMPLING, temperature=1.0, top_k=3, max_new_tokens=4)
    gen = torch.Generator().manual_seed(5)
    store = TokenStore.of([generate(MODEL, [5, 40, 77], GenerationOptions(samples, generator=gen)).new_tokens for _ in range(40)],
                          MODEL.get_output_embeddings().weight.shape[0])
    drafter, prompt, sources = {"self_tree": (skip_tree, [5, 40, 77], {"model"}),
                                "hybrid_tree": (HybridDrafter(NgramTreeDrafter(MODEL, 2, 6, 2, 3), skip_tree),
                                                COPY_PROMPT, {"model", "ngram"}),
                                "cost_shaped_tree": (cost_tree, [5, 40, 77], {"model"}),
                                "store_tree": (StoreTreeDrafter(MODEL, store, DraftExit(2), nodes=6, depth=2, width=2,
                                                                branch_below=1.0), [5, 40, 77], {"store"})}[drafter_kind]
    exact = exact_pair_distribution(MODEL, prompt, replace(SAMPLING, temperature=1.0, top_k=3, max_new_tokens=3))
    counts, branched = tree_counts(drafter, prompt, 2000, seed=0)
    assert set(counts) <= set(exact) and branched == sources
    assert chi_square_pvalue(counts, exact) > 0.001
    if drafter_kind == "cost_shaped_tree":
        return
    monkeypatch.setattr(tree, "residual", lambda p, q: p)
    broken, _ = tree_counts(drafter, prompt, 500, seed=1)
    assert chi_square_pvalue(broken, exact) < 0.001
