"""Speculative decoding, top to bottom: draft, verify the draft in one forward of the full model, keep what it accepts.

    generation = Generation(model, prompt, options, drafter)
    emitted = generation.start()                     # prefill: the prompt, then the first new token
    while not generation.finished:
        proposal = generation.propose()              # the drafter's tokens: a chain, or a tree (draft.parents)
        logits = verify_forward(model, cache, proposal)  # (1 + drafted, vocab): [last token, draft...] at once
        emitted = generation.conclude(proposal, logits)  # accepted drafts + one token of the full model's own

Greedy verification keeps the drafts equal to the full model's argmax; sampled verification is speculative
sampling (Leviathan et al.), so the output is distributed exactly as the full model's. Either way the cache is
left holding exactly the kept tokens. Without a drafter every step is a plain decoding step: plain and
speculative decoding share this loop. A batch (decoding/batch.py) runs the same `Generation`s, one forward
verifying every row's proposal.
"""

from collections.abc import Generator, Iterator
from dataclasses import dataclass, field, replace

import torch

from selfspec.decoding.drafters import Draft, Drafter, DraftForward, GenerationContext, cut_at_end
from selfspec.decoding.drafters.base import Verification, value_of
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.prompt_ids import single_prompt
from selfspec.decoding.results import Emitted, GenerationResult, StepRecord, TokenLogprob
from selfspec.decoding.sampling import accept_probability, residual, sample, scores
from selfspec.decoding.text_rules import WINDOW, OutputWatch
from selfspec.decoding.tree import (forward_tree, tree_block, tree_paths, tree_scores, verify_tree_greedy,
                                    verify_tree_sampled)
from selfspec.errors import SelfspecError
from selfspec.models.attention_masks import chain
from selfspec.models.cache import RewindableCache, forward, new_cache
from selfspec.models.devices import output_device
from selfspec.models.layouts import decoder_layers
from selfspec.settings import SamplingSettings
from selfspec.timing import clock


@dataclass
class Proposal:
    """What a step feeds the full model: the last token at cache index `start`, then the draft."""
    draft: Draft
    last: int
    start: int
    remaining: int  # tokens the generation may still emit
    gated: bool  # the target-confidence gate kept the drafter idle
    draft_s: float
    verify_start: float  # the clock when drafting ended

    @property
    def ids(self) -> list[int]:
        return [self.last] + self.draft.tokens

    @property
    def block(self) -> list[int]:
        """The ids' parents in the verify forward (models/attention_masks.py)."""
        return chain(len(self.ids)) if self.draft.parents is None else tree_block(self.draft.parents)


def generate(model, prompt: list[int], options: GenerationOptions, drafter: Drafter | None = None
             ) -> GenerationResult:
    """Up to max_new_tokens tokens after `prompt` (batch size 1); plain decoding without a drafter."""
    device = output_device(model)  # the clock waits for the device the logits land on
    tally = Tally(clock(device))
    for emitted in decode_steps(model, prompt, options, drafter):
        tally.add(emitted, clock(device))
    return tally.result(options.end_ids)


def decode_steps(model, prompt: list[int], options: GenerationOptions, drafter: Drafter | None = None
                 ) -> Iterator[Emitted]:
    """`generate` a step at a time: the prefill's first token, then each verification's tokens. A consumer that
    stops iterating stops the generation there (streaming, disconnects)."""
    generation = Generation(model, prompt, options, drafter)
    yield generation.start()
    while not generation.finished:
        proposal = generation.propose()
        emitted = generation.conclude(proposal, verify_forward(model, generation.context.cache, proposal))
        if drafter is not None:
            drafter.observe_verify_ms(emitted.step.drafted + 1, 1000 * emitted.step.verify_s)
        yield emitted


def verify_forward(model, cache: RewindableCache, proposal: Proposal) -> torch.Tensor:
    """The full model over [last token, draft...]: fp32 logits (1 + drafted, vocab)."""
    if proposal.draft.parents is not None:
        return forward_tree(model, cache, proposal.last, proposal.draft, proposal.start)
    return forward(model, cache, proposal.ids, proposal.start)


class Generation:
    """One prompt's decoding state: its tokens, cache (`cache`: a batch's row; None, one of its own), drafter and
    the full model's confidence in its last token."""

    def __init__(self, model, prompt: list[int], options: GenerationOptions, drafter: Drafter | None = None,
                 cache: RewindableCache | None = None):
        self.prompt = single_prompt(prompt)
        decoder_layers(model)  # a model of another layout ends here, in one line
        gate = options.target_gate
        if gate is not None and not 0.0 <= gate <= 1.0:
            raise SelfspecError(f"target_gate={gate} is outside [0, 1]")
        self.model, self.drafter, self.options = model, drafter, options
        needed = needed_length(len(self.prompt), options.sampling, drafter.max_tokens if drafter is not None else 0)
        if cache is not None and cache.max_len < needed:
            raise SelfspecError(f"a prompt of {len(self.prompt)} tokens and max_new_tokens="
                                f"{options.sampling.max_new_tokens} need {needed} cache positions; the batch holds "
                                f"{cache.max_len}")
        watch = OutputWatch(options.rules, self.prompt[-WINDOW:]) if options.rules else None
        self.context = GenerationContext(cache or new_cache(model, needed), options.sampling, options.generator,
                                         options.end_ids, watch, options.top_logprobs)
        self.tokens, self.confidence, self.finished = list(self.prompt), 1.0, False

    def start(self) -> Emitted:
        """The prefill: the prompt through the full model, and the first new token."""
        self.begin()
        logits = forward(self.model, self.context.cache, self.prompt, 0, last_only=True)  # (1, vocab)
        return self.prefilled(logits)

    def begin(self) -> None:
        """Ready the drafter, before the prefill (a drafter may keep what the prefill computes)."""
        if self.drafter is not None:
            self.drafter.begin(self.context)

    def prefilled(self, logits: torch.Tensor) -> Emitted:
        """The first new token, from the full model's `logits` (1, vocab) at the prompt's last position."""
        target = scores(logits, self.prompt, len(self.prompt), self.context.processor)  # (1, vocab)
        probs = torch.softmax(target[0], dim=-1)  # (vocab,)
        token = int(probs.argmax()) if self.context.settings.greedy else sample(probs, self.context.generator)
        self.confidence = float(probs[token])
        return self._apply(Emitted([token], None, token_logprobs(self.context, target, [token], [0])))

    def propose(self) -> Proposal:
        """What the next verification checks, the drafter drafting alone (batch size 1)."""
        return value_of(self.propose_steps(in_batch=False))

    def propose_steps(self, in_batch: bool = True) -> Generator[DraftForward, torch.Tensor, Proposal]:
        """`propose` as a generator: in a batch a drafter with `batch_draft` yields its draft forwards, which the
        batch runs with the other rows' (decoding/batch.py), and is sent their logits."""
        t0 = clock(output_device(self.model))
        gated = self.drafter is not None and self.options.target_gate is not None \
            and self.confidence <= self.options.target_gate
        remaining = self.context.settings.max_new_tokens - (len(self.tokens) - len(self.prompt))
        k_max = min(self.drafter.max_tokens, remaining - 1) if self.drafter is not None and not gated else 0
        batch_draft = getattr(self.drafter, "batch_draft", None) if in_batch else None
        if k_max == 0:
            draft = Draft()
        elif batch_draft is not None:
            draft = yield from batch_draft(self.tokens, k_max)
        else:
            draft = self.drafter.draft(self.tokens, k_max)
        if draft.parents is None and self.context.watch is not None:  # a chain ends at a banned word or stop string
            kept = self.context.watch.draft_length(draft.tokens)
            draft = replace(draft, tokens=draft.tokens[:kept], probs=draft.probs[:kept])
        t1 = clock(output_device(self.model))
        return Proposal(draft, self.tokens[-1], len(self.tokens) - 1, remaining, gated, t1 - t0, t1)

    def conclude(self, proposal: Proposal, logits: torch.Tensor) -> Emitted:
        """Keep what the full model's `logits` (len(proposal.ids), vocab) accept of the proposal, plus one token."""
        emitted = accept(self.model, self.context, self.tokens, proposal, logits, self.drafter)
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


def accept(model, context: GenerationContext, tokens: list[int], proposal: Proposal, logits: torch.Tensor,
           drafter: Drafter | None) -> Emitted:
    """Keep the accepted drafts (a chain's prefix, a tree's path) plus one token; the cache keeps exactly them."""
    draft, is_tree = proposal.draft, proposal.draft.parents is not None
    logits = forbid(context, logits)
    if is_tree:
        target = tree_scores(logits, tokens, draft, context.processor)  # (n+1, vocab)
        if context.settings.greedy:
            path, next_token = verify_tree_greedy(draft, target)
        else:
            path, next_token = verify_tree_sampled(draft, torch.softmax(target, dim=-1), context.generator)
    else:
        target = scores(logits, tokens + draft.tokens, len(tokens), context.processor)  # (k+1, vocab)
        if context.settings.greedy:
            accepted, next_token = verify_greedy(draft.tokens, target)
        else:  # a separate draft model may sit on another device than the target's output layer
            q = [probs.to(target.device) for probs in draft.probs]
            accepted, next_token = verify_sampled(draft.tokens, q, torch.softmax(target, dim=-1), context.generator)
        path = list(range(accepted))
    new = cut_at_end(([draft.tokens[i] for i in path] + [next_token])[:proposal.remaining], context.end_ids)
    context.cache.compact(len(tokens), [len(tokens) + i for i in path[:len(new) - 1]])  # a chain's path is in place
    rows = [0] + [i + 1 for i in path]  # row r scores the token after node r - 1 (row 0: after the context)
    depth = max(map(len, tree_paths(draft.parents))) if is_tree else len(draft.tokens)
    step = StepRecord(drafted=len(draft.tokens), accepted=len(path), emitted=len(new),
                      threshold=drafter.threshold if drafter is not None else 0.0, draft_s=proposal.draft_s,
                      verify_s=clock(output_device(model)) - proposal.verify_start,
                      source=draft.source if draft.tokens else "",
                      target_confidence=float(torch.softmax(target[rows[len(path)]], dim=-1)[next_token]),
                      gated=proposal.gated, tree_size=len(draft.tokens) if is_tree else 0,
                      tree_depth=depth if is_tree else 0)
    if draft.tokens:
        drafter.update(depth, len(path), path if is_tree else None, draft.source)
    if (observe := getattr(drafter, "observe_verification", None)) is not None:
        observe(Verification(proposal.last, draft, path, target, next_token))
    return Emitted(new, step, token_logprobs(context, target, new, rows[:len(new)]))


def verify_greedy(draft_tokens: list[int], target_scores: torch.Tensor) -> tuple[int, int]:
    """Accept drafts while they equal the full model's argmax; return (accepted, next token).

    target_scores: (k+1, vocab), row j predicts the position of draft token j (row k: the bonus position).
    """
    choices = target_scores.argmax(dim=-1).tolist()  # (k+1,)
    accepted = 0
    while accepted < len(draft_tokens) and draft_tokens[accepted] == choices[accepted]:
        accepted += 1
    return accepted, choices[accepted]


def verify_sampled(draft_tokens: list[int], q: list[torch.Tensor], p: torch.Tensor, generator) -> tuple[int, int]:
    """Speculative sampling: accept x ~ q with probability min(1, p(x)/q(x)); on the first rejection sample from
    the residual norm(max(0, p - q)); if every draft is accepted, sample the bonus token from p.

    q: k draft distributions, each (vocab,), dense or sparse; p: (k+1, vocab) target distributions.
    """
    k = len(draft_tokens)
    if k == 0:
        return 0, sample(p[0], generator)
    x = torch.tensor(draft_tokens, device=p.device)
    rows = torch.arange(k, device=p.device)
    q_x = torch.stack([q_j[x_j] for q_j, x_j in zip(q, draft_tokens)])  # (k,)
    accept_draft = torch.rand(k, generator=generator, device=p.device) < accept_probability(p[rows, x], q_x)
    accepted = k if bool(accept_draft.all()) else int((~accept_draft).nonzero()[0])
    if accepted < k:
        return accepted, sample(residual(p[accepted], q[accepted]), generator)
    return k, sample(p[k], generator)


def settled(context: GenerationContext, emitted: Emitted) -> Emitted:
    """`emitted` as the banned words and stop strings leave it: cut after the token that completes one."""
    if context.watch is None:
        return emitted
    verdict = context.watch.settle(emitted.tokens)
    logprobs = emitted.logprobs[:verdict.kept] if emitted.logprobs is not None else None
    return replace(emitted, tokens=emitted.tokens[:verdict.kept], logprobs=logprobs,
                   rolled_back=verdict.rolled_back, stopped=verdict.stopped, open_tokens=context.watch.open_tokens())


def forbid(context: GenerationContext, logits: torch.Tensor) -> torch.Tensor:
    """`logits` (rows, vocab) with the tokens banned words forbid at the next position out of row 0 (a rollback
    clears the positions after its own, so only the next one can have forbidden tokens)."""
    forbidden = context.watch.forbidden_next() if context.watch is not None else None
    if not forbidden:
        return logits
    logits = logits.clone()
    logits[0, sorted(forbidden)] = float("-inf")
    return logits


def token_logprobs(context: GenerationContext, target: torch.Tensor, tokens: list[int], rows: list[int]
                   ) -> list[TokenLogprob] | None:
    """The log-probabilities of `tokens` under the filtered scores `target` (rows, vocab) that chose them (token i
    by row rows[i]), with context.top_logprobs alternatives each; None when the generation does not ask for them."""
    if context.top_logprobs is None:
        return None
    logprobs = torch.log_softmax(target[rows].float(), dim=-1)  # (n, vocab)
    chosen = logprobs[torch.arange(len(tokens)), torch.tensor(tokens, device=logprobs.device)].tolist()
    values, ids = logprobs.topk(context.top_logprobs, dim=-1)  # (n, top)
    return [TokenLogprob(logprob, [(i, v) for i, v in zip(row_ids, row_values) if v > float("-inf")])
            for logprob, row_ids, row_values in zip(chosen, ids.tolist(), values.tolist())]


def needed_length(prompt_length: int, settings: SamplingSettings, draft_tokens: int) -> int:
    """Cache positions a generation needs: the prompt, the output and a verify block of `draft_tokens` past it."""
    return prompt_length + settings.max_new_tokens + draft_tokens + 1


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
        return GenerationResult(new_tokens=self.new_tokens, elapsed_s=self.end - self.start,
                                prefill_s=self.prefill_s, steps=self.steps, rollbacks=self.rollbacks,
                                finish_reason=finish)
