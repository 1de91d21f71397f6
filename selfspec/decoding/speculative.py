"""Draft, verify in one forward of the full model, keep the accepted prefix: lossless speculative decoding.

A `Generation` is one prompt's decoding state, advanced a step at a time: `decode_steps` verifies its proposals
alone (batch size 1), a batch (decoding/batch.py) verifies many generations' proposals in one forward.

With no drafter (or a draft of zero tokens) a step is one plain decoding step, so plain decoding and
speculative decoding share this loop and its sampling code. Target-confidence gating: while the full model's
probability of the token it last emitted is at or below `target_gate`, the next step does not draft. Banned words
and stop strings (decoding/text_rules.py) act on what a step emits, the same way whatever drafted it.
"""

from collections.abc import Generator, Iterator
from dataclasses import dataclass, field, replace

import torch

from selfspec.decoding.drafters import Draft, Drafter, DraftForward, GenerationContext
from selfspec.decoding.drafters.base import value_of
from selfspec.decoding.prompt_ids import single_prompt
from selfspec.decoding.results import GenerationResult, StepRecord
from selfspec.decoding.sampling import sample, scores
from selfspec.decoding.text_rules import WINDOW, OutputWatch, TextRules
from selfspec.decoding.tree import forward_tree
from selfspec.decoding.verify import Emitted, Proposal, conclude, token_logprobs
from selfspec.errors import SelfspecError
from selfspec.models.cache import RewindableCache, forward, new_cache
from selfspec.models.devices import output_device
from selfspec.models.layouts import decoder_layers
from selfspec.settings import SamplingSettings
from selfspec.timing import clock


def generate(model, prompt: list[int], settings: SamplingSettings, drafter: Drafter | None = None,
             end_ids: tuple[int, ...] = (), generator: torch.Generator | None = None,
             target_gate: float | None = None, rules: TextRules | None = None) -> GenerationResult:
    """Generate up to settings.max_new_tokens tokens after `prompt` (batch size 1), stopping after any of `end_ids`
    (the model's end-of-turn ids, LoadedModel.end_ids) or a stop string of `rules`; plain decoding without a
    drafter."""
    device = output_device(model)  # the clock waits for the device the logits land on
    tally = Tally(clock(device))
    for emitted in decode_steps(model, prompt, settings, drafter, end_ids, generator, target_gate, rules):
        tally.add(emitted, clock(device))
    return tally.result(end_ids)


@dataclass
class Tally:
    """One generation's result as its steps arrive, timed from `start`."""
    start: float
    new_tokens: list[int] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    prefill_s: float = 0.0
    rollbacks: int = 0
    stopped: bool = False
    end: float = 0.0  # the clock when the last step arrived

    def add(self, emitted: Emitted, now: float) -> None:
        emitted.onto(self.new_tokens)
        self.rollbacks += emitted.rolled_back > 0
        self.stopped, self.end = emitted.stopped, now
        if emitted.step is None:
            self.prefill_s = now - self.start
        else:
            self.steps.append(emitted.step)

    def result(self, end_ids: tuple[int, ...]) -> GenerationResult:
        finish = "stop" if self.stopped or self.new_tokens[-1] in end_ids else "length"
        return GenerationResult(self.new_tokens, self.end - self.start, self.prefill_s, self.steps, self.rollbacks,
                                finish)


def decode_steps(model, prompt: list[int], settings: SamplingSettings, drafter: Drafter | None = None,
                 end_ids: tuple[int, ...] = (), generator: torch.Generator | None = None,
                 target_gate: float | None = None, rules: TextRules | None = None,
                 top_logprobs: int | None = None) -> Iterator[Emitted]:
    """`generate` one step at a time: yields what the prefill emitted (step None), then what each verification
    emitted, with the tokens' log-probabilities and `top_logprobs` alternatives when that is set. A consumer that
    stops iterating stops the generation there (streaming, disconnects)."""
    generation = Generation(model, prompt, settings, drafter, end_ids, generator, target_gate, rules, top_logprobs)
    yield generation.start()
    while not generation.finished:
        proposal = value_of(generation.propose())
        emitted = generation.conclude(proposal, verify_forward(model, generation.context.cache, proposal))
        if drafter is not None:
            drafter.observe_verify_ms(emitted.step.drafted + 1, 1000 * emitted.step.verify_s)
        yield emitted


def verify_forward(model, cache: RewindableCache, proposal: Proposal) -> torch.Tensor:
    """The full model over [last token, draft...] at batch size 1: fp32 logits (len(ids), vocab)."""
    if proposal.draft.parents is not None:
        return forward_tree(model, cache, proposal.last, proposal.draft, proposal.start)
    return forward(model, cache, proposal.ids, proposal.start)


class Generation:
    """One prompt's decoding state (its tokens, cache, drafter and output watch), advanced a step at a time from
    outside: `decode_steps` verifies each proposal alone, a batch (decoding/batch.py) verifies many in one forward.
    `cache`: where the generation keeps its K/V (a batch's row); None, a cache of its own."""

    def __init__(self, model, prompt: list[int], settings: SamplingSettings, drafter: Drafter | None = None,
                 end_ids: tuple[int, ...] = (), generator: torch.Generator | None = None,
                 target_gate: float | None = None, rules: TextRules | None = None, top_logprobs: int | None = None,
                 cache: RewindableCache | None = None):
        self.prompt = single_prompt(prompt)
        decoder_layers(model)  # a model of another layout ends here, in one line
        if target_gate is not None and not 0.0 <= target_gate <= 1.0:
            raise SelfspecError(f"target_gate={target_gate} is outside [0, 1]")
        self.model, self.drafter, self.target_gate = model, drafter, target_gate
        needed = needed_length(len(self.prompt), settings, drafter.max_tokens if drafter is not None else 0)
        if cache is not None and cache.max_len < needed:
            raise SelfspecError(f"a prompt of {len(self.prompt)} tokens and max_new_tokens={settings.max_new_tokens}"
                                f" need {needed} cache positions; the batch holds {cache.max_len}")
        watch = OutputWatch(rules, self.prompt[-WINDOW:]) if rules else None
        self.context = GenerationContext(cache or new_cache(model, needed), settings, generator, end_ids, watch,
                                         top_logprobs)
        self.tokens, self.confidence, self.finished = list(self.prompt), 1.0, False

    def start(self) -> Emitted:
        """The prefill: the prompt through the full model, and the first new token."""
        self.begin()
        emitted, self.confidence = prefill(self.model, self.context, self.prompt)
        return self._apply(emitted)

    def begin(self) -> None:
        """Ready the drafter for this generation, before the prefill (a drafter may keep what the prefill computes)."""
        if self.drafter is not None:
            self.drafter.begin(self.context)

    def prefilled(self, logits: torch.Tensor) -> Emitted:
        """The first new token, from the full model's `logits` (1, vocab) at the prompt's last position."""
        emitted, self.confidence = first_token(self.context, self.prompt, logits)
        return self._apply(emitted)

    def propose(self, in_batch: bool = False) -> Generator[DraftForward, torch.Tensor, Proposal]:
        """Draft (unless the target-confidence gate closes it) what the next verification checks: `propose_steps`
        for a row of a batch (`in_batch`; alone, value_of gives its proposal)."""
        gated = self.drafter is not None and self.target_gate is not None and self.confidence <= self.target_gate
        remaining = self.context.settings.max_new_tokens - (len(self.tokens) - len(self.prompt))
        return propose_steps(self.model, self.context, self.tokens, remaining, self.drafter, gated, in_batch)

    def conclude(self, proposal: Proposal, logits: torch.Tensor) -> Emitted:
        """Keep what the full model's `logits` (len(proposal.ids), vocab) accept of the proposal, plus one token."""
        emitted = conclude(self.model, self.context, self.tokens, proposal, logits, self.drafter)
        self.confidence = emitted.step.target_confidence
        return self._apply(emitted)

    def _apply(self, emitted: Emitted) -> Emitted:
        emitted = settled(self.context, emitted)
        emitted.onto(self.tokens)
        self.context.cache.rewind(len(self.tokens) - 1)  # short of the step's own rewind after a rollback or a stop
        generated = len(self.tokens) - len(self.prompt)
        self.finished = (emitted.stopped or generated >= self.context.settings.max_new_tokens
                         or (generated > 0 and self.tokens[-1] in self.context.end_ids))
        return emitted


def needed_length(prompt_length: int, settings: SamplingSettings, draft_tokens: int) -> int:
    """Cache positions a generation needs: the prompt, the output and a verify block of `draft_tokens` drafts past
    it."""
    return prompt_length + settings.max_new_tokens + draft_tokens + 1


def settled(context: GenerationContext, emitted: Emitted) -> Emitted:
    """`emitted` as the banned words and stop strings leave it: cut after the token that completes one."""
    if context.watch is None:
        return emitted
    verdict = context.watch.settle(emitted.tokens)
    logprobs = emitted.logprobs[:verdict.kept] if emitted.logprobs is not None else None
    return replace(emitted, tokens=emitted.tokens[:verdict.kept], logprobs=logprobs,
                   rolled_back=verdict.rolled_back, stopped=verdict.stopped, open_tokens=context.watch.open_tokens())


def prefill(model, context: GenerationContext, prompt: list[int]) -> tuple[Emitted, float]:
    """Run the prompt through the full model; return the first new token and its probability."""
    return first_token(context, prompt, forward(model, context.cache, prompt, 0, last_only=True))


def first_token(context: GenerationContext, prompt: list[int], logits: torch.Tensor) -> tuple[Emitted, float]:
    """The first new token and its probability, from the full model's `logits` (1, vocab) at the prompt's last
    position."""
    target = scores(logits, prompt, len(prompt), context.processor)  # (1, vocab)
    probs = torch.softmax(target[0], dim=-1)  # (vocab,)
    token = int(probs.argmax()) if context.settings.greedy else sample(probs, context.generator)
    return Emitted([token], None, token_logprobs(context, target, [token])), float(probs[token])


def propose(model, context: GenerationContext, tokens: list[int], remaining: int, drafter: Drafter | None,
            gated: bool = False) -> Proposal:
    """Draft (unless `gated`) what the next verification checks: up to the drafter's longest draft, short of the
    `remaining` tokens; a chain stops at a token that completes a banned word or a stop string."""
    return value_of(propose_steps(model, context, tokens, remaining, drafter, gated))


def propose_steps(model, context: GenerationContext, tokens: list[int], remaining: int, drafter: Drafter | None,
                  gated: bool = False, in_batch: bool = False) -> Generator[DraftForward, torch.Tensor, Proposal]:
    """`propose` as a generator for a row of a batch (`in_batch`): a drafter with `batch_draft` yields its draft
    forwards (decoding/batch.py runs the rows' together) and is sent their logits; outside a batch the row drafts
    alone, as every drafter does."""
    device = output_device(model)
    t0 = clock(device)
    k_max = min(drafter.max_tokens, remaining - 1) if drafter is not None and not gated else 0
    batch_draft = getattr(drafter, "batch_draft", None) if in_batch else None
    if k_max == 0:
        draft = Draft()
    elif batch_draft is not None:
        draft = yield from batch_draft(tokens, k_max)
    else:
        draft = drafter.draft(tokens, k_max)
    if draft.parents is None and context.watch is not None:
        kept = context.watch.draft_length(draft.tokens)
        draft = replace(draft, tokens=draft.tokens[:kept], probs=draft.probs[:kept])
    t1 = clock(device)
    return Proposal(draft, tokens[-1], len(tokens) - 1, remaining, gated, t1 - t0, t1)


def speculative_step(model, context: GenerationContext, tokens: list[int], remaining: int, drafter: Drafter | None,
                     gated: bool = False) -> Emitted:
    """Draft (unless `gated`), verify [last token, drafts...] in one full-model forward, keep the accepted prefix
    plus one token; the cache is rewound to the kept length (tokens + new, minus the not yet processed last
    token). The output watch's verdict (`settled`) is the caller's."""
    proposal = propose(model, context, tokens, remaining, drafter, gated)
    return conclude(model, context, tokens, proposal, verify_forward(model, context.cache, proposal), drafter)
