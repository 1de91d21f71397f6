"""Drafters propose tokens for the full model to verify.

`SelfDrafter` is Draft & Verify: the target model with a skip set, writing into the target's own cache.
`ModelDrafter` is classic speculative decoding with a separate small model (same tokenizer) and its own
cache. Both run the same draft loop; they differ only in which model, cache and pending tokens they use.
`NgramDrafter` copies what followed the latest earlier occurrence of the context's last tokens (prompt lookup),
at no model cost; `HybridDrafter` takes such a copy when there is one and a model draft otherwise.
"""

from dataclasses import dataclass, field

import torch

from selfspec.decoding.draft_exit import DraftExit
from selfspec.decoding.sampling import SamplingSettings, logits_processor, sample, scores
from selfspec.errors import SelfspecError
from selfspec.models.cache import RewindableCache, forward, forward_hidden, new_cache
from selfspec.models.draft_head import DraftHead
from selfspec.models.skip import SkipSet, skipping


NGRAM = "ngram"  # Draft.source of copied drafts: the draft-exit policy did not decide their length


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)  # each (vocab,): q, for sampled verification
    source: str = "model"


def draft_loop(next_logits, tokens: list[int], cached: int, max_tokens: int, exit_policy: DraftExit,
               settings: SamplingSettings, generator, eos_token_id) -> Draft:
    """Feed tokens[cached:] (not yet in the draft's cache), then draft up to `max_tokens` tokens one at a time.

    `next_logits(ids, start) -> (vocab,)` runs the draft model on ids at positions start.. and returns the
    logits of the last position. Stops after a token whose top draft probability is below the policy's
    threshold, or after EOS.
    """
    processor = logits_processor(settings)
    context = list(tokens)
    logits = next_logits(context[cached:], cached)  # (vocab,)
    draft = Draft()
    while True:
        row = scores(logits[None], context, len(context), processor)[0]  # (vocab,)
        probs = torch.softmax(row, dim=-1)
        token = int(row.argmax()) if settings.greedy else sample(probs, generator)
        draft.tokens.append(token)
        if not settings.greedy:
            draft.probs.append(probs)
        context.append(token)
        confidence = float(probs.max())
        if (len(draft.tokens) == max_tokens or token == eos_token_id or exit_policy.should_stop(confidence)):
            return draft
        logits = next_logits([token], len(context) - 1)


class SelfDrafter:
    """The target model with `skip` sublayers left out, over the target's own cache; with a `head`, the
    draft scores only that reduced vocabulary."""

    def __init__(self, model, skip: SkipSet, head: DraftHead | None = None):
        self.model, self.skip, self.head = model, skip, head

    def start(self, prompt_len: int, max_len: int) -> None:
        pass

    def draft(self, cache, tokens, max_tokens, exit_policy, settings, generator, eos_token_id) -> Draft:
        if self.head is None:
            def next_logits(ids, start):
                return forward(self.model, cache, ids, start, last_only=True)[-1]
        else:
            def next_logits(ids, start):
                return self.head.logits(forward_hidden(self.model, cache, ids, start))
        with skipping(self.model, self.skip):
            return draft_loop(next_logits, tokens, len(tokens) - 1, max_tokens, exit_policy, settings, generator,
                              eos_token_id)


class ModelDrafter:
    """A separate, smaller model sharing the target's tokenizer, with its own cache."""

    def __init__(self, model):
        self.model = model
        self.cache: RewindableCache | None = None
        self.cached_tokens: list[int] = []

    def start(self, prompt_len: int, max_len: int) -> None:
        self.cache, self.cached_tokens = new_cache(self.model, max_len), []

    def draft(self, cache, tokens, max_tokens, exit_policy, settings, generator, eos_token_id) -> Draft:
        cached = _common_prefix(self.cached_tokens, tokens, limit=len(tokens) - 1)
        def next_logits(ids, start):
            return forward(self.model, self.cache, ids, start, last_only=True)[-1]

        draft = draft_loop(next_logits, tokens, cached, max_tokens, exit_policy, settings, generator, eos_token_id)
        self.cached_tokens = tokens + draft.tokens[:-1]
        return draft


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = 0
    for x, y in zip(a[:limit], b[:limit]):
        if x != y:
            break
        n += 1
    return n


class NgramDrafter:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the context's last n tokens
    (n = ngram_size down to 1), at most `num_tokens`. A copied draft is deterministic, so q is one-hot: sampled
    verification accepts it with probability p(x) and otherwise resamples from p without x."""

    def __init__(self, model, ngram_size: int = 2, num_tokens: int = 10):
        for name, value in (("ngram_size", ngram_size), ("ngram_tokens", num_tokens)):
            if value < 1:
                raise SelfspecError(f"draft.{name}={value} must be >= 1")
        self.ngram_size, self.num_tokens = ngram_size, num_tokens
        self.vocab_size, self.device = model.get_output_embeddings().weight.shape[0], model.device

    def start(self, prompt_len: int, max_len: int) -> None:
        pass

    def draft(self, cache, tokens, max_tokens, exit_policy, settings, generator, eos_token_id) -> Draft:
        copied = ngram_continuation(tokens, self.ngram_size, min(max_tokens, self.num_tokens))
        if eos_token_id in copied:
            copied = copied[: copied.index(eos_token_id) + 1]
        if settings.greedy:
            return Draft(copied, [], NGRAM)
        one_hot = torch.zeros(len(copied), self.vocab_size, device=self.device)  # (k, vocab)
        one_hot[range(len(copied)), copied] = 1.0
        return Draft(copied, list(one_hot), NGRAM)


def ngram_continuation(tokens: list[int], ngram_size: int, max_tokens: int) -> list[int]:
    for n in range(min(ngram_size, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + max_tokens]
    return []


class HybridDrafter:
    """An n-gram copy when the context has one, else the model drafter's draft."""

    def __init__(self, ngram: NgramDrafter, fallback):
        self.ngram, self.fallback = ngram, fallback

    def start(self, prompt_len: int, max_len: int) -> None:
        self.fallback.start(prompt_len, max_len)

    def draft(self, cache, tokens, max_tokens, exit_policy, settings, generator, eos_token_id) -> Draft:
        draft = self.ngram.draft(cache, tokens, max_tokens, exit_policy, settings, generator, eos_token_id)
        if draft.tokens:
            return draft
        return self.fallback.draft(cache, tokens, max_tokens, exit_policy, settings, generator, eos_token_id)
