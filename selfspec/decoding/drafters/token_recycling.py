"""Token Recycling (Luo et al., 2024, "Turning Trash into Treasure"): the full model's top-k candidates at every
verified position, which plain verification throws away, kept in an adjacency table and drafted as a token tree.

The table holds, per token id, the k tokens the full model scored highest after that token the last time it was
fed. After every verification each fed token's row is overwritten with the top-k of the scores after it (the
accepted path's rows last, so a token fed twice keeps its accepted context's candidates). A draft expands a static
tree template from the context's last token through the table, breadth first: a template node of rank r holds the
r-th entry of its parent token's row. The table starts empty and persists across a strategy's generations (hot
start): the first step of the first prompt drafts nothing. It relates to the token store (`store_tree`) as a
one-token-context store that costs no training, filled from the full model's scores rather than its outputs.
"""

import heapq

import torch

from selfspec.decoding.drafters.base import STORE, Draft, GenerationContext, Verification, require_positive
from selfspec.decoding.registry import StrategyInputs, StrategySpec
from selfspec.decoding.sampling import one_hot_q
from selfspec.models.devices import output_device

RANK_DECAY = 0.5  # the template's prior: a rank-r candidate is taken to be right RANK_DECAY**r as often as rank 0
TOP_RATE = 0.6  # and rank 0 this often


def tree_template(nodes: int, depth: int, width: int) -> list[tuple[int, int]]:
    """The `nodes` most likely rank paths (at most `depth` long, ranks below `width`) under the prior
    TOP_RATE * RANK_DECAY**rank per level, best first, so parents come before children: per node (parent index,
    rank), parent -1 the root. Each path's first child and next sibling enter the frontier as it is taken."""
    require_positive(recycling_nodes=nodes, recycling_depth=depth, recycling_width=width)
    frontier, taken, index_of = [(-TOP_RATE, (0,))], [], {(): -1}
    while frontier and len(taken) < nodes:
        value, path = heapq.heappop(frontier)
        index_of[path] = len(taken)
        taken.append((index_of[path[:-1]], path[-1]))
        if len(path) < depth:
            heapq.heappush(frontier, (value * TOP_RATE, path + (0,)))
        if path[-1] + 1 < width:
            heapq.heappush(frontier, (value * RANK_DECAY, path[:-1] + (path[-1] + 1,)))
    return taken


class TokenRecyclingDrafter:
    """The adjacency table (vocab, width) of recycled candidates, drafted through `tree_template(nodes, depth,
    width)`. Example: with rows 7 -> [3, 9, ...] and 3 -> [5, ...], after the context's last token 7 the template
    nodes (-1, 0), (-1, 1), (0, 0) draft 3 and 9 as children of the root and 5 after 3."""

    def __init__(self, model, nodes: int = 10, depth: int = 6, width: int = 8):
        self.template = tree_template(nodes, depth, width)
        self.width = width
        self.vocab_size, self.device = model.get_output_embeddings().weight.shape[0], output_device(model)
        self.table = torch.full((self.vocab_size, width), -1, dtype=torch.long)  # -1: no candidate yet
        self.depths = [0] * len(self.template)
        for i, (parent, _) in enumerate(self.template):
            self.depths[i] = 1 + (self.depths[parent] if parent >= 0 else 0)
        self.context: GenerationContext | None = None

    @property
    def max_tokens(self) -> int:
        return len(self.template)

    @property
    def threshold(self) -> float:
        return 0.0

    def begin(self, context: GenerationContext) -> None:
        self.context = context

    def draft(self, tokens: list[int], max_tokens: int) -> Draft:
        """The template expanded from tokens[-1] through the table, at most `max_tokens` levels; a node whose
        parent's row has no candidate at its rank is left out with its subtree."""
        rows, placed = {}, {-1: (tokens[-1], -1)}  # template index -> (token, draft index)
        draft = Draft(source=STORE, parents=[])
        for i, (parent, rank) in enumerate(self.template):
            if parent not in placed or self.depths[i] > max_tokens:
                continue
            parent_token, parent_index = placed[parent]
            if parent_token not in rows:
                rows[parent_token] = self.table[parent_token].tolist()
            token = rows[parent_token][rank]
            if token < 0:
                continue
            placed[i] = (token, len(draft.tokens))
            draft.tokens.append(token)
            draft.parents.append(parent_index)
        if not draft.tokens:
            return Draft()
        if not self.context.settings.greedy:
            draft.probs = one_hot_q(draft.tokens, self.vocab_size, self.device)
        return draft

    def update(self, drafted: int, accepted: int, path: list[int] | None = None, source: str = "model") -> None:
        pass  # the table learns from the scores (observe_verification), not from the counts

    def observe_verify_ms(self, tokens: int, ms: float) -> None:
        pass

    def observe_verification(self, verification: Verification) -> None:
        """Overwrite each fed token's row with the top-`width` tokens of the scores after it."""
        fed = [verification.last] + verification.draft.tokens  # row r of target scores the token after fed[r]
        on_path = [0] + [i + 1 for i in verification.path]
        order = [r for r in range(len(fed)) if r not in set(on_path)] + on_path  # the accepted path's rows win
        latest = {fed[r]: r for r in order}
        top = verification.target[list(latest.values())].topk(self.width, dim=-1)  # (rows, width)
        candidates = top.indices.masked_fill(top.values == float("-inf"), -1).cpu()  # filtered out: no candidate
        self.table[list(latest)] = candidates


def build_token_recycling(inputs: StrategyInputs) -> TokenRecyclingDrafter:
    draft = inputs.draft
    return TokenRecyclingDrafter(inputs.model, draft.recycling_nodes, draft.recycling_depth, draft.recycling_width)


STRATEGIES = (
    StrategySpec("token_recycling", "Token Recycling: every verified position's top-k candidates in an adjacency "
                 "table, drafted as a static token tree (draft.recycling_*)", build_token_recycling),
)
