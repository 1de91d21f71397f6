"""An n-gram copy when the context has one, else a model drafter's draft (self_spec_hybrid): the feature head's where
`draft.head` is set, else the layer-skip draft's."""

from collections.abc import Generator

import torch

from selfspec.decoding.drafters.base import Draft, Drafter, DraftForward, GenerationContext
from selfspec.decoding.drafters.feature_head import model_drafter
from selfspec.decoding.drafters.ngram import NGRAM, NgramDrafter
from selfspec.decoding.registry import StrategyInputs, StrategySpec


class HybridDrafter:
    """Each drafts up to its own max_tokens; a verified copy updates the copier, a verified model draft the fallback
    (their acceptance rates differ, so their draft-exit policies learn apart)."""

    def __init__(self, ngram: NgramDrafter, fallback: Drafter):
        self.ngram, self.fallback = ngram, fallback

    @property
    def max_tokens(self) -> int:
        return max(self.ngram.max_tokens, self.fallback.max_tokens)

    @property
    def threshold(self) -> float:
        return self.fallback.threshold

    def begin(self, context: GenerationContext) -> None:
        self.ngram.begin(context)
        self.fallback.begin(context)

    def draft(self, tokens: list[int], max_tokens: int) -> Draft:
        draft = self.ngram.draft(tokens, max_tokens)
        if not draft.tokens:
            draft = self.fallback.draft(tokens, min(max_tokens, self.fallback.max_tokens))
        return draft

    def batch_draft(self, tokens: list[int], max_tokens: int) -> Generator[DraftForward, torch.Tensor, Draft]:
        """`draft` for a row of a batch: the fallback's draft forwards run with the batch's (where it can)."""
        draft = self.ngram.draft(tokens, max_tokens)
        if draft.tokens:
            return draft
        max_tokens = min(max_tokens, self.fallback.max_tokens)
        if getattr(self.fallback, "batch_draft", None) is None:
            return self.fallback.draft(tokens, max_tokens)
        return (yield from self.fallback.batch_draft(tokens, max_tokens))

    def update(self, drafted: int, accepted: int, path: list[int] | None = None, source: str = "model") -> None:
        (self.ngram if source == NGRAM else self.fallback).update(drafted, accepted, path, source)

    def observe_verify_ms(self, tokens: int, ms: float) -> None:
        """Both learn every verify's cost: it is the same full-model forward whoever drafted."""
        self.ngram.observe_verify_ms(tokens, ms)
        self.fallback.observe_verify_ms(tokens, ms)


def build_self_spec_hybrid(inputs: StrategyInputs) -> HybridDrafter:
    """Both drafters under draft.hybrid_policy: a copy costs no draft forward, so under the cost-aware exit it may
    run up to draft.ngram_tokens; other policies stop copies at draft.max_tokens."""
    policy, draft = inputs.hybrid_policy, inputs.draft
    copy_cap = draft.ngram_tokens if policy == "cost" else min(draft.ngram_tokens, draft.max_tokens)
    copier = NgramDrafter(inputs.model, draft.ngram_size, copy_cap, inputs.copy_policy(policy))
    return HybridDrafter(copier, model_drafter(inputs, policy))


STRATEGIES = (
    StrategySpec("self_spec_hybrid", "an n-gram copy when the context has one, else the layer-skip draft (the "
                 "feature head where draft.head is set), under draft.hybrid_policy", build_self_spec_hybrid),
)
