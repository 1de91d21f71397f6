"""Prompt lookup: copy what followed the latest earlier occurrence of the context's last tokens, at no model cost."""

import copy
from array import array
from collections.abc import Sequence

import torch

from selfspec.decoding.draft_exit import DraftExit
from selfspec.decoding.drafters.base import Draft, GenerationContext, cut_at_end
from selfspec.decoding.registry import StrategyInputs, StrategySpec
from selfspec.errors import SelfspecError
from selfspec.models.devices import output_device

NGRAM = "ngram"  # Draft.source of copied drafts


class PoliciesByMatch:
    """A drafter's draft-exit policy, one apart per match length n = 1..longest: a copier's n-gram match, or the
    longest suffix of the context a token store holds (StoreTreeDrafter). Copies after a longer match are right far
    more often (SmolLM2's outputs on the evaluation halves: the first token of a copy after a 2-token match in 80% of
    positions, after a 1-token match in 24%), so one rate for both let a run of failed 1-token copies stop the
    2-token ones too, which then stayed idle through the next answers (retrieval read 1.00 tokens per verification
    where always copying would have made 1.64). The tree kinds' counts (`branch_counts`) are shared; `exit_policy`,
    the one for n = longest, is every policy's template."""

    def __init__(self, exit_policy: DraftExit, longest: int):
        self.by_n = {longest: exit_policy} | {n: copy.deepcopy(exit_policy) for n in range(1, longest)}
        for policy in self.by_n.values():
            if hasattr(policy, "branch_counts"):
                policy.branch_counts = exit_policy.branch_counts
        self.last = exit_policy  # the policy of the last draft's match, which its verification updates

    def __getitem__(self, n: int) -> DraftExit:
        self.last = self.by_n[n]
        return self.last

    def begin(self) -> None:
        for policy in self.by_n.values():
            policy.begin()

    def observe_verify_ms(self, tokens: int, ms: float) -> None:
        for policy in self.by_n.values():
            policy.observe_verify_ms(tokens, ms)


class NgramDrafter:
    """The tokens that followed the latest earlier occurrence of the context's last n tokens (n = ngram_size down
    to 1), at most `num_tokens`. A copied draft is deterministic, so q is one-hot: sampled verification accepts it
    with probability p(x) and otherwise resamples from p without x. Without an exit policy a copy is as long as the
    match allows; with one (the cost-aware policy of self_spec_hybrid), each copied token counts as confidence 1.0
    and the policy cuts the copy where it stops paying: the policy of the match's length (`PoliciesByMatch`)."""

    def __init__(self, model, ngram_size: int = 2, num_tokens: int = 10, exit_policy: DraftExit | None = None):
        for name, value in (("ngram_size", ngram_size), ("ngram_tokens", num_tokens)):
            if value < 1:
                raise SelfspecError(f"{name}={value} must be >= 1")
        self.ngram_size, self.num_tokens = ngram_size, num_tokens
        self.vocab_size, self.device = model.get_output_embeddings().weight.shape[0], output_device(model)
        self.exit_policy = exit_policy
        self.policies = PoliciesByMatch(exit_policy, ngram_size) if exit_policy else None
        self.context: GenerationContext | None = None

    @property
    def max_tokens(self) -> int:
        return self.num_tokens

    @property
    def threshold(self) -> float:
        return self.policies.last.threshold if self.policies else 0.0

    def begin(self, context: GenerationContext) -> None:
        self.context = context
        if self.policies:
            self.policies.begin()

    def draft(self, tokens: list[int], max_tokens: int) -> Draft:
        match = ngram_matches(tokens, self.ngram_size, min(max_tokens, self.num_tokens), limit=1)
        copied = cut_at_end(match[0][1], self.context.end_ids) if match else []
        if self.policies and copied:
            copied = cut_copy(self.policies[match[0][0]], copied)
        if self.context.settings.greedy:
            return Draft(copied, [], NGRAM)
        one_hot = torch.zeros(len(copied), self.vocab_size, device=self.device)  # (k, vocab)
        one_hot[range(len(copied)), copied] = 1.0
        return Draft(copied, list(one_hot), NGRAM)

    def observe_verify_ms(self, tokens: int, ms: float) -> None:
        if self.policies:
            self.policies.observe_verify_ms(tokens, ms)

    def update(self, drafted: int, accepted: int, path: list[int] | None = None, source: str = "model") -> None:
        if self.policies:
            self.policies.last.update(drafted, accepted)


def cut_copy(exit_policy: DraftExit, copied: list[int], siblings: Sequence[float] = ()) -> list[int]:
    """As much of a copy as `exit_policy` drafts: its plan (with a trie's `siblings` of the copy's first token, under
    the cost-aware exit), then a should_stop per copied token (confidence 1.0)."""
    copied = copied[:exit_policy.plan(len(copied), siblings)]
    for length in range(1, len(copied) + 1):
        if exit_policy.should_stop(1.0):
            return copied[:length]
    return copied


def ngram_continuation(tokens: list[int], ngram_size: int, max_tokens: int) -> list[int]:
    """What followed the latest occurrence of the longest matching tail: the first of `ngram_matches`, or []."""
    first = ngram_matches(tokens, ngram_size, max_tokens, limit=1)
    return first[0][1] if first else []


def ngram_matches(tokens: list[int], ngram_size: int, max_tokens: int, limit: int) -> list[tuple[int, list[int]]]:
    """Up to `limit` distinct continuations (at most `max_tokens` long) of earlier occurrences of the context's last
    n tokens, n = ngram_size down to 1, latest occurrence first within each n; each with its n. The context is
    searched as bytes, 4 a token (`bytes.rfind` runs in C; a match must start on a token's first byte)."""
    data = array("i", tokens).tobytes()
    found, seen = [], []
    for n in range(min(ngram_size, len(tokens) - 1), 0, -1):
        tail, end = data[-4 * n:], 4 * (len(tokens) - 1)  # an occurrence ends before the last token
        while (at := data.rfind(tail, 0, end)) >= 0:
            end = at + 4 * n - 1  # the next search finds occurrences starting before this one
            if at % 4:
                continue
            continuation = tokens[at // 4 + n:at // 4 + n + max_tokens]
            if continuation not in seen:
                seen.append(continuation)
                found.append((n, continuation))
                if len(found) == limit:
                    return found
    return found


def build_prompt_lookup(inputs: StrategyInputs) -> NgramDrafter:
    """Copies as long as the match allows, up to draft.ngram_tokens: no exit policy."""
    return NgramDrafter(inputs.model, inputs.draft.ngram_size, inputs.draft.ngram_tokens)


STRATEGIES = (
    StrategySpec("prompt_lookup", "n-gram copies from the context only, no draft model (prompt lookup)",
                 build_prompt_lookup),
)
