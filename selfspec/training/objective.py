"""What a trained draft is scored on: padded batches of training sequences, the part's predictions over them (every
chain step, chains.py), the training loss, and validation, the tokens the head's greedy chains accept included.

Loss per position: `feature_weight` x smooth-L1 between the predicted and the true state, plus `soft_ce_weight` x
the cross-entropy of the draft's distribution against the full model's, both through the model's frozen output
layer's rows `weight`.
"""

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from selfspec.models.devices import loaded_weights
from selfspec.models.feature_head import FeatureHead
from selfspec.models.output_layer import logits_finish, output_logits
from selfspec.training.chains import chain_states, greedy
from selfspec.training.draft_data import TrainingSequence

VALIDATED_STEPS = 4  # the depth of the greedy chains validation drafts (val_chain)


@dataclass
class BatchStates:
    """A right-padded training batch's states (batch_states): the part's predictions and what they are scored
    against. Feature head: position i feeds (h_i, x_{i+1}) and predicts h_{i+1}."""
    predicted: list[torch.Tensor]  # (B, L, hidden) per chain step (chain_states; the Kangaroo adapter: one)
    inputs: torch.Tensor  # (B, L, hidden): the part's input states (h_i for the head), noised where training noises
    targets: torch.Tensor  # (B, L, hidden): the true state each position predicts
    tokens: torch.Tensor  # (B, L + 1) long: the sequences' tokens
    mask: torch.Tensor  # (B, L) long: 1 at a sequence's positions, 0 at padding
    generated: torch.Tensor  # (B, L) bool: the state scores a token the model generated (not its prompt's)


def batch_states(part, model, batch: list[TrainingSequence], noise: float, generator=None,
                 steps: int = 1) -> BatchStates:
    """The part's predictions over right-padded sequences, one per chain step (chains.py; the Kangaroo adapter: one
    step), and what they are scored against. The feature head predicts h_{t+1} from (h_t, x_{t+1}); the Kangaroo
    adapter h_t from the shallow state."""
    feature = isinstance(part, FeatureHead)
    length = max(len(s.tokens) for s in batch) - (1 if feature else 0)
    hidden = batch[0].final.shape[-1]
    inputs = torch.zeros(len(batch), length, hidden, dtype=model.dtype)  # (B, L, hidden)
    targets = torch.zeros(len(batch), length, hidden, dtype=model.dtype)  # (B, L, hidden)
    tokens = torch.zeros(len(batch), length + 1, dtype=torch.long)  # (B, L + 1)
    mask = torch.zeros(len(batch), length, dtype=torch.long)  # (B, L)
    generated = torch.zeros(len(batch), length, dtype=torch.bool)  # (B, L)
    fused = feature and bool(part.fused_layers)  # chain step 1 also reads the head's inner_states at i
    inner = torch.zeros(len(batch), length, batch[0].inner.shape[-1], dtype=model.dtype) if fused else None
    scored = 2 if feature else 1  # the state at position j scores token j + scored
    for row, seq in enumerate(batch):
        n = len(seq.tokens) - (1 if feature else 0)
        inputs[row, :n] = seq.final[:n] if feature else seq.shallow
        targets[row, :n] = seq.final[1:] if feature else seq.final
        if fused:
            inner[row, :n] = seq.inner[:n]
        tokens[row, :len(seq.tokens)] = seq.tokens
        mask[row, :n] = 1
        generated[row, max(seq.prompt_length - scored, 0):n] = True
    if noise:
        inputs = inputs + noise * torch.randn(inputs.shape, generator=generator, dtype=inputs.dtype)
    device = next(part.parameters()).device
    inputs, targets, tokens, mask = inputs.to(device), targets.to(device), tokens.to(device), mask.to(device)
    inner = inner.to(device) if fused else None
    if feature:
        embeds = model.get_input_embeddings()(tokens[:, 1:])  # (B, L, hidden)
        predicted = chain_states(part, inputs, embeds, mask.sum(1).tolist(), steps, inner)
    else:
        positions = torch.arange(length, device=device)[None].expand(len(batch), -1)  # (B, L)
        predicted = [part(inputs_embeds=inputs, position_ids=positions, attention_mask=mask,
                          use_cache=False).last_hidden_state]
    return BatchStates(predicted, inputs, targets, tokens, mask, generated.to(device))


def losses(states: BatchStates, model, weight: torch.Tensor, weights,
           generated_only: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss (N,), agreement (N,) bool, generated (N,) bool) at a batch's N scored positions (all, or those that
    score generated tokens alone) of every chain step in `states` (a step s prediction exists from position s - 1
    on): the weighted loss of the module docstring, with the output layer's rows `weight` (n, hidden); agreement:
    the draft's argmax equals the full model's; generated: the position scores a token the model generated."""
    keep = states.mask.bool() & states.generated if generated_only else states.mask.bool()
    keeps = [keep & (torch.arange(keep.shape[1], device=keep.device) >= step) for step in range(len(states.predicted))]
    predicted = torch.cat([chain[kept] for chain, kept in zip(states.predicted, keeps)])  # (N, hidden)
    targets, generated = (torch.cat([x[kept] for kept in keeps]) for x in (states.targets, states.generated))
    student = torch.log_softmax(output_logits(weight, predicted, logits_finish(model)), dim=-1)  # (N, n)
    with torch.no_grad():
        teacher = torch.softmax(output_logits(weight, targets, logits_finish(model)), dim=-1)  # (N, n)
    loss = weights.soft_ce_weight * -(teacher * student).sum(-1)  # (N,)
    if weights.feature_weight:
        loss = loss + weights.feature_weight * F.smooth_l1_loss(predicted.float(), targets.float(),
                                                                reduction="none").mean(-1)
    return loss, student.argmax(-1) == teacher.argmax(-1), generated


@torch.no_grad()
def validate(part, model, val: list, weight: torch.Tensor, weights, batch_size: int, targets: str = "all") -> dict:
    """The mean loss over the positions training scores (`targets`) of teacher forcing (chain step 1), the argmax
    agreement over every position and over the generated tokens alone (what drafting sees: the prompts' positions
    hold text the model did not write), and for a feature head the tokens its greedy chains of VALIDATED_STEPS
    accept (chain_acceptance), from the same forwards."""
    part.eval()
    feature = isinstance(part, FeatureHead)
    loss, agreement, generated, accepted = [], [], [], []
    for i in range(0, len(val), batch_size):
        states = batch_states(part, model, val[i:i + batch_size], 0.0, steps=VALIDATED_STEPS if feature else 1)
        per_position, agree, made = losses(replace(states, predicted=states.predicted[:1]), model, weight, weights)
        loss.append(per_position), agreement.append(agree), generated.append(made)
        if feature:
            accepted.append(chain_acceptance(states, model, weight))
    loss, agreement, generated = torch.cat(loss), torch.cat(agreement), torch.cat(generated)
    row = {"val_loss": (loss[generated] if targets == "generated" else loss).mean().item(),
           "val_agreement": agreement.float().mean().item(),
           "val_generated_agreement": agreement[generated].float().mean().item()}
    if feature:
        row["val_chain"] = torch.cat(accepted).float().mean().item()
    return row


@torch.no_grad()
def chain_acceptance(states: BatchStates, model, weight: torch.Tensor) -> torch.Tensor:
    """(N,) tokens a greedy chain of up to len(states.predicted) head tokens would have accepted from each of the N
    generated positions where the model's greedy decoding could have stood: its kept token is the model's greedy
    one. A chain goes on while the head's argmax over the scoring rows `weight` (n, hidden) equals the full model's
    there and the sequence's next token is the model's greedy one (a sampled sequence leaves the path a greedy draft
    would take), and ends with its sequence. `states` must be unnoised: its inputs are the true features."""
    finish, valid = logits_finish(model), states.mask.bool()
    on_path = torch.zeros_like(valid)  # (B, L): x_{i+1} is the model's greedy token after x_i
    with loaded_weights(model.get_output_embeddings()) as output_layer:
        on_path[valid] = greedy(output_layer.weight, states.inputs[valid], finish).to(valid.device) == \
            states.tokens[:, 1:][valid]
    counted = states.generated & on_path  # (B, L): the chain starts counted
    going, accepted = counted, torch.zeros_like(counted, dtype=torch.long)  # (B, L) each, by chain start
    for step, predicted in enumerate(states.predicted):  # each step scores only the chains still going
        rows, starts = going[:, :going.shape[1] - step].nonzero(as_tuple=True)
        at = starts + step  # (N,): where each chain's token of this step is scored
        right = on_path[rows, at] & (greedy(weight, predicted[rows, at], finish) ==
                                     greedy(weight, states.targets[rows, at], finish))  # the full model's token
        going = torch.zeros_like(counted)
        going[rows, starts] = right
        accepted += going.long()
    return accepted[counted]
