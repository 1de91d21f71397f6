"""One verification: the full model's scores over [last token, draft...] decide what a step keeps.

Greedy verification keeps the drafts that equal the full model's argmax; sampled verification is speculative
sampling (Leviathan et al.), so the output is distributed exactly as the full model's. A chain keeps its accepted
prefix plus one token, a token tree its longest accepted path plus one (decoding/tree.py). These functions take the
full model's logits however they were computed: a generation's own forward or a batch's (decoding/batch.py).
"""

from dataclasses import dataclass

import torch

from selfspec.decoding.drafters import Draft, Drafter, GenerationContext, cut_at_end
from selfspec.decoding.results import StepRecord
from selfspec.decoding.sampling import accept_probability, residual, sample, scores
from selfspec.decoding.tree import tree_block, tree_paths, tree_scores, verify_tree_greedy, verify_tree_sampled
from selfspec.models.attention_masks import chain
from selfspec.models.devices import output_device
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
    began: float | None = None  # a prefill run in a batch's step: the clock when that step began (decoding/batch.py)

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


@dataclass
class Proposal:
    """What a step feeds the full model: the last token, then the draft (a chain, or a tree: draft.parents), with
    the last token at cache index `start`."""
    draft: Draft
    last: int  # the last token of the output so far
    start: int
    remaining: int  # tokens the generation may still emit
    gated: bool
    draft_s: float
    verify_start: float  # the clock when drafting ended

    @property
    def ids(self) -> list[int]:
        return [self.last] + self.draft.tokens

    @property
    def block(self) -> list[int]:
        """The ids' parents in the verify forward (models/attention_masks.py)."""
        return chain(len(self.ids)) if self.draft.parents is None else tree_block(self.draft.parents)


def conclude(model, context: GenerationContext, tokens: list[int], proposal: Proposal, logits: torch.Tensor,
             drafter: Drafter | None) -> Emitted:
    """Keep what the full model's `logits` (len(proposal.ids), vocab) accept of `proposal`, plus one token."""
    step = tree_step if proposal.draft.parents is not None else chain_step
    return step(model, context, tokens, proposal, logits, drafter)


def chain_step(model, context: GenerationContext, tokens: list[int], proposal: Proposal, verify_logits: torch.Tensor,
               drafter: Drafter | None) -> Emitted:
    """Keep the accepted prefix of a chain draft plus one token; rewind the cache to the kept length."""
    draft = proposal.draft
    target = scores(forbid(context, verify_logits), tokens + draft.tokens, len(tokens), context.processor)
    if context.settings.greedy:
        accepted, next_token = verify_greedy(draft.tokens, target)
    else:
        # (k, vocab); a separate draft model may sit on another device than the target's output layer
        q = torch.stack(draft.probs).to(target.device) if draft.tokens else None
        accepted, next_token = verify_sampled(draft.tokens, q, torch.softmax(target, dim=-1), context.generator)
    new = cut_at_end((draft.tokens[:accepted] + [next_token])[:proposal.remaining], context.end_ids)
    context.cache.rewind(len(tokens) + len(new) - 1)
    confidence = float(torch.softmax(target[accepted], dim=-1)[next_token])  # the full model's p(next token)
    step = StepRecord(len(draft.tokens), accepted, len(new), drafter.threshold if drafter is not None else 0.0,
                      proposal.draft_s, clock(output_device(model)) - proposal.verify_start,
                      draft.source if draft.tokens else "", confidence, proposal.gated)
    if draft.tokens:
        drafter.update(len(draft.tokens), accepted, source=draft.source)
    return Emitted(new, step, token_logprobs(context, target[:len(new)], new))


def tree_step(model, context: GenerationContext, tokens: list[int], proposal: Proposal, logits: torch.Tensor,
              drafter: Drafter) -> Emitted:
    """Keep a token tree's longest accepted path plus one token (decoding/tree.py), and move that path's cache
    entries next to the prefix."""
    draft = proposal.draft
    target = tree_scores(forbid(context, logits), tokens, draft, context.processor)  # (n+1, vocab)
    if context.settings.greedy:
        path, next_token = verify_tree_greedy(draft, target)
    else:
        path, next_token = verify_tree_sampled(draft, torch.softmax(target, dim=-1), context.generator)
    new = cut_at_end(([draft.tokens[i] for i in path] + [next_token])[:proposal.remaining], context.end_ids)
    context.cache.compact(len(tokens), [len(tokens) + i for i in path[:len(new) - 1]])
    row = path[-1] + 1 if path else 0  # the row that predicted next_token
    confidence = float(torch.softmax(target[row], dim=-1)[next_token])
    depth = max(len(p) for p in tree_paths(draft.parents))
    step = StepRecord(len(draft.tokens), len(path), len(new), drafter.threshold, proposal.draft_s,
                      clock(output_device(model)) - proposal.verify_start, draft.source if draft.tokens else "",
                      confidence, proposal.gated, len(draft.tokens), depth)
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
