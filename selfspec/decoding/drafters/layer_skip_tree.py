"""Draft & Verify's layer-skip draft as a token tree: its chain, plus the runner-up tokens where it is unsure."""

import torch

from selfspec.decoding.draft_exit import DraftExit
from selfspec.decoding.drafters.base import Draft
from selfspec.decoding.drafters.layer_skip import SelfDrafter
from selfspec.decoding.sampling import sample, scores
from selfspec.errors import SelfspecError
from selfspec.models.draft_head import DraftHead
from selfspec.models.skip import SkipSet, skipping


class SelfTreeDrafter(SelfDrafter):
    """The layer-skip draft's chain (its draft-exit policy plans and ends it), and wherever the draft's top probability is
    below `branch_below`, up to `width - 1` more children of the same parent as leaves: the next most likely tokens
    (greedy) or more tokens sampled without replacement (each with the renormalised q it was drawn from). At most
    `nodes` nodes and `depth` levels. Leaves cost no draft forward; the verify forward checks them all at once."""

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
            return self.tree_loop(tokens, depth)

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


def branches(probs: torch.Tensor, width: int, greedy: bool, generator) -> list[tuple[int, torch.Tensor | None]]:
    """Up to `width` distinct tokens from the draft distribution probs (vocab,), each with the q it was drawn from:
    the most likely ones (greedy, q None), or sampled without replacement, q renormalised without the earlier ones."""
    if greedy:
        top = probs.topk(width)
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
