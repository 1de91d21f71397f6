"""Draft chains in training and validation: EAGLE-3's training-time test for the feature head.

Live (decoding/drafters/feature_head.py) the head drafts its first token from the full model's true features and
each later one from its own prediction: head position j takes (h_j, x_{j+1}) and predicts h_{j+1}. `chain_states`
runs `steps` such steps over every position of a batch at once. Step 1 is teacher forcing. Step s at position i
takes step s-1's prediction at i-1 and the token x_{i+1}, and attends to what it would see drafting live from
j0 = i - s + 1: step 1's keys (true features) at positions <= j0, and its own chain's keys, step r's at j0 + r - 1.
One DynamicCache holds the steps' keys side by side, step after step; a 4D mask says which ones each step sees.
Validation counts what the chains accept (objective.py's `chain_acceptance`).
"""

import torch
from transformers import DynamicCache

from selfspec.models.attention_masks import mask_windows, masks_by_layer_type
from selfspec.models.feature_head import FeatureHead
from selfspec.models.output_layer import LogitsFinish, output_logits


def chain_mask(lengths: list[int], step: int, width: int, dtype: torch.dtype,
               window: int | None = None) -> torch.Tensor:
    """(rows, 1, width, step x width) additive mask of step `step` over rows of `lengths` head positions (right
    padded to `width`): 0 where query i may attend, the dtype's minimum elsewhere. Keys: step 1's, ..., step s's."""
    query, key = torch.arange(width)[:, None], torch.arange(width)[None, :]
    blocks = [key <= query - step + 1]  # step 1: the true features up to the chain's start
    blocks += [key == query - step + r for r in range(2, step + 1)]  # the chain's own earlier steps, and itself
    allowed = torch.cat(blocks, dim=1)  # (width, step x width)
    if window is not None:  # a sliding-window layer sees keys within the window by position, as transformers' mask
        allowed = allowed & (key.repeat(1, step) > query - window)
    in_row = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).repeat(1, step)  # (rows, step x width)
    allowed = allowed[None] & in_row[:, None, :]  # (rows, width, step x width)
    allowed[:, :, (step - 1) * width:] |= torch.eye(width, dtype=torch.bool)  # every query sees itself: no empty row
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def body_mask(head: FeatureHead, lengths: list[int], step: int, width: int, dtype: torch.dtype, device):
    """The mask argument of the head's one-layer body for step `step` (masks_by_layer_type)."""
    return masks_by_layer_type(mask_windows(head.body.config),
                               lambda window: chain_mask(lengths, step, width, dtype, window).to(device))


def chain_states(head: FeatureHead, features: torch.Tensor, embeds: torch.Tensor, lengths: list[int],
                 steps: int, inner: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The head's predictions (rows, L, hidden) of steps 1..`steps`: step s's at position i predicts h_{i+1} from
    a chain that started at i - s + 1 (meaningless where that is below 0). `features` h_j and `embeds` e(x_{j+1}):
    (rows, L, hidden) each, right padded to rows of `lengths`; `inner` (rows, L, n x hidden): the model's
    inner_states at j, which step 1 alone reads (live, the later steps draft where the model has not run)."""
    rows, width = features.shape[:2]
    positions = torch.arange(width, device=features.device)[None].expand(rows, -1)  # (rows, L)
    padding = (positions < torch.tensor(lengths, device=features.device)[:, None]).long()  # (rows, L)
    cache = DynamicCache()  # no config: every layer keeps all its keys, the steps' side by side
    predicted = [head(features, embeds, positions, cache, attention_mask=padding, inner=inner)]
    for step in range(2, steps + 1):
        fed = torch.cat([torch.zeros_like(predicted[-1][:, :1]), predicted[-1][:, :-1]], dim=1)  # step s-1's at i-1
        mask = body_mask(head, lengths, step, width, embeds.dtype, embeds.device)
        predicted.append(head(fed, embeds, positions, cache, attention_mask=mask))
    return predicted


def greedy(weight: torch.Tensor, hidden: torch.Tensor, finish: LogitsFinish, chunk: int = 512) -> torch.Tensor:
    """(...) argmax over the output rows `weight` (n, hidden) of states `hidden` (..., hidden), a chunk of states at
    a time (all of a long batch's logits at once would take gigabytes)."""
    flat = hidden.reshape(-1, hidden.shape[-1])  # (N, hidden)
    best = [output_logits(weight, flat[i:i + chunk].to(weight.device), finish).argmax(-1)
            for i in range(0, len(flat), chunk)]
    best = torch.cat(best).to(hidden.device) if best else torch.zeros(0, dtype=torch.long, device=hidden.device)
    return best.reshape(hidden.shape[:-1])
