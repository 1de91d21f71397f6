"""Token trees from a token source: the chain, plus the runner-up tokens where the source is unsure. self_spec_tree
drafts them from the layer-skipped model (the feature head where `draft.head` is set), and from the token store
(REST: He et al., NAACL 2024; models/token_store.py) where `draft.store` is set and neither a copy nor the model
draft drafts: what followed the context's last tokens in the model's own earlier generations costs a lookup, not a
forward."""

from contextlib import contextmanager

import torch

from selfspec.decoding.costs import CONTEXT_IDS, timed_ms
from selfspec.decoding.draft_exit import CostAwareExit, DraftExit, confidence_bin
from selfspec.decoding.drafters.base import (STORE, Draft, ExitPolicyDrafter, GenerationContext, TokenSource,
                                            require_positive)
from selfspec.decoding.drafters.feature_head import HeadFeatures, head_exit_policy
from selfspec.decoding.drafters.hybrid import HybridDrafter
from selfspec.decoding.drafters.layer_skip import SkippedModel
from selfspec.decoding.drafters.ngram import PoliciesByMatch
from selfspec.decoding.drafters.ngram_tree import build_prompt_lookup_tree
from selfspec.decoding.registry import StrategyInputs, StrategySpec
from selfspec.decoding.sampling import kept_q, sample, scores
from selfspec.errors import SelfspecError
from selfspec.models.devices import output_device
from selfspec.models.token_store import TokenStore
from selfspec.timing import clock


class TreeDrafter(ExitPolicyDrafter):
    """`source`'s chain (its draft-exit policy plans and ends it), and wherever the chain's top probability is below
    `branch_below`, up to `width - 1` more children of the same parent as leaves: the next most likely tokens
    (greedy) or more tokens sampled without replacement (each with the renormalised q it was drawn from). At most
    `nodes` nodes and `depth` levels; leaves cost no draft forward. Under the cost-aware exit the policy shapes the
    tree instead: of the `width - 1` runner-ups at every chain position it keeps those that pay for the wider
    verify (`CostAwareExit.shape_tree`; `branch_below` is not used)."""

    def __init__(self, source: TokenSource, exit_policy: DraftExit, nodes: int = 8, depth: int = 5, width: int = 3,
                 branch_below: float = 0.6):
        super().__init__(exit_policy)
        require_positive(tree_nodes=nodes, tree_depth=depth, tree_width=width)
        if not 0.0 <= branch_below <= 1.0:
            raise SelfspecError(f"tree_branch_below={branch_below} is outside [0, 1]")
        self.source = source
        self.nodes, self.depth, self.width, self.branch_below = nodes, depth, width, branch_below

    @property
    def max_tokens(self) -> int:
        return self.nodes

    def begin(self, context: GenerationContext) -> None:
        super().begin(context)
        self.source.begin(context)

    def draft(self, tokens: list[int], max_tokens: int) -> Draft:
        depth = self.exit_policy.plan(min(max_tokens, self.depth))
        if depth == 0:
            return Draft()
        with self.source.drafting(tokens):
            if isinstance(self.exit_policy, CostAwareExit):
                return self.shaped_tree(tokens, depth)
            return self.tree_loop(tokens, depth)

    def update(self, drafted: int, accepted: int, path: list[int] | None = None, source: str = "model") -> None:
        if path is not None and isinstance(self.exit_policy, CostAwareExit):
            self.exit_policy.update_tree(path)
        else:
            self.exit_policy.update(drafted, accepted)

    def tree_loop(self, tokens: list[int], depth: int) -> Draft:
        """Draft the chain one token at a time, branching at unsure positions."""
        context, settings = self.context, self.context.settings
        history, parent = list(tokens), -1
        logits = self.source.next_logits(history[-1:], len(history) - 1)  # (vocab,)
        draft = Draft(parents=[])
        while True:
            row = scores(logits[None], history, len(history), context.processor)[0]  # (vocab,)
            probs = torch.softmax(row, dim=-1)
            confidence = float(probs.max())
            width = self.width if confidence < self.branch_below else 1
            chosen = branches(probs, min(width, self.nodes - len(draft.tokens)), settings.greedy, context.generator)
            for token, q in chosen:
                draft.tokens.append(token)
                draft.parents.append(parent)
                if not settings.greedy:
                    draft.probs.append(q)
            parent = len(draft.tokens) - len(chosen)  # the chain goes on from the first (most likely) child
            history.append(draft.tokens[parent])
            if (self.exit_policy.should_stop(confidence) or len(history) - len(tokens) == depth
                    or len(draft.tokens) == self.nodes or draft.tokens[parent] in context.end_ids):
                return draft
            logits = self.source.next_logits([draft.tokens[parent]], len(history) - 1)

    def shaped_tree(self, tokens: list[int], depth: int) -> Draft:
        """The chain as the cost-aware policy drafts it, offering the runner-ups of every position; the policy keeps
        those that pay. A rank-r runner-up is keyed by r and the bin of the r-th largest draft probability, its
        prior: the sorted probabilities, not the sampled token's own, so which leaves join never depends on their
        drawn values (sampled verification stays exact)."""
        context, settings, policy = self.context, self.context.settings, self.exit_policy
        start = clock()  # the verification before ended on the host: nothing of it is still queued
        history = list(tokens)
        logits = self.source.next_logits(history[-1:], len(history) - 1)  # (vocab,)
        chain, chain_q, offered = [], [], []  # offered: (parent, token, q, key, prior)
        while True:
            row = scores(logits[None], history, len(history), context.processor)[0]  # (vocab,)
            probs = torch.softmax(row, dim=-1)
            top = probs.topk(self.width)  # (width,): greedy's branches, and the runner-ups' priors
            (token, q), *runner_ups = branches(probs, self.width, settings.greedy, context.generator, top)
            priors = top.values.tolist()
            for rank, (other, other_q) in enumerate(runner_ups, 1):
                offered.append((len(chain) - 1, other, other_q, ("model", rank, confidence_bin(priors[rank])),
                                priors[rank]))
            chain.append(token)
            chain_q.append(q)
            history.append(token)
            if (policy.should_stop(priors[0]) or len(chain) == depth or len(chain) == self.nodes
                    or token in context.end_ids):
                break
            logits = self.source.next_logits([token], len(history) - 1)
        policy.observe_draft_ms(1000 * (clock(logits.device) - start) / len(chain))
        kept, parents = policy.shape_tree([o[0] for o in offered], [o[3] for o in offered], [o[4] for o in offered],
                                          self.nodes)
        draft = Draft(chain + [offered[j][1] for j in kept], parents=list(range(-1, len(chain) - 1)) + parents)
        if not settings.greedy:
            draft.probs = chain_q + [offered[j][2] for j in kept]
        return draft


def branches(probs: torch.Tensor, width: int, greedy: bool, generator, top: torch.return_types.topk | None = None
             ) -> list[tuple[int, torch.Tensor | None]]:
    """Up to `width` distinct tokens from the draft distribution probs (vocab,), each with the q it was drawn from:
    the most likely ones (greedy, q None; `top`: probs.topk(width) where the caller has it, a top-k over a large
    vocabulary being dear), or sampled without replacement, q renormalised without the earlier ones."""
    if greedy:
        top = probs.topk(width) if top is None else top
        return [(token, None) for token in top.indices[top.values > 0].tolist()]
    chosen, q = [], probs
    for _ in range(width):
        token = sample(q, generator)
        chosen.append((token, kept_q(q)))
        rest = q.clone()
        rest[token] = 0.0
        if rest.sum() <= 0:
            break
        q = rest / rest.sum()
    return chosen


class StoreSource:
    """A token store as a token source: the log of its counts after the context's longest suffix it holds, so
    softmax gives their shares (a draft's confidence, and under sampling the q its tokens are drawn from)."""

    def __init__(self, store: TokenStore, device):
        self.store, self.device, self.history = store, device, []

    def begin(self, context: GenerationContext) -> None:
        pass

    @contextmanager
    def drafting(self, tokens: list[int]):
        self.history = list(tokens)
        yield

    def next_logits(self, ids: list[int], start: int) -> torch.Tensor:
        self.history[start:] = ids
        return self.store.next_logits(self.history, self.device)


class StoreTreeDrafter(TreeDrafter):
    """The token store's tree, under a draft-exit policy per length of the longest suffix of the context that the
    store holds (`PoliciesByMatch`, as a copier's): the store's top token after a 4-token suffix is right far more
    often than after a 1-token one, and with one policy for both, runs of failed 1-token drafts left the store idle
    where longer suffixes would have paid."""

    def __init__(self, model, store: TokenStore, exit_policy: DraftExit, nodes: int, depth: int, width: int,
                 branch_below: float):
        super().__init__(StoreSource(store, output_device(model)), exit_policy, nodes, depth, width, branch_below)
        self.store, self.policies = store, PoliciesByMatch(exit_policy, store.max_n)

    def begin(self, context: GenerationContext) -> None:
        self.context = context
        self.policies.begin()

    def draft(self, tokens: list[int], max_tokens: int) -> Draft:
        self.exit_policy = self.policies[max(self.store.longest_match(tokens)[0], 1)]  # verification updates it
        draft = super().draft(tokens, max_tokens)
        draft.source = STORE
        return draft

    def observe_verify_ms(self, tokens: int, ms: float) -> None:
        self.policies.observe_verify_ms(tokens, ms)


def store_tree(inputs: StrategyInputs, policy: str) -> StoreTreeDrafter:
    """The token store's tree under `policy`; the cost-aware one priced with a lookup's measured cost."""
    store, draft = inputs.token_store, inputs.draft
    costs = None
    if policy == "cost":
        device = output_device(inputs.model)
        costs = inputs.costs.costs_of(("token_store", id(store)),
                                      lambda: timed_ms(lambda: store.next_logits(CONTEXT_IDS, device), device))
    return StoreTreeDrafter(inputs.model, store, inputs.make_exit_policy(policy, costs), draft.tree_nodes,
                            draft.tree_depth, draft.tree_width, draft.tree_branch_below)


def build_self_spec_tree(inputs: StrategyInputs) -> HybridDrafter:
    """prompt_lookup_tree's trie when the context has matches, else the model draft's tree (the feature head's where
    draft.head is set, else the layer-skip draft's), else the token store's tree (where draft.store is set); all under
    draft.hybrid_policy, where the cost-aware exit shapes each tree (depth, branches, none) from the measured costs."""
    draft, skip, head, policy = inputs.draft, inputs.skip, inputs.draft_vocabulary, inputs.hybrid_policy
    shape = (draft.tree_nodes, draft.tree_depth, draft.tree_width, draft.tree_branch_below)
    if inputs.feature_head is None:
        tree = TreeDrafter(SkippedModel(inputs.model, skip, head), inputs.exit_policy(policy, skip, head, alone=True),
                           *shape)
    else:
        tree = TreeDrafter(HeadFeatures(inputs.model, inputs.feature_head, head), head_exit_policy(inputs, policy),
                           *shape)
    store = store_tree(inputs, policy) if inputs.token_store is not None else None
    return HybridDrafter(build_prompt_lookup_tree(inputs), tree, store)


def build_store_tree(inputs: StrategyInputs) -> StoreTreeDrafter:
    inputs.require_token_store("store_tree")
    return store_tree(inputs, inputs.hybrid_policy)


STRATEGIES = (
    StrategySpec("self_spec_tree", "prompt_lookup_tree's trie when the context has matches, else the layer-skip draft "
                 "(the feature head where draft.head is set) branching where it is unsure, else the token store's "
                 "tree (draft.store)", build_self_spec_tree),
    StrategySpec("store_tree", "the token store alone (draft.store: the model's own generations), branching where its "
                 "counts are split", build_store_tree),
)
