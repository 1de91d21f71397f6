"""A cost-aware knapsack over sublayers (as KnapSpec): skip the attention and MLP sublayers that maximise expected
tokens per second, E[emitted] / (k d(S) + c(k + 1)).

Items are each layer's attention and MLP sublayers. An item's cost is its time in a one-token step on this machine
(costs.sublayer_ms, measured once per model), so skipping set S drafts a token in d(S) = c(1) - sum of S's times.
An item's value is the agreement lost by skipping it, read from the verification's layer states: the cosine distance
between the full model's final state h_L and h_L without that sublayer's output. Per-token acceptance is modelled
as a(S) = exp(-lambda * sum of S's losses), lambda fitted to the acceptance the drafts have met so far. Items are
taken in order of loss per millisecond saved (the greedy knapsack order) and the prefix and draft length k with the
best expected tokens per second win; the empty set with k = 0 is plain decoding, so the choice never models slower.
"""

import math
from dataclasses import dataclass
from functools import cache

import torch

from selfspec.decoding.costs import DraftCosts, expected_emitted, measure_step_costs
from selfspec.decoding.skip_choice.capture import LayerStates
from selfspec.settings import SkipSet

MIN_ACCEPTANCE = 0.02  # the fitted acceptance never reads as 0 (lambda stays finite)


@dataclass(frozen=True)
class SublayerPrices:
    """Milliseconds on this machine: c(q) and what each sublayer takes out of a one-token step."""
    verify_ms: tuple[float, ...]  # [q - 1]: c(q)
    attn_ms: tuple[float, ...]  # per layer
    mlp_ms: tuple[float, ...]

    def draft_costs(self, skip: SkipSet) -> DraftCosts:
        saved = sum(self.attn_ms[i] for i in skip.attn) + sum(self.mlp_ms[i] for i in skip.mlp)
        return DraftCosts(self.verify_ms, max(self.verify_ms[0] - saved, 0.0))


@cache
def measured_sublayers(model) -> tuple[float, tuple[float, ...], tuple[float, ...]]:
    """(c(1), attention ms, MLP ms) of `model`'s one-token step, measured once per model."""
    step = measure_step_costs(model, 1)
    return step.verify_ms[0], tuple(step.attn_ms), tuple(step.mlp_ms)


def sublayer_prices(model, verify_ms: tuple[float, ...]) -> SublayerPrices:
    """The sublayer times at the pace of `verify_ms` (the run's CostMeter c(q)): scaled by its c(1) over ours."""
    plain_ms, attn, mlp = measured_sublayers(model)
    scale = verify_ms[0] / plain_ms
    return SublayerPrices(verify_ms, tuple(ms * scale for ms in attn), tuple(ms * scale for ms in mlp))


def sublayer_losses(states: LayerStates) -> torch.Tensor:
    """(2, layers): each attention (row 0) and MLP (row 1) sublayer's cosine distance from h_L when left out."""
    final = states.hidden[-1]  # (hidden,)
    without = final[None, None] - torch.stack([states.attn, states.mlp])  # (2, layers, hidden)
    return (1 - torch.cosine_similarity(without, final[None, None], dim=-1)).clamp(min=0.0)


def fitted_lambda(skip: SkipSet, losses: torch.Tensor, acceptance: float) -> float | None:
    """lambda with exp(-lambda * loss(skip)) = `acceptance`; None when `skip` loses nothing to fit to."""
    loss = float(losses[0, list(skip.attn)].sum() + losses[1, list(skip.mlp)].sum())
    if loss <= 0:
        return None
    return -math.log(max(acceptance, MIN_ACCEPTANCE)) / loss


def knapsack_skip(losses: torch.Tensor, prices: SublayerPrices, lam: float, max_tokens: int) -> tuple[SkipSet, float]:
    """(skip set, modelled speedup over plain) with the best expected tokens per second over prefixes of the items in
    loss-per-millisecond order and draft lengths 1..max_tokens (the empty set: plain, speedup 1)."""
    layers = losses.shape[1]
    items = [(kind, i) for kind in (0, 1) for i in range(layers)]
    cost = lambda item: (prices.attn_ms, prices.mlp_ms)[item[0]][item[1]]
    items.sort(key=lambda item: float(losses[item]) / max(cost(item), 1e-9))
    best, best_speedup = SkipSet(), 1.0
    for n in range(1, len(items)):  # never every sublayer
        chosen = items[:n]
        skip = SkipSet(tuple(sorted(i for kind, i in chosen if kind == 0)),
                       tuple(sorted(i for kind, i in chosen if kind == 1)))
        acceptance = math.exp(-lam * sum(float(losses[item]) for item in chosen))
        costs = prices.draft_costs(skip)
        for k in range(1, min(max_tokens, len(prices.verify_ms) - 1) + 1):
            speedup = costs.speedup(expected_emitted(acceptance, k), k)
            if speedup > best_speedup:
                best, best_speedup = skip, speedup
    return best, best_speedup
