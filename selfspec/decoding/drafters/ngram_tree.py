"""Prompt lookup as a token tree: what followed several earlier occurrences of the context's tail, in one trie."""

import torch

from selfspec.decoding.drafters.base import Draft, GenerationContext, cut_at_end
from selfspec.decoding.drafters.ngram import NGRAM
from selfspec.errors import SelfspecError
from selfspec.models.devices import output_device


class NgramTreeDrafter:
    """The distinct continuations of the context's last n tokens (n = ngram_size down to 1, latest match first),
    merged into a trie of at most `nodes` nodes, `depth` levels and `width` children per node. Copies are
    deterministic, so each node's q is one-hot (sampled verification: accept x with probability p(x), else p loses
    x). The first branch is what `NgramDrafter` would copy."""

    threshold = 0.0

    def __init__(self, model, ngram_size: int = 2, nodes: int = 8, depth: int = 5, width: int = 3):
        for name, value in (("ngram_size", ngram_size), ("tree_nodes", nodes), ("tree_depth", depth),
                            ("tree_width", width)):
            if value < 1:
                raise SelfspecError(f"{name}={value} must be >= 1")
        self.ngram_size, self.nodes, self.depth, self.width = ngram_size, nodes, depth, width
        self.vocab_size, self.device = model.get_output_embeddings().weight.shape[0], output_device(model)
        self.context: GenerationContext | None = None

    @property
    def max_tokens(self) -> int:
        return self.nodes

    def begin(self, context: GenerationContext) -> None:
        self.context = context

    def draft(self, tokens: list[int], max_tokens: int) -> Draft:
        draft = Draft(source=NGRAM, parents=[])
        for branch in ngram_continuations(tokens, self.ngram_size, min(max_tokens, self.depth), limit=self.nodes):
            add_branch(draft, cut_at_end(branch, self.context.end_ids), self.nodes, self.width)
        if not draft.tokens:
            return Draft()
        if not self.context.settings.greedy:
            one_hot = torch.zeros(len(draft.tokens), self.vocab_size, device=self.device)  # (n, vocab)
            one_hot[range(len(draft.tokens)), draft.tokens] = 1.0
            draft.probs = list(one_hot)
        return draft

    def update(self, drafted: int, accepted: int) -> None:
        pass


def ngram_continuations(tokens: list[int], ngram_size: int, max_tokens: int, limit: int) -> list[list[int]]:
    """Up to `limit` distinct continuations (at most `max_tokens` long) of earlier occurrences of the context's last
    n tokens, n = ngram_size down to 1, latest occurrence first within each n."""
    found = []
    for n in range(min(ngram_size, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                continuation = tokens[start + n:start + n + max_tokens]
                if continuation not in found:
                    found.append(continuation)
                    if len(found) == limit:
                        return found
    return found


def add_branch(draft: Draft, branch: list[int], nodes: int, width: int) -> None:
    """Merge `branch` into the trie `draft` (tokens and parents) from the root down, sharing the nodes of an equal
    prefix; stop where the trie is full (`nodes`) or the node to extend already has `width` children."""
    parent = -1
    for token in branch:
        siblings = [i for i, p in enumerate(draft.parents) if p == parent]
        same = [i for i in siblings if draft.tokens[i] == token]
        if same:
            parent = same[0]
            continue
        if len(draft.tokens) == nodes or len(siblings) == width:
            return
        draft.tokens.append(token)
        draft.parents.append(parent)
        parent = len(draft.tokens) - 1
