"""Lookahead decoding (Fu et al., ICML 2024): Jacobi iteration over a window of guessed future tokens runs in the
verify forward itself, and the n-grams its trajectories complete feed a pool that later steps draft from.

The window holds up to N - 1 levels of W tokens; level k guesses window columns k..k + W - 1 after the context.
Each step's token tree carries, beside the pool's candidates, the lookahead branch: level 0 as a chain from the
root, and from each of its columns c the diagonal of levels 1.. (level k at column c + k), so a top-level node sees
the context, level 0 up to column c and its diagonal: the paper's lookahead mask, each node attending to its
ancestors. The full model's argmax after each top-level node is the next level's guess for the column after it;
with N - 1 levels the diagonal plus that guess is an N-gram, pooled by its first token (at most G per token, the
newest first). The oldest level then drops out. The verification branch is the trie (`add_branch`) of the pool's
n-grams that start with the context's last token. A lookahead node equal to the full model's choice is accepted
like any draft, so output stays the full model's. Prompt lookup copies n-grams of the context; this pool holds
n-grams the model itself guessed, kept across a strategy's generations (the window restarts per generation, from
tokens of its prompt).
"""

import random

from selfspec.decoding.drafters.base import Draft, GenerationContext, Verification, require_positive
from selfspec.decoding.drafters.ngram import NGRAM
from selfspec.decoding.drafters.ngram_tree import add_branch
from selfspec.decoding.registry import StrategyInputs, StrategySpec
from selfspec.decoding.sampling import one_hot_q
from selfspec.errors import SelfspecError
from selfspec.models.devices import output_device


class LookaheadDrafter:
    """Window `window` (W), n-gram size `ngram` (N), at most `candidates` (G) pool n-grams verified per step."""

    def __init__(self, model, window: int = 4, ngram: int = 3, candidates: int = 4):
        require_positive(lookahead_window=window, lookahead_candidates=candidates)
        if ngram < 2:
            raise SelfspecError(f"lookahead_ngram={ngram} must be >= 2 (an n-gram is a key token and what follows)")
        self.window, self.ngram, self.candidates = window, ngram, candidates
        self.vocab_size, self.device = model.get_output_embeddings().weight.shape[0], output_device(model)
        self.pool: dict[int, list[tuple[int, ...]]] = {}  # first token -> up to G continuations, newest first
        self.levels: list[list[int]] = []  # oldest first; level k guesses columns k..k + W - 1
        self.pending: tuple[Draft, list[int]] | None = None  # the last draft and its top-level nodes, per column
        self.context: GenerationContext | None = None

    @property
    def max_tokens(self) -> int:
        return (self.candidates + self.window) * (self.ngram - 1)

    @property
    def threshold(self) -> float:
        return 0.0

    def begin(self, context: GenerationContext) -> None:
        self.context, self.levels, self.pending = context, [], None

    def draft(self, tokens: list[int], max_tokens: int) -> Draft:
        """The pool's n-grams after tokens[-1] as a trie, then the lookahead branch, both within `max_tokens` levels
        (a window deeper than that waits for the next generation)."""
        if not self.levels:  # Jacobi starts from arbitrary guesses: the paper's, tokens of the prompt
            self.levels = [random.Random(len(tokens)).choices(tokens, k=self.window)]
        draft = Draft(source=NGRAM, parents=[])
        for continuation in self.pool.get(tokens[-1], []):
            add_branch(draft, list(continuation[:max_tokens]), self.candidates * (self.ngram - 1), self.candidates)
        top = self.add_window(draft) if self.window + len(self.levels) - 1 <= max_tokens else []
        self.pending = (draft, top) if top else None
        if not draft.tokens:
            return Draft()
        if not self.context.settings.greedy:
            draft.probs = one_hot_q(draft.tokens, self.vocab_size, self.device)
        return draft

    def add_window(self, draft: Draft) -> list[int]:
        """Append the lookahead branch to `draft`; return the top level's node index per column."""
        parent, top = -1, []
        for c, token in enumerate(self.levels[0]):
            draft.tokens.append(token)
            draft.parents.append(parent)
            parent = diagonal = len(draft.tokens) - 1
            for level in self.levels[1:]:
                draft.tokens.append(level[c])
                draft.parents.append(diagonal)
                diagonal = len(draft.tokens) - 1
            top.append(diagonal)
        return top

    def update(self, drafted: int, accepted: int, path: list[int] | None = None, source: str = "model") -> None:
        pass  # the window and pool learn from the scores (observe_verification)

    def observe_verify_ms(self, tokens: int, ms: float) -> None:
        pass

    def observe_verification(self, verification: Verification) -> None:
        """Advance the window one level with the full model's argmax after each top-level node, pooling the N-grams
        the full window completes."""
        if self.pending is None or verification.draft is not self.pending[0]:
            return
        top = self.pending[1]
        guesses = verification.target[[i + 1 for i in top]].argmax(dim=-1).tolist()  # (W,)
        if len(self.levels) == self.ngram - 1:
            for c, guess in enumerate(guesses):
                self.add_ngram([level[c] for level in self.levels] + [guess])
            self.levels.pop(0)
        self.levels.append(guesses)

    def add_ngram(self, gram: list[int]) -> None:
        continuations = self.pool.setdefault(gram[0], [])
        rest = tuple(gram[1:])
        if rest in continuations:
            continuations.remove(rest)
        continuations.insert(0, rest)
        del continuations[self.candidates:]


def build_lookahead(inputs: StrategyInputs) -> LookaheadDrafter:
    draft = inputs.draft
    return LookaheadDrafter(inputs.model, draft.lookahead_window, draft.lookahead_ngram, draft.lookahead_candidates)


STRATEGIES = (
    StrategySpec("lookahead", "Lookahead decoding: Jacobi guesses in the verify forward complete n-grams; the pool's "
                 "n-grams after the last token verified as a token tree (draft.lookahead_*)", build_lookahead),
)
