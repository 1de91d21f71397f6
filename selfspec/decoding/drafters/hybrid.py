"""An n-gram copy when the context has one, else a model drafter's draft (self_spec_hybrid): the feature head's where
`draft.head` is set, else the layer-skip draft's. The tree strategy adds the token store's draft where neither
drafts."""

from collections.abc import Generator

import torch

from selfspec.decoding.drafters.base import STORE, Draft, Drafter, DraftForward, GenerationContext
from selfspec.decoding.drafters.feature_head import model_drafter
from selfspec.decoding.drafters.ngram import NGRAM, Copier, NgramDrafter
from selfspec.decoding.registry import StrategyInputs, StrategySpec


class HybridDrafter:
    """The copier's draft where it drafts, else the fallback's, else the `store`'s (a token store's tree; None:
    none). Each drafts up to its own max_tokens, and a verified draft updates the drafter it came from (by
    Draft.source: their acceptance rates differ, so their draft-exit policies learn apart)."""

    def __init__(self, ngram: Copier, fallback: Drafter, store: Drafter | None = None):
        self.ngram, self.fallback, self.store = ngram, fallback, store
        self.drafters = (ngram, fallback) if store is None else (ngram, fallback, store)

    @property
    def max_tokens(self) -> int:
        return max(drafter.max_tokens for drafter in self.drafters)

    @property
    def threshold(self) -> float:
        return self.fallback.threshold

    def begin(self, context: GenerationContext) -> None:
        for drafter in self.drafters:
            drafter.begin(context)

    def draft(self, tokens: list[int], max_tokens: int) -> Draft:
        draft = self.ngram.draft(tokens, max_tokens)
        if not draft.tokens:
            draft = self.fallback.draft(tokens, min(max_tokens, self.fallback.max_tokens))
        return self.or_stored(draft, tokens, max_tokens)

    def or_stored(self, draft: Draft, tokens: list[int], max_tokens: int) -> Draft:
        """`draft`, or where it is empty the store's."""
        if draft.tokens or self.store is None:
            return draft
        return self.store.draft(tokens, min(max_tokens, self.store.max_tokens))

    def batch_draft(self, tokens: list[int], max_tokens: int) -> Generator[DraftForward, torch.Tensor, Draft]:
        """`draft` for a row of a batch: the fallback's draft forwards run with the batch's (where it can)."""
        draft = self.ngram.draft(tokens, max_tokens)
        if draft.tokens:
            return draft
        fallback_tokens = min(max_tokens, self.fallback.max_tokens)
        if hasattr(self.fallback, "batch_draft"):
            draft = yield from self.fallback.batch_draft(tokens, fallback_tokens)
        else:
            draft = self.fallback.draft(tokens, fallback_tokens)
        return self.or_stored(draft, tokens, max_tokens)

    def update(self, drafted: int, accepted: int, path: list[int] | None = None, source: str = "model") -> None:
        by_source = {NGRAM: self.ngram, STORE: self.store}
        (by_source.get(source) or self.fallback).update(drafted, accepted, path, source)

    def observe_verify_ms(self, tokens: int, ms: float) -> None:
        """Each learns every verify's cost: it is the same full-model forward whoever drafted."""
        for drafter in self.drafters:
            drafter.observe_verify_ms(tokens, ms)


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
