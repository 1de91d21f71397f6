"""Prompt lookup: copy what followed the latest earlier occurrence of the context's last tokens, at no model cost."""

from array import array

import torch

from selfspec.decoding.draft_exit import DraftExit
from selfspec.decoding.drafters.base import Draft, GenerationContext, cut_at_end
from selfspec.decoding.registry import StrategyInputs, StrategySpec
from selfspec.errors import SelfspecError
from selfspec.models.devices import output_device

NGRAM = "ngram"  # Draft.source of copied drafts


class NgramDrafter:
    """The tokens that followed the latest earlier occurrence of the context's last n tokens (n = ngram_size down
    to 1), at most `num_tokens`. A copied draft is deterministic, so q is one-hot: sampled verification accepts it
    with probability p(x) and otherwise resamples from p without x. Without an exit policy a copy is as long as the
    match allows; with one (the cost-aware policy of self_spec_hybrid), each copied token counts as confidence 1.0
    and the policy cuts the copy where it stops paying."""

    def __init__(self, model, ngram_size: int = 2, num_tokens: int = 10, exit_policy: DraftExit | None = None):
        for name, value in (("ngram_size", ngram_size), ("ngram_tokens", num_tokens)):
            if value < 1:
                raise SelfspecError(f"{name}={value} must be >= 1")
        self.ngram_size, self.num_tokens = ngram_size, num_tokens
        self.vocab_size, self.device = model.get_output_embeddings().weight.shape[0], output_device(model)
        self.exit_policy = exit_policy
        self.context: GenerationContext | None = None

    @property
    def max_tokens(self) -> int:
        return self.num_tokens

    @property
    def threshold(self) -> float:
        return self.exit_policy.threshold if self.exit_policy else 0.0

    def begin(self, context: GenerationContext) -> None:
        self.context = context
        if self.exit_policy:
            self.exit_policy.begin()

    def draft(self, tokens: list[int], max_tokens: int) -> Draft:
        copied = cut_at_end(ngram_continuation(tokens, self.ngram_size, min(max_tokens, self.num_tokens)),
                            self.context.end_ids)
        if self.exit_policy and copied:
            copied = self._cut(copied)
        if self.context.settings.greedy:
            return Draft(copied, [], NGRAM)
        one_hot = torch.zeros(len(copied), self.vocab_size, device=self.device)  # (k, vocab)
        one_hot[range(len(copied)), copied] = 1.0
        return Draft(copied, list(one_hot), NGRAM)

    def observe_verify_ms(self, tokens: int, ms: float) -> None:
        if self.exit_policy:
            self.exit_policy.observe_verify_ms(tokens, ms)

    def update(self, drafted: int, accepted: int, path: list[int] | None = None, source: str = "model") -> None:
        if self.exit_policy:
            self.exit_policy.update(drafted, accepted)

    def _cut(self, copied: list[int]) -> list[int]:
        return cut_copy(self.exit_policy, copied)


def cut_copy(exit_policy: DraftExit, copied: list[int]) -> list[int]:
    """As much of a copy as `exit_policy` drafts: its plan, then a should_stop per copied token (confidence 1.0)."""
    copied = copied[:exit_policy.plan(len(copied))]
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
