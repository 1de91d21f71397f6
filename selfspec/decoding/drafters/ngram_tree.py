"""Prompt lookup as a token tree: what followed several earlier occurrences of the context's tail, in one trie."""

from selfspec.decoding.draft_exit import CostAwareExit
from selfspec.decoding.drafters.base import Draft, require_positive
from selfspec.decoding.drafters.ngram import NGRAM, Copier, cut_copy
from selfspec.decoding.registry import StrategyInputs, StrategySpec
from selfspec.decoding.sampling import one_hot_q

RANKS = 2  # n-gram tree nodes learnt apart by the rank of their copy: 1, 2 and later


class NgramTreeDrafter(Copier):
    """The context's copies (`ngram_matches`) merged into a trie of at most `nodes` nodes, `depth` levels and
    `width` children per node; its first branch is what `NgramDrafter` would copy.

    With the cost-aware exit the first copy is the chain, cut as `NgramDrafter` cuts it, and the later copies' nodes
    are offered to that policy (`CostAwareExit.shape_tree`), learnt apart by the match length n, the copy's rank and
    whether the node forks off beside an existing sibling: a kind of branch that is rarely accepted stops being
    added, and no copy is drafted where none pays."""

    def __init__(self, model, ngram_size: int = 2, nodes: int = 8, depth: int = 5, width: int = 3,
                 exit_policy: CostAwareExit | None = None):
        super().__init__(model, ngram_size, exit_policy)
        require_positive(tree_nodes=nodes, tree_depth=depth, tree_width=width)
        self.nodes, self.depth, self.width = nodes, depth, width

    @property
    def max_tokens(self) -> int:
        return self.nodes

    def draft(self, tokens: list[int], max_tokens: int) -> Draft:
        copies = self.copies(tokens, min(max_tokens, self.depth), limit=self.nodes)
        if self.policies:
            draft = self.shaped_trie(copies)
        else:
            draft = Draft(source=NGRAM, parents=[])
            for _, branch in copies:
                add_branch(draft, branch, self.nodes, self.width)
        if not draft.tokens:
            return Draft()
        if not self.context.settings.greedy:
            draft.probs = one_hot_q(draft.tokens, self.vocab_size, self.device)
        return draft

    def shaped_trie(self, copies: list[tuple[int, list[int]]]) -> Draft:
        """The first copy, cut by its match length's policy, as the chain; the later copies' nodes as that policy keeps
        them."""
        if not copies:
            return Draft()
        policy = self.policies[copies[0][0]]
        chain = cut_copy(policy, copies[0][1], self.root_forks(policy, copies))
        if not chain:
            return Draft()
        trie = Draft(list(chain), parents=list(range(-1, len(chain) - 1)))
        keys, priors = [], []
        for rank, (n, branch) in enumerate(copies[1:], 1):
            for node in add_branch(trie, branch, self.nodes, self.width):
                parent = trie.parents[node]
                fork = trie.parents.index(parent) < node  # an earlier sibling: the copies part here
                key, prior = node_kind(policy, n, rank, fork, parent == -1)
                keys.append(key)
                priors.append(prior)
        kept, parents = policy.shape_tree(trie.parents[len(chain):], keys, priors, self.nodes)
        return Draft(chain + [trie.tokens[len(chain) + j] for j in kept], source=NGRAM,
                     parents=list(range(-1, len(chain) - 1)) + parents)

    def root_forks(self, policy: CostAwareExit, copies: list[tuple[int, list[int]]]) -> list[float]:
        """P(accepted) of the later copies' first tokens that the trie would fork beside the chain's first token: a
        chain whose first token alone does not pay may pay with them (`CostAwareExit.plan`'s siblings)."""
        firsts, forks = set(copies[0][1][:1]), []
        for rank, (n, branch) in enumerate(copies[1:], 1):
            if branch and branch[0] not in firsts and len(firsts) < min(self.width, self.nodes):
                firsts.add(branch[0])
                forks.append(policy.branch_probability(*node_kind(policy, n, rank, True, True)))
        return forks


def node_kind(policy: CostAwareExit, n: int, rank: int, fork: bool, at_root: bool) -> tuple[tuple, float]:
    """A trie node's key for `CostAwareExit.branch_probability` (the match length n, the copy's rank, whether it
    forks beside an earlier sibling) and its prior: a fork wins only where its earlier siblings lose (beside the
    root, a copy's first token), a node that goes on with its copy as a copy's later tokens do."""
    sibling_rate = policy.first_rate if at_root else policy.later_rate
    return ("ngram", n, min(rank, RANKS), fork), (1 - sibling_rate) / (1 + rank) if fork else policy.later_rate


def add_branch(draft: Draft, branch: list[int], nodes: int, width: int) -> list[int]:
    """Merge `branch` into the trie `draft` (tokens and parents) from the root down, sharing the nodes of an equal
    prefix; stop where the trie is full (`nodes`) or the node to extend already has `width` children. Returns the
    indices of the nodes it added."""
    parent, added = -1, []
    for token in branch:
        siblings = [i for i, p in enumerate(draft.parents) if p == parent]
        same = [i for i in siblings if draft.tokens[i] == token]
        if same:
            parent = same[0]
            continue
        if len(draft.tokens) == nodes or len(siblings) == width:
            return added
        draft.tokens.append(token)
        draft.parents.append(parent)
        parent = len(draft.tokens) - 1
        added.append(parent)
    return added


def build_prompt_lookup_tree(inputs: StrategyInputs) -> NgramTreeDrafter:
    """Under draft.hybrid_policy, as self_spec_hybrid's copies: the cost-aware exit shapes each trie."""
    draft = inputs.draft
    return NgramTreeDrafter(inputs.model, draft.ngram_size, draft.tree_nodes, draft.tree_depth, draft.tree_width,
                            inputs.copy_policy(inputs.hybrid_policy))


STRATEGIES = (
    StrategySpec("prompt_lookup_tree", "several n-gram copies from the context in one token tree (draft.tree_*)",
                 build_prompt_lookup_tree),
)
