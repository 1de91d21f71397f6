"""Token-tree verification: one full-model forward checks several candidate continuations at once.

A tree draft lists its nodes in topological order, each with its parent's index (-1: the root, the last context
token, which the verify forward feeds first as the chain path does). Node i is fed at position start + its depth,
and an additive attention mask lets it see the cache prefix, its ancestors and itself; on sliding-window layers
only those within the window, by position (the window the chain path gets from transformers' own mask).
Verification walks down from the root and keeps the longest accepted path plus one token; `RewindableCache.compact`
then moves that path's K/V next to the prefix, so the cache holds exactly the kept tokens, as after a chain step.
"""

import torch
from transformers import LogitsProcessorList

from selfspec.decoding.drafters import Draft
from selfspec.decoding.sampling import accept_probability, residual, sample
from selfspec.models.attention_masks import block_mask, block_positions, model_attention_masks
from selfspec.models.cache import RewindableCache, first_visible
from selfspec.models.devices import input_device
from selfspec.models.layouts import base_model
from selfspec.models.output_layer import model_logits


def tree_paths(parents: list[int]) -> list[list[int]]:
    """Per row of [root, nodes...] the node indices from the first level down to that node (the root's: [])."""
    paths = [[]]
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"node {i} has parent {parent}; a parent must come before its child (or be -1, the root)")
        paths.append(paths[parent + 1] + [i])
    return paths


def children(parents: list[int]) -> list[list[int]]:
    """Per row of [root, nodes...] its child nodes in draft order (the order sampled verification tries them)."""
    kids = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents):
        kids[parent + 1].append(i)
    return kids


def tree_block(parents: list[int]) -> list[int]:
    """The parents of [root, nodes...] as one block of a forward (models/attention_masks.py): node i is block token
    i + 1, the root block token 0."""
    tree_paths(parents)  # checks the parents
    return [-1] + [parent + 1 for parent in parents]


def tree_attention_mask(parents: list[int], start: int, dtype: torch.dtype, device,
                        sliding_window: int | None = None) -> torch.Tensor:
    """(1, 1, n+1, start-first+n+1) additive mask for [root, nodes...] fed at cache index `start` on: 0 where a row
    may attend (the cache prefix, its ancestors, itself), the dtype's minimum elsewhere. With `sliding_window`, a
    row at position p sees only keys at positions > p - sliding_window, and the columns start at cache index
    first = max(start - sliding_window + 1, 0), where the keys a sliding cache layer hands attention start."""
    block = tree_block(parents)
    return block_mask([block], [start], start + len(block), dtype, device, sliding_window,
                      first_visible(start, sliding_window))


@torch.inference_mode()
def forward_tree(model, cache: RewindableCache, root: int, draft: Draft, start: int) -> torch.Tensor:
    """Run [root, draft nodes...] over the cache, the root at position `start`; return fp32 logits (n+1, vocab).
    The nodes' K/V land at cache indices start+1.. in draft order."""
    ids = [root] + draft.tokens
    if start + len(ids) > cache.max_len:
        raise RuntimeError(f"cache holds {cache.max_len} positions, asked to write up to {start + len(ids)}")
    cache.rewind(start)
    device = input_device(model)
    block = tree_block(draft.parents)
    hidden = base_model(model)(input_ids=torch.tensor([ids], device=device),
                               position_ids=block_positions([block], [start], device),  # (1, n+1)
                               attention_mask=model_attention_masks(model, [block], [start], start + len(ids), True),
                               past_key_values=cache, use_cache=True).last_hidden_state[0]  # (n+1, hidden)
    return model_logits(model, hidden)


def tree_scores(logits: torch.Tensor, tokens: list[int], draft: Draft, processor: LogitsProcessorList) -> torch.Tensor:
    """Filtered scores (n+1, vocab): each row sees the history it would have in plain decoding, `tokens` and its
    path (rows right-padded with tokens[0], a repeat the set-based repetition penalty ignores)."""
    if not processor:
        return logits
    histories = [tokens + [draft.tokens[i] for i in path] for path in tree_paths(draft.parents)]
    ids = torch.full((len(histories), max(map(len, histories))), tokens[0], dtype=torch.long)
    for row, history in enumerate(histories):
        ids[row, :len(history)] = torch.tensor(history)
    return processor(ids.to(logits.device), logits.clone())


def verify_tree_greedy(draft: Draft, target_scores: torch.Tensor) -> tuple[list[int], int]:
    """Walk from the root along the child equal to the full model's argmax; return (accepted path, next token).

    target_scores: (n+1, vocab), row 0 predicts the first level, row i+1 the children of node i.
    """
    choices = target_scores.argmax(dim=-1).tolist()  # (n+1,)
    kids, path, row = children(draft.parents), [], 0
    while True:
        match = [c for c in kids[row] if draft.tokens[c] == choices[row]]
        if not match:
            return path, choices[row]
        path.append(match[0])
        row = match[0] + 1


def verify_tree_sampled(draft: Draft, p: torch.Tensor, generator) -> tuple[list[int], int]:
    """SpecInfer's multi-candidate speculative sampling: at each node try its children in order, accepting child x
    (drawn from q = draft.probs[x]) with probability min(1, p(x)/q(x)); after a rejection p <- norm(max(0, p - q)).
    A copied candidate has a one-hot q: accepted with probability p(x), else p loses x. If every child is rejected,
    or the node is a leaf, the next token is sampled from the current p. Return (accepted path, next token).

    p: (n+1, vocab) target distributions, row 0 at the root, row i+1 at node i.
    """
    kids, path, row = children(draft.parents), [], 0
    while True:
        target = p[row]  # (vocab,)
        for child in kids[row]:
            x, q = draft.tokens[child], draft.probs[child]
            if coin(accept_probability(target[x], q[x]), generator):
                path.append(child)
                row = child + 1
                break
            target = residual(target, q)
        else:
            return path, sample(target, generator)


def coin(probability: torch.Tensor, generator) -> bool:
    """True with the given probability (a 0-d tensor)."""
    return bool(torch.rand((), generator=generator, device=probability.device, dtype=probability.dtype) < probability)
