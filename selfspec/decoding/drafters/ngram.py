"""Prompt lookup: copy what followed earlier occurrences of the context's last tokens, at no model cost. The chain
copier (here) and the tree copier (ngram_tree.py) share the matcher, `ngram_matches`, and a `Copier`'s policies."""

import copy
from array import array
from collections.abc import Sequence

from selfspec.decoding.draft_exit import DraftExit
from selfspec.decoding.drafters.base import Draft, GenerationContext, cut_at_end, require_positive
from selfspec.decoding.registry import StrategyInputs, StrategySpec
from selfspec.decoding.sampling import one_hot_q
from selfspec.models.devices import output_device

NGRAM = "ngram"  # Draft.source of copied drafts


class PoliciesByMatch:
    """A drafter's draft-exit policy, one apart per match length n = 1..longest: a copier's n-gram match, or the
    longest suffix of the context a token store holds (StoreTreeDrafter). Copies after a longer match are right far
    more often, so with one policy for all, a run of failed 1-token copies would stop the longer ones too. The tree
    kinds' counts (`branch_counts`) are shared; `exit_policy`, the one for n = longest, is every policy's template."""

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


class Copier:
    """What the chain and tree copiers share: the context's n-gram matches (`ngram_matches`) cut at an end id, and
    a draft-exit policy per match length (`PoliciesByMatch`; None: a copy is as long as the match allows). A copy is
    deterministic, so its q is one-hot: sampled verification accepts x with probability p(x), else resamples from p
    without x."""

    def __init__(self, model, ngram_size: int, exit_policy: DraftExit | None):
        require_positive(ngram_size=ngram_size)
        self.ngram_size = ngram_size
        self.vocab_size, self.device = model.get_output_embeddings().weight.shape[0], output_device(model)
        self.exit_policy = exit_policy
        self.policies = PoliciesByMatch(exit_policy, ngram_size) if exit_policy else None
        self.context: GenerationContext | None = None

    @property
    def threshold(self) -> float:
        return self.policies.last.threshold if self.policies else 0.0

    def begin(self, context: GenerationContext) -> None:
        self.context = context
        if self.policies:
            self.policies.begin()

    def observe_verify_ms(self, tokens: int, ms: float) -> None:
        if self.policies:
            self.policies.observe_verify_ms(tokens, ms)

    def update(self, drafted: int, accepted: int, path: list[int] | None = None, source: str = "model") -> None:
        if self.policies is None:
            return
        if path is None:
            self.policies.last.update(drafted, accepted)
        else:
            self.policies.last.update_tree(path)

    def copies(self, tokens: list[int], max_tokens: int, limit: int) -> list[tuple[int, list[int]]]:
        """`ngram_matches`, each copy cut after its first end id."""
        return [(n, cut_at_end(copied, self.context.end_ids))
                for n, copied in ngram_matches(tokens, self.ngram_size, max_tokens, limit)]


class NgramDrafter(Copier):
    """The first of the context's copies (`ngram_matches`), at most `num_tokens` long; with an exit policy (the
    cost-aware one of self_spec_hybrid) each copied token counts as confidence 1.0 and the policy of the match's
    length cuts the copy where it stops paying."""

    def __init__(self, model, ngram_size: int = 2, num_tokens: int = 10, exit_policy: DraftExit | None = None):
        super().__init__(model, ngram_size, exit_policy)
        require_positive(ngram_tokens=num_tokens)
        self.num_tokens = num_tokens

    @property
    def max_tokens(self) -> int:
        return self.num_tokens

    def draft(self, tokens: list[int], max_tokens: int) -> Draft:
        copies = self.copies(tokens, min(max_tokens, self.num_tokens), limit=1)
        copied = copies[0][1] if copies else []
        if self.policies and copied:
            copied = cut_copy(self.policies[copies[0][0]], copied)
        probs = [] if self.context.settings.greedy else one_hot_q(copied, self.vocab_size, self.device)
        return Draft(copied, probs, NGRAM)


def cut_copy(exit_policy: DraftExit, copied: list[int], siblings: Sequence[float] = ()) -> list[int]:
    """As much of a copy as `exit_policy` drafts: its plan (with a trie's `siblings` of the copy's first token, under
    the cost-aware exit), then a should_stop per copied token (confidence 1.0)."""
    copied = copied[:exit_policy.plan(len(copied), siblings)]
    for length in range(1, len(copied) + 1):
        if exit_policy.should_stop(1.0):
            return copied[:length]
    return copied


def ngram_matches(tokens: list[int], ngram_size: int, max_tokens: int, limit: int) -> list[tuple[int, list[int]]]:
    """Up to `limit` distinct continuations (each at most `max_tokens` long) of earlier occurrences of the
    context's last n tokens, n = ngram_size down to 1, latest occurrence first within each n; each with its n.

    For example, with ngram_size=2, max_tokens=3 and the context

        7 1 2 3 9 2 4 1 2 5 6 1 2
                              ^^^  the last 2 tokens, "1 2"

    "1 2" occurred twice before: followed by "5 6 1" (the latest) and "3 9 2". Then "2" alone: after its latest
    occurrence came "5 6 1" again, then "4 1 2", then "3 9 2" again. Distinct continuations are kept, so

        ngram_matches(...) == [(2, [5, 6, 1]), (2, [3, 9, 2]), (1, [4, 1, 2])]

    The chain copier drafts the first, 5 6 1 (limit=1); the tree copier merges them all into a trie with three
    roots (5, 3, 4). Invariant: an occurrence ends before the context's last token, so it has a continuation. The
    context is searched as bytes, 4 a token (`bytes.rfind` runs in C; a match must start on a token's first
    byte)."""
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
