"""What every drafter is: the `Drafter` protocol (two verbs, as transformers' candidate generators), the draft it
returns, and the chain drafter: one token at a time from a `TokenSource` under a draft-exit policy.

The decoding loop (decoding/speculative.py) calls `begin` once per generation, then per step `draft` and `update`.
A drafter that learns from the full model's scores (Token Recycling, Lookahead) also offers
`observe_verification(verification)`, told every step's `Verification`, drafted or not.
A drafter may also offer `batch_draft(tokens, max_tokens)`, its draft as a generator of `DraftForward`s, so a batch
(decoding/batch.py) runs its rows' draft forwards together (the layer-skip chain); without it, a row drafts alone.
"""

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from collections.abc import Callable, Generator
from functools import partial
from typing import Protocol

import torch
from transformers import LogitsProcessorList

from selfspec.decoding.draft_exit import DraftExit
from selfspec.decoding.sampling import kept_q, logits_processor, sample, scores
from selfspec.decoding.text_rules import OutputWatch
from selfspec.errors import SelfspecError
from selfspec.models.draft_vocabulary import DraftVocabulary
from selfspec.models.cache import RewindableCache
from selfspec.settings import SamplingSettings, SkipSet
from selfspec.timing import clock


@dataclass
class GenerationContext:
    """What every step of one generation shares."""
    cache: RewindableCache  # the full model's KV cache
    settings: SamplingSettings
    generator: torch.Generator | None = None
    end_ids: tuple[int, ...] = ()  # the model's end-of-turn ids (models/loading.py): any of them ends generation
    watch: OutputWatch | None = None  # banned words and stop strings (decoding/text_rules.py); None: none
    top_logprobs: int | None = None  # the emitted tokens' log-probabilities and this many alternatives; None: off
    processor: LogitsProcessorList = field(init=False)  # the filters plain decoding applies

    def __post_init__(self):
        self.processor = logits_processor(self.settings)


STORE = "store"  # Draft.source of a token store's drafts (StoreTreeDrafter, layer_skip_tree.py)


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)  # each (vocab,): q, for sampled verification
    source: str = "model"  # "model" (a model's own draft), "ngram" (copied from the context) or "store"
    parents: list[int] | None = None  # a token tree (decoding/tree.py): per token its parent's index, -1 the last
    # context token, parents before children; probs[i] is the q token i was drawn from. None: a chain


@dataclass
class Verification:
    """One verification as the full model saw it: the proposal's draft, the accepted path and the scores."""
    last: int  # the context's last token, at the root of the draft
    draft: Draft
    path: list[int]  # the accepted draft tokens' indices, root first (a chain's: 0, 1, ...)
    target: torch.Tensor  # (1 + drafted, vocab) scores: row 0 after the context, row i + 1 after draft token i
    next_token: int  # the full model's own token after the accepted path


@dataclass
class DraftForward:
    """One draft forward of a batch row (`batch_draft`): `ids` at positions start.. over the row's cache, with `skip`
    left out, scored by `head` (None: the full output layer); rows with the same skip set and head share a forward."""
    skip: SkipSet
    head: DraftVocabulary | None
    ids: list[int]
    start: int
    rows: int = 1  # the rows whose draft forwards ran in the one forward (the batch sets it)

    @property
    def group(self) -> tuple:
        return self.skip, id(self.head)


class Drafter(Protocol):
    """Proposes tokens for the full model to verify."""

    @property
    def max_tokens(self) -> int:
        """The longest draft this drafter proposes (the decoding loop sizes the cache by it)."""

    @property
    def threshold(self) -> float:
        """The draft-exit threshold in force, recorded with every step (0.0 for drafters without one)."""

    def begin(self, context: GenerationContext) -> None:
        """A new generation starts: its cache, sampling settings, generator and end ids."""

    def draft(self, tokens: list[int], max_tokens: int) -> Draft:
        """Up to `max_tokens` tokens to follow `tokens`; all but the last of `tokens` are in the cache. For a tree
        drafter `max_tokens` caps its depth; its node budget is its `max_tokens` property."""

    def update(self, drafted: int, accepted: int, path: list[int] | None = None, source: str = "model") -> None:
        """The full model accepted `accepted` of the `drafted` tokens of the last draft; for a tree, `drafted` is its
        depth and `path` the accepted nodes' indices, root first (None: a chain). `source`: the draft's Draft.source."""

    def observe_verify_ms(self, tokens: int, ms: float) -> None:
        """The last verification, of `tokens` tokens, took `ms`; told at batch size 1 after every step."""


class TokenSource(Protocol):
    """What a chain or tree drafter drafts from: draft logits for the token after a context."""

    def begin(self, context: GenerationContext) -> None:
        """A new generation starts."""

    def drafting(self, tokens: list[int]) -> AbstractContextManager:
        """A draft after `tokens` runs inside this (a skip set), entered only when the policy plans one."""

    def next_logits(self, ids: list[int], start: int) -> torch.Tensor:
        """(vocab,) logits of the token after `ids`, which sit at positions start.."""


def require_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise SelfspecError(f"{name}={value} must be >= 1")


def cut_at_end(tokens: list[int], end_ids: tuple[int, ...]) -> list[int]:
    """`tokens` up to and including the first end id."""
    for index, token in enumerate(tokens):
        if token in end_ids:
            return tokens[:index + 1]
    return tokens


class ExitPolicyDrafter:
    """A drafter whose draft length is decided by its draft-exit policy, one token at a time (`draft_loop`)."""

    def __init__(self, exit_policy: DraftExit):
        self.exit_policy = exit_policy
        self.context: GenerationContext | None = None

    @property
    def max_tokens(self) -> int:
        return self.exit_policy.max_tokens

    @property
    def threshold(self) -> float:
        return self.exit_policy.threshold

    def begin(self, context: GenerationContext) -> None:
        self.context = context
        self.exit_policy.begin()

    def update(self, drafted: int, accepted: int, path: list[int] | None = None, source: str = "model") -> None:
        self.exit_policy.update(drafted, accepted)

    def observe_verify_ms(self, tokens: int, ms: float) -> None:
        self.exit_policy.observe_verify_ms(tokens, ms)

    def draft_loop(self, next_logits: Callable[[list[int], int], torch.Tensor], tokens: list[int], cached: int,
                   max_tokens: int, around: Callable[[], AbstractContextManager] = nullcontext) -> Draft:
        """Feed tokens[cached:] (not yet in the draft's cache), then draft up to `max_tokens` tokens one at a time
        (`draft_steps`), each draft forward `next_logits(ids, start) -> (vocab,)`. The forwards run inside `around()`
        (a skip set), entered only when the policy plans a draft: swapping layers costs most of an idle step."""
        return run_steps(self.draft_steps(tokens, cached, max_tokens), next_logits, around)

    def draft_steps(self, tokens: list[int], cached: int, max_tokens: int,
                    shared_by: list[int] | None = None) -> Generator[tuple[list[int], int], torch.Tensor, Draft]:
        """The draft loop as a generator: yields each draft forward's (ids, start), is sent its last position's
        logits (vocab,), returns the draft. Drafts nothing when the policy plans nothing; stops where the policy says
        (it sees each token's top draft probability), after `max_tokens` tokens, or after an end id. The policy
        learns what a draft token took; in a batch each forward's time is divided among the rows that ran it
        (`shared_by`: per forward so far, that number of rows; the caller adds each before sending its logits)."""
        context, settings = self.context, self.context.settings
        max_tokens = self.exit_policy.plan(max_tokens)
        if max_tokens == 0:
            return Draft()
        start = clock()  # the verification before ended on the host: nothing of it is still queued
        history = list(tokens)
        logits = yield history[cached:], cached  # (vocab,)
        draft = Draft()
        while True:
            row = scores(logits[None], history, len(history), context.processor)[0]  # (vocab,)
            probs = torch.softmax(row, dim=-1)
            token = int(row.argmax()) if settings.greedy else sample(probs, context.generator)
            draft.tokens.append(token)
            if not settings.greedy:
                draft.probs.append(kept_q(probs))
            history.append(token)
            if (self.exit_policy.should_stop(float(probs.max())) or len(draft.tokens) == max_tokens
                    or token in context.end_ids):
                per_token_ms = 1000 * (clock(logits.device) - start) / len(draft.tokens)
                share = sum(1 / rows for rows in shared_by) / len(shared_by) if shared_by else 1.0
                self.exit_policy.observe_draft_ms(per_token_ms * share)
                return draft
            logits = yield [token], len(history) - 1


class ChainDrafter(ExitPolicyDrafter):
    """A chain drafted one token at a time from `source` (a layer-skipped model, a feature head) under
    `exit_policy`."""

    def __init__(self, source: TokenSource, exit_policy: DraftExit):
        super().__init__(exit_policy)
        self.source = source

    def begin(self, context: GenerationContext) -> None:
        super().begin(context)
        self.source.begin(context)

    def draft(self, tokens: list[int], max_tokens: int) -> Draft:
        return self.draft_loop(self.source.next_logits, tokens, len(tokens) - 1, max_tokens,
                               around=partial(self.source.drafting, tokens))


def run_steps(steps: Generator, answer: Callable, around: Callable[[], AbstractContextManager] = nullcontext):
    """Drive a generator of requests: send each request's `answer(*request)` back, inside `around()` from the first
    request on; return what it returns."""
    try:
        request = next(steps)
    except StopIteration as done:
        return done.value
    with around():
        try:
            while True:
                request = steps.send(answer(*request))
        except StopIteration as done:
            return done.value


def value_of(steps: Generator):
    """What a generator that makes no requests returns (a row's proposal outside a batch)."""
    try:
        request = next(steps)
    except StopIteration as done:
        return done.value
    raise RuntimeError(f"a request {request!r} where none was expected: a row's steps outside a batch ask nothing")
