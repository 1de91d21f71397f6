"""SWIFT's on-the-fly skip-set search (Xia et al., ICLR 2025), in its optimisation phase.

For the first `search_steps` verifications of a generation, each verification scores the incumbent set (at first
the `skip=` set, then the last generation's best) and `candidates` new ones on the current context: a candidate's
parallel draft (one teacher-forced forward of the skipped model over the whole context, in a scratch cache)
predicts each of the context's last `window` tokens, and its score is the share it predicts as the context has it. The paper proposes candidates by random search, then Bayesian optimisation;
here half are the incumbent with one skipped sublayer swapped for a kept one and half are random sets of the same
size, a small search a CPU affords. After the phase the best set drafts the rest of the generation. The other half
of SWIFT, confidence-aware drafting (a draft stops where its top probability falls below a threshold), is the
`threshold` draft exit the strategy drafts under.
"""

import random

import torch

from selfspec.models.cache import forward, new_cache
from selfspec.models.skip import skipping
from selfspec.settings import SkipSet

Sublayer = tuple[int, int]  # (0: attention | 1: MLP, layer)


def as_skip_set(sublayers) -> SkipSet:
    return SkipSet(tuple(sorted(i for kind, i in sublayers if kind == 0)),
                   tuple(sorted(i for kind, i in sublayers if kind == 1)))


def sublayers_of(skip: SkipSet) -> set[Sublayer]:
    return {(0, i) for i in skip.attn} | {(1, i) for i in skip.mlp}


def match_rate(model, skip: SkipSet, tokens: list[int], window: int) -> float:
    """Share of the last `window` tokens that the model with `skip` left out predicts (argmax) from all the ones
    before, in one forward of `tokens` over a scratch cache (the target's cache holds verified entries)."""
    window = min(window, len(tokens) - 1)
    if window < 1:
        return 0.0
    with skipping(model, skip):
        logits = forward(model, new_cache(model, len(tokens)), tokens[:-1], 0)  # (len(tokens) - 1, vocab)
    predicted = logits[-window:].argmax(dim=-1).cpu()  # (window,)
    return float((predicted == torch.tensor(tokens[-window:])).float().mean())


class SwiftSearch:
    """The optimisation phase: proposes and scores candidate sets of `size` sublayers out of `layers` layers' two."""

    def __init__(self, model, layers: int, size: int, candidates: int, window: int, seed: int = 0):
        self.model, self.candidates, self.window = model, candidates, window
        self.all = [(kind, i) for kind in (0, 1) for i in range(layers)]
        self.size = max(1, min(size, len(self.all) - 1))
        self.random = random.Random(seed)

    def neighbour(self, skip: SkipSet) -> SkipSet:
        """`skip` with one skipped sublayer swapped for a kept one (a random set when `skip` is not of `size`)."""
        skipped = sublayers_of(skip)
        if len(skipped) != self.size:
            return self.random_set()
        kept = [item for item in self.all if item not in skipped]
        out, into = self.random.choice(sorted(skipped)), self.random.choice(kept)
        return as_skip_set(skipped - {out} | {into})

    def random_set(self) -> SkipSet:
        return as_skip_set(self.random.sample(self.all, self.size))

    def proposals(self, incumbent: SkipSet) -> list[SkipSet]:
        return [self.neighbour(incumbent) if n % 2 == 0 else self.random_set() for n in range(self.candidates)]

    def best(self, incumbent: SkipSet, tokens: list[int]) -> SkipSet:
        """The best-scoring of the incumbent and this step's proposals on `tokens` (the incumbent wins ties)."""
        scored = [(match_rate(self.model, skip, tokens, self.window), -n, skip)
                  for n, skip in enumerate([incumbent, *self.proposals(incumbent)])]
        return max(scored, key=lambda entry: entry[:2])[2]
