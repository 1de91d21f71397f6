"""Draft & Verify's layer-skip draft as a token tree: its chain, plus the runner-up tokens where it is unsure; the
feature head's the same way (self_spec_tree takes it where `draft.head` is set), and the token store's (REST: He et
al., NAACL 2024, "REST: Retrieval-Based Speculative Decoding"; models/token_store.py), which self_spec_tree takes
where `draft.store` is set and neither a copy nor the model draft drafts: the model says the same things in the
same words from answer to answer, and what followed the context's last few tokens in its own earlier generations
is a guess that costs a lookup (tens of microseconds), not a forward."""

import torch

from selfspec.decoding.costs import CONTEXT_IDS, timed_ms
from selfspec.decoding.draft_exit import CostAwareExit, DraftExit, confidence_bin
from selfspec.decoding.drafters.base import STORE, Draft, GenerationContext
from selfspec.decoding.drafters.feature_head import HeadDrafting, HeadFeatures, head_exit_policy, no_skip
from selfspec.decoding.drafters.hybrid import HybridDrafter
from selfspec.decoding.drafters.layer_skip import SelfDrafter
from selfspec.decoding.drafters.ngram import PoliciesByMatch
from selfspec.decoding.drafters.ngram_tree import build_prompt_lookup_tree
from selfspec.decoding.registry import StrategyInputs, StrategySpec
from selfspec.decoding.sampling import sample, scores
from selfspec.errors import SelfspecError
from selfspec.models.draft_head import DraftHead
from selfspec.models.devices import output_device
from selfspec.models.skip import skipping
from selfspec.models.token_store import TokenStore
from selfspec.settings import SkipSet
from selfspec.timing import clock


class SelfTreeDrafter(SelfDrafter):
    """The layer-skip draft's chain (its draft-exit policy plans and ends it), and wherever the draft's top probability is
    below `branch_below`, up to `width - 1` more children of the same parent as leaves: the next most likely tokens
    (greedy) or more tokens sampled without replacement (each with the renormalised q it was drawn from). At most
    `nodes` nodes and `depth` levels. Leaves cost no draft forward; the verify forward checks them all at once.
    Under the cost-aware exit the tree's shape is the policy's: it plans the chain as for a chain draft, and of the
    `width - 1` runner-ups at every chain position it keeps those whose calibrated chance of acceptance pays for
    the wider verify (`CostAwareExit.shape_tree`; `branch_below` is not used)."""
    batch_draft = None  # a tree drafts alone in a batch: its own levels, not SelfDrafter's chain

    def __init__(self, model, skip: SkipSet, exit_policy: DraftExit, head: DraftHead | None = None, nodes: int = 8,
                 depth: int = 5, width: int = 3, branch_below: float = 0.6):
        super().__init__(model, skip, exit_policy, head)
        for name, value in (("tree_nodes", nodes), ("tree_depth", depth), ("tree_width", width)):
            if value < 1:
                raise SelfspecError(f"{name}={value} must be >= 1")
        if not 0.0 <= branch_below <= 1.0:
            raise SelfspecError(f"tree_branch_below={branch_below} is outside [0, 1]")
        self.nodes, self.depth, self.width, self.branch_below = nodes, depth, width, branch_below

    @property
    def max_tokens(self) -> int:
        return self.nodes

    def draft(self, tokens: list[int], max_tokens: int) -> Draft:
        depth = self.exit_policy.plan(min(max_tokens, self.depth))
        if depth == 0:
            return Draft()
        with skipping(self.model, self.skip):
            if isinstance(self.exit_policy, CostAwareExit):
                return self.shaped_tree(tokens, depth)
            return self.tree_loop(tokens, depth)

    def update(self, drafted: int, accepted: int, path: list[int] | None = None, source: str = "model") -> None:
        if path is not None and isinstance(self.exit_policy, CostAwareExit):
            self.exit_policy.update_tree(path)
        else:
            self.exit_policy.update(drafted, accepted)

    def tree_loop(self, tokens: list[int], depth: int) -> Draft:
        """Draft the chain one token at a time over the shared cache, branching at unsure positions."""
        context, settings = self.context, self.context.settings
        history, parent = list(tokens), -1
        logits = self.next_logits(history[-1:], len(history) - 1)  # (vocab,)
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
            logits = self.next_logits([draft.tokens[parent]], len(history) - 1)

    def shaped_tree(self, tokens: list[int], depth: int) -> Draft:
        """The chain as the cost-aware policy drafts it, offering the runner-ups of every position; the policy keeps
        those that pay. A rank-r runner-up is keyed by r and the bin of the r-th largest draft probability, its
        prior: the sorted probabilities, not the sampled token's own, so which leaves join never depends on their
        drawn values (sampled verification stays exact; greedy runner-ups are those top tokens anyway)."""
        context, settings, policy = self.context, self.context.settings, self.exit_policy
        start = clock()  # the verification before ended on the host: nothing of it is still queued
        history = list(tokens)
        logits = self.next_logits(history[-1:], len(history) - 1)  # (vocab,)
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
            logits = self.next_logits([token], len(history) - 1)
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
    the most likely ones (greedy, q None; `top`: probs.topk(width) where the caller has it: a top-k over SmolLM2's
    49,152 ids takes 80 us here, over Gemma-3's 262,144 420 us), or sampled without replacement, q renormalised
    without the earlier ones."""
    if greedy:
        top = probs.topk(width) if top is None else top
        return [(token, None) for token in top.indices[top.values > 0].tolist()]
    chosen, q = [], probs
    for _ in range(width):
        token = sample(q, generator)
        chosen.append((token, q))
        rest = q.clone()
        rest[token] = 0.0
        if rest.sum() <= 0:
            break
        q = rest / rest.sum()
    return chosen


class HeadTreeDrafter(HeadDrafting, SelfTreeDrafter):
    """The feature head's chain, and its runner-up tokens where it is unsure, as a token tree."""

    def __init__(self, model, features: HeadFeatures, exit_policy: DraftExit, nodes: int, depth: int, width: int,
                 branch_below: float):
        super().__init__(model, no_skip(model), exit_policy, features.vocab_head, nodes, depth, width, branch_below)
        self.features = features


class StoreTreeDrafter(SelfTreeDrafter):
    """The token store's chain, and its runner-up tokens where its counts are split, as a token tree: the layer-skip
    tree's drafting with the store's counts for the model's logits (their log, so softmax gives their shares: a
    draft's confidence, and under sampling the q its tokens are drawn from). Its draft-exit policy is one apart per
    length of the longest suffix of the context that the store holds (`PoliciesByMatch`, as a copier's): on SmolLM2's
    held-out outputs the store's top token after a 4-token suffix was right 68-70% of the time where its share of the
    counts was 0.6 or more, after a 1-token suffix 10-19% whatever its share. With one policy for both, runs of
    failed 1-token drafts left the store idle for dozens of QA steps (48-49 on the decision set, 2 with a policy per
    length)."""

    def __init__(self, model, store: TokenStore, exit_policy: DraftExit, nodes: int, depth: int, width: int,
                 branch_below: float):
        super().__init__(model, no_skip(model), exit_policy, None, nodes, depth, width, branch_below)
        self.store, self.device, self.history = store, output_device(model), []
        self.policies = PoliciesByMatch(exit_policy, store.max_n)

    def begin(self, context: GenerationContext) -> None:
        self.context = context
        self.policies.begin()

    def draft(self, tokens: list[int], max_tokens: int) -> Draft:
        self.history = list(tokens)
        self.exit_policy = self.policies[max(self.store.longest_match(tokens)[0], 1)]  # verification updates it
        draft = super().draft(tokens, max_tokens)
        draft.source = STORE
        return draft

    def observe_verify_ms(self, tokens: int, ms: float) -> None:
        self.policies.observe_verify_ms(tokens, ms)

    def next_logits(self, ids: list[int], start: int) -> torch.Tensor:
        self.history[start:] = ids
        return self.store.next_logits(self.history, self.device)


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
    draft, skip, head, policy = inputs.draft, inputs.skip, inputs.draft_head, inputs.hybrid_policy
    shape = (draft.tree_nodes, draft.tree_depth, draft.tree_width, draft.tree_branch_below)
    if inputs.feature_head is None:
        tree = SelfTreeDrafter(inputs.model, skip, inputs.exit_policy(policy, skip, head, alone=True), head, *shape)
    else:
        features = HeadFeatures(inputs.model, inputs.feature_head, head)
        tree = HeadTreeDrafter(inputs.model, features, head_exit_policy(inputs, policy), *shape)
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
