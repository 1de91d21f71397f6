"""Draft chains in training and validation: EAGLE-3's training-time test for the feature head.

Live (decoding/drafters/feature_head.py) the head drafts its first token from the full model's true features and
each later one from its own prediction: head position j takes (h_j, x_{j+1}) and predicts h_{j+1}. `chain_states`
runs `steps` such steps over every position of a batch at once. Step 1 is teacher forcing. Step s at position i
takes step s-1's prediction at i-1 and the token x_{i+1}, and attends to what it would see drafting live from
j0 = i - s + 1: step 1's keys (true features) at positions <= j0, and its own chain's keys, step r's at j0 + r - 1.
One DynamicCache holds the steps' keys side by side, step after step; a 4D mask says which ones each step sees.

`chain_acceptance` is what a greedy chain of the head would have accepted on held-out sequences, every generated
position a chain start: teacher-forced agreement alone measures the first draft token only.
"""

import torch
from transformers import DynamicCache
from transformers.cache_utils import get_layer_types_and_kwargs

from selfspec.models.feature_head import FeatureHead
from selfspec.models.devices import loaded_weights
from selfspec.models.output_layer import LogitsFinish, logits_finish, output_logits


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
    """The mask argument of the head's one-layer body for step `step`: one 4D mask, or one per layer type where
    the family picks masks by type (Gemma-2, Gemma-3)."""
    config = head.body.config
    full = chain_mask(lengths, step, width, dtype).to(device)
    if "sliding_attention" not in get_layer_types_and_kwargs(config)[0]:
        return full
    sliding = chain_mask(lengths, step, width, dtype, config.sliding_window).to(device)
    return {"full_attention": full, "sliding_attention": sliding} if getattr(config, "layer_types", None) else sliding


def chain_states(head: FeatureHead, features: torch.Tensor, embeds: torch.Tensor, lengths: list[int],
                 steps: int) -> list[torch.Tensor]:
    """The head's predictions (rows, L, hidden) of steps 1..`steps`: step s's at position i predicts h_{i+1} from
    a chain that started at i - s + 1 (meaningless where that is below 0). `features` h_j and `embeds` e(x_{j+1}):
    (rows, L, hidden) each, right padded to rows of `lengths`."""
    rows, width = features.shape[:2]
    positions = torch.arange(width, device=features.device)[None].expand(rows, -1)  # (rows, L)
    padding = (positions < torch.tensor(lengths, device=features.device)[:, None]).long()  # (rows, L)
    cache = DynamicCache()  # no config: every layer keeps all its keys, the steps' side by side
    predicted = [head(features, embeds, positions, cache, attention_mask=padding)]
    for step in range(2, steps + 1):
        fed = torch.cat([torch.zeros_like(predicted[-1][:, :1]), predicted[-1][:, :-1]], dim=1)  # step s-1's at i-1
        mask = body_mask(head, lengths, step, width, embeds.dtype, embeds.device)
        predicted.append(head(fed, embeds, positions, cache, attention_mask=mask))
    return predicted


@torch.no_grad()
def chain_acceptance(head: FeatureHead, model, batch: list, weight: torch.Tensor, steps: int) -> torch.Tensor:
    """(N,) tokens a greedy chain of up to `steps` head tokens would have accepted from each of the N generated
    positions of `batch` (TrainingSequences) where the model's greedy decoding could have stood: its kept token is
    the model's greedy one. A chain goes on while the head's argmax over the scoring rows `weight` (n, hidden)
    equals the full model's there and the sequence's next token is the model's greedy one (a sampled sequence
    leaves the path a greedy draft would take)."""
    device = next(head.parameters()).device
    width = max(len(s.tokens) for s in batch) - 1  # head positions: every token but the last has a next one
    features = torch.zeros(len(batch), width, batch[0].final.shape[-1], dtype=model.dtype)  # (rows, L, hidden): h_i
    targets = torch.zeros_like(features)  # (rows, L, hidden): h_{i+1}
    tokens = torch.zeros(len(batch), width + 1, dtype=torch.long)  # (rows, L + 1)
    starts = torch.zeros(len(batch), width, dtype=torch.bool)  # (rows, L): generated positions, chain starts
    for row, seq in enumerate(batch):
        n = len(seq.tokens) - 1
        features[row, :n], targets[row, :n], tokens[row, :n + 1] = seq.final[:-1], seq.final[1:], seq.tokens
        starts[row, max(seq.prompt_length - 2, 0):n] = True
    features, targets, tokens = features.to(device), targets.to(device), tokens.to(device)
    finish = logits_finish(model)
    teacher = greedy(weight, targets, finish)  # (rows, L): the full model's token after x_{i+1}
    with loaded_weights(model.get_output_embeddings()) as output_layer:
        on_path = greedy(output_layer.weight, features, finish).to(device) == tokens[:, 1:]  # (rows, L): x_{i+1}
    embeds = model.get_input_embeddings()(tokens[:, 1:]).to(features.dtype)  # (rows, L, hidden): e(x_{i+1})
    accepted = torch.zeros(len(batch), width, dtype=torch.long, device=device)  # (rows, L) by chain start
    going = torch.ones(len(batch), width, dtype=torch.bool, device=device)  # (rows, L) by chain start
    lengths = [len(s.tokens) - 1 for s in batch]
    for step, predicted in enumerate(chain_states(head, features, embeds, lengths, steps)):
        right = (greedy(weight, predicted, finish) == teacher) & on_path  # (rows, L) at position i
        going &= torch.cat([right[:, step:], torch.zeros_like(right[:, :step])], dim=1)  # by start i - step
        accepted += going.long()
    return accepted[starts.to(device) & on_path]


def greedy(weight: torch.Tensor, hidden: torch.Tensor, finish: LogitsFinish, chunk: int = 512) -> torch.Tensor:
    """(rows, L) argmax over the output rows `weight` (n, hidden) of states `hidden` (rows, L, hidden), a chunk of
    positions at a time (all of a long batch's logits at once would take gigabytes)."""
    flat = hidden.reshape(-1, hidden.shape[-1])  # (rows x L, hidden)
    best = [output_logits(weight, flat[i:i + chunk].to(weight.device), finish).argmax(-1)
            for i in range(0, len(flat), chunk)]
    return torch.cat(best).to(hidden.device).reshape(hidden.shape[:-1])
