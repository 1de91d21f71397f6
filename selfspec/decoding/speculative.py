"""Draft, verify in one forward of the full model, keep the accepted prefix: lossless speculative decoding.

With no drafter (or a draft of zero tokens) a step is one plain decoding step, so plain decoding and
speculative decoding share this loop and its sampling code. Target-confidence gating: while the full model's
probability of the token it last emitted is at or below `target_gate`, the next step does not draft. Banned words
and stop strings (decoding/text_rules.py) act on what a step emits, the same way whatever drafted it.
"""

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from selfspec.decoding.drafters import Draft, Drafter, GenerationContext, cut_at_end
from selfspec.decoding.prompt_ids import single_prompt
from selfspec.decoding.results import GenerationResult, StepRecord
from selfspec.decoding.sampling import accept_probability, residual, sample, scores
from selfspec.decoding.text_rules import WINDOW, OutputWatch, TextRules
from selfspec.decoding.tree import forward_tree, tree_paths, tree_scores, verify_tree_greedy, verify_tree_sampled
from selfspec.errors import SelfspecError
from selfspec.models.cache import forward, new_cache
from selfspec.models.devices import output_device
from selfspec.models.layouts import decoder_layers
from selfspec.settings import SamplingSettings
from selfspec.timing import clock


@dataclass
class TokenLogprob:
    """The full model's log-probability of an emitted token under the sampling settings, and its top alternatives."""
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), most likely first


@dataclass
class Emitted:
    """What one step (or the prefill) added to the output."""
    tokens: list[int]
    step: StepRecord | None  # None: the prefill
    logprobs: list[TokenLogprob] | None = None  # per token of `tokens`, when the generation asks for them
    rolled_back: int = 0  # then this many tokens came off the output's end: a banned word completed
    stopped: bool = False  # a stop string completed: the output ends here
    open_tokens: int = 0  # tokens at the output's end that a banned word may still roll back (streams hold them)

    def onto(self, output: list[int]) -> None:
        """Add this step's tokens to `output`, then take the rolled-back ones off its end."""
        output += self.tokens
        del output[len(output) - self.rolled_back:]


def verify_greedy(draft_tokens: list[int], target_scores: torch.Tensor) -> tuple[int, int]:
    """Accept drafts while they equal the full model's argmax; return (accepted, next token).

    target_scores: (k+1, vocab), row j predicts the position of draft token j (row k: the bonus position).
    """
    choices = target_scores.argmax(dim=-1).tolist()  # (k+1,)
    accepted = 0
    while accepted < len(draft_tokens) and draft_tokens[accepted] == choices[accepted]:
        accepted += 1
    return accepted, choices[accepted]


def verify_sampled(draft_tokens: list[int], q: torch.Tensor, p: torch.Tensor, generator) -> tuple[int, int]:
    """Speculative sampling: accept x ~ q with probability min(1, p(x)/q(x)); on the first rejection sample
    from the residual norm(max(0, p - q)); if every draft is accepted, sample the bonus token from p.

    q: (k, vocab) draft distributions; p: (k+1, vocab) target distributions.
    """
    k = len(draft_tokens)
    if k == 0:
        return 0, sample(p[0], generator)
    x = torch.tensor(draft_tokens, device=p.device)
    rows = torch.arange(k, device=p.device)
    accept = torch.rand(k, generator=generator, device=p.device) < accept_probability(p[rows, x], q[rows, x])
    accepted = k if bool(accept.all()) else int((~accept).nonzero()[0])
    if accepted < k:
        return accepted, sample(residual(p[accepted], q[accepted]), generator)
    return k, sample(p[k], generator)


def generate(model, prompt: list[int], settings: SamplingSettings, drafter: Drafter | None = None,
             end_ids: tuple[int, ...] = (), generator: torch.Generator | None = None,
             target_gate: float | None = None, rules: TextRules | None = None) -> GenerationResult:
    """Generate up to settings.max_new_tokens tokens after `prompt` (batch size 1), stopping after any of `end_ids`
    (the model's end-of-turn ids, LoadedModel.end_ids) or a stop string of `rules`; plain decoding without a
    drafter."""
    device = output_device(model)  # the clock waits for the device the logits land on
    start = clock(device)
    new_tokens, steps, prefill_s, rollbacks = [], [], 0.0, 0
    for emitted in decode_steps(model, prompt, settings, drafter, end_ids, generator, target_gate, rules):
        emitted.onto(new_tokens)
        rollbacks += emitted.rolled_back > 0
        if emitted.step is None:
            prefill_s = clock(device) - start
        else:
            steps.append(emitted.step)
    finish = "stop" if emitted.stopped or new_tokens[-1] in end_ids else "length"
    return GenerationResult(new_tokens, clock(device) - start, prefill_s, steps, rollbacks, finish)


def decode_steps(model, prompt: list[int], settings: SamplingSettings, drafter: Drafter | None = None,
                 end_ids: tuple[int, ...] = (), generator: torch.Generator | None = None,
                 target_gate: float | None = None, rules: TextRules | None = None,
                 top_logprobs: int | None = None) -> Iterator[Emitted]:
    """`generate` one step at a time: yields what the prefill emitted (step None), then what each verification
    emitted, with the tokens' log-probabilities and `top_logprobs` alternatives when that is set. A consumer that
    stops iterating stops the generation there (streaming, disconnects)."""
    prompt = single_prompt(prompt)
    decoder_layers(model)  # a model of another layout ends here, in one line
    if target_gate is not None and not 0.0 <= target_gate <= 1.0:
        raise SelfspecError(f"target_gate={target_gate} is outside [0, 1]")
    max_len = len(prompt) + settings.max_new_tokens + (drafter.max_tokens if drafter is not None else 0) + 1
    context = GenerationContext(new_cache(model, max_len), settings, generator, end_ids,
                                OutputWatch(rules, prompt[-WINDOW:]) if rules else None, top_logprobs)
    if drafter is not None:
        drafter.begin(context)

    emitted, confidence = prefill(model, context, prompt)
    tokens = list(prompt)
    while True:
        emitted = settled(context, emitted)
        emitted.onto(tokens)
        context.cache.rewind(len(tokens) - 1)  # short of the step's own rewind after a rollback or a stop
        yield emitted
        generated = len(tokens) - len(prompt)
        if emitted.stopped or generated >= settings.max_new_tokens or (generated and tokens[-1] in end_ids):
            return
        gated = drafter is not None and target_gate is not None and confidence <= target_gate
        emitted = speculative_step(model, context, tokens, settings.max_new_tokens - generated, drafter, gated)
        confidence = emitted.step.target_confidence


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
    logits = forward(model, context.cache, prompt, 0, last_only=True)  # (1, vocab)
    target = scores(logits, prompt, len(prompt), context.processor)  # (1, vocab)
    probs = torch.softmax(target[0], dim=-1)  # (vocab,)
    token = int(probs.argmax()) if context.settings.greedy else sample(probs, context.generator)
    return Emitted([token], None, token_logprobs(context, target, [token])), float(probs[token])


def speculative_step(model, context: GenerationContext, tokens: list[int], remaining: int, drafter: Drafter | None,
                     gated: bool = False) -> Emitted:
    """Draft (unless `gated`), verify [last token, drafts...] in one full-model forward, keep the accepted prefix
    plus one token; the cache is rewound to the kept length (tokens + new, minus the not yet processed last
    token)."""
    device = output_device(model)
    t0 = clock(device)
    k_max = min(drafter.max_tokens, remaining - 1) if drafter is not None and not gated else 0
    draft = drafter.draft(tokens, k_max) if k_max > 0 else Draft()
    t1 = clock(device)
    if draft.parents is not None:
        return tree_step(model, context, tokens, remaining, drafter, draft, t1 - t0, gated)
    if context.watch is not None:  # no draft token past one that completes a banned word or a stop string
        kept = context.watch.draft_length(draft.tokens)
        draft = replace(draft, tokens=draft.tokens[:kept], probs=draft.probs[:kept])
    verify_logits = forward(model, context.cache, [tokens[-1]] + draft.tokens, len(tokens) - 1)  # (k+1, vocab)
    target = scores(forbid(context, verify_logits), tokens + draft.tokens, len(tokens), context.processor)
    if context.settings.greedy:
        accepted, next_token = verify_greedy(draft.tokens, target)
    else:
        # (k, vocab); a separate draft model may sit on another device than the target's output layer
        q = torch.stack(draft.probs).to(target.device) if draft.tokens else None
        accepted, next_token = verify_sampled(draft.tokens, q, torch.softmax(target, dim=-1), context.generator)
    new = cut_at_end((draft.tokens[:accepted] + [next_token])[:remaining], context.end_ids)
    context.cache.rewind(len(tokens) + len(new) - 1)
    confidence = float(torch.softmax(target[accepted], dim=-1)[next_token])  # the full model's p(next token)
    step = StepRecord(len(draft.tokens), accepted, len(new), drafter.threshold if drafter is not None else 0.0,
                      t1 - t0, clock(device) - t1, draft.source if draft.tokens else "", confidence, gated)
    if draft.tokens:
        drafter.update(len(draft.tokens), accepted, source=draft.source)
    return Emitted(new, step, token_logprobs(context, target[:len(new)], new))


def tree_step(model, context: GenerationContext, tokens: list[int], remaining: int, drafter: Drafter, draft: Draft,
              draft_s: float, gated: bool) -> Emitted:
    """Verify a token-tree draft in one full-model forward (decoding/tree.py), keep its longest accepted path plus one
    token, and move that path's cache entries next to the prefix."""
    device = output_device(model)
    t1 = clock(device)
    logits = forward_tree(model, context.cache, tokens[-1], draft, len(tokens) - 1)  # (n+1, vocab)
    target = tree_scores(forbid(context, logits), tokens, draft, context.processor)  # (n+1, vocab)
    if context.settings.greedy:
        path, next_token = verify_tree_greedy(draft, target)
    else:
        path, next_token = verify_tree_sampled(draft, torch.softmax(target, dim=-1), context.generator)
    new = cut_at_end(([draft.tokens[i] for i in path] + [next_token])[:remaining], context.end_ids)
    context.cache.compact(len(tokens), [len(tokens) + i for i in path[:len(new) - 1]])
    row = path[-1] + 1 if path else 0  # the row that predicted next_token
    confidence = float(torch.softmax(target[row], dim=-1)[next_token])
    depth = max(len(p) for p in tree_paths(draft.parents))
    step = StepRecord(len(draft.tokens), len(path), len(new), drafter.threshold, draft_s, clock(device) - t1,
                      draft.source if draft.tokens else "", confidence, gated, len(draft.tokens), depth)
    if draft.tokens:
        drafter.update(depth, len(path), path, draft.source)
    rows = [0] + [i + 1 for i in path]  # row r predicts the token after node r - 1 (row 0: after the context)
    return Emitted(new, step, token_logprobs(context, target[rows[:len(new)]], new))


def forbid(context: GenerationContext, logits: torch.Tensor) -> torch.Tensor:
    """`logits` (rows, vocab) with the tokens the banned words forbid at the next position out of row 0 (only the
    next position can have forbidden tokens: a rollback clears the positions after its own)."""
    forbidden = context.watch.forbidden_next() if context.watch is not None else None
    if not forbidden:
        return logits
    logits = logits.clone()
    logits[0, sorted(forbidden)] = float("-inf")
    return logits


def token_logprobs(context: GenerationContext, target: torch.Tensor, tokens: list[int]) -> list[TokenLogprob] | None:
    """The log-probabilities of `tokens` under the filtered scores `target` (len(tokens), vocab) that chose them,
    with context.top_logprobs alternatives each; None when the generation does not ask for them."""
    if context.top_logprobs is None:
        return None
    logprobs = torch.log_softmax(target.float(), dim=-1)  # (n, vocab)
    chosen = logprobs[torch.arange(len(tokens)), torch.tensor(tokens, device=logprobs.device)].tolist()
    values, ids = logprobs.topk(context.top_logprobs, dim=-1)  # (n, top)
    return [TokenLogprob(logprob, [(i, v) for i, v in zip(row_ids, row_values) if v > float("-inf")])
            for logprob, row_ids, row_values in zip(chosen, ids.tolist(), values.tolist())]
