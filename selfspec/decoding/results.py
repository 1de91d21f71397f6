"""What decoding produces: each step's emitted tokens and record, and each generation's result."""

from dataclasses import dataclass, field


@dataclass
class RecordedStep:
    """A verification step's counts and draft-exit threshold: what the figures read back from records.jsonl (the
    shipped sample records keep only these)."""
    drafted: int
    accepted: int
    emitted: int  # tokens appended by this step: accepted drafts + the correction/bonus token (after EOS/length cut)
    threshold: float


@dataclass
class StepRecord(RecordedStep):
    """One full-model forward after the prefill: the draft it verified, what it kept, and how long it took."""
    draft_s: float
    verify_s: float
    source: str = ""  # which drafter proposed the draft ("model", "ngram"); "" when nothing was drafted
    target_confidence: float = 1.0  # the full model's probability of the token this step emitted last
    gated: bool = False  # drafting skipped: the previous step's target_confidence was at or below draft.target_gate
    tree_size: int = 0  # nodes of a token-tree draft (then `drafted` too, and `accepted` is the accepted depth); 0: a chain
    tree_depth: int = 0  # the tree's deepest branch


@dataclass
class GenerationResult:
    new_tokens: list[int]
    elapsed_s: float  # wall time of the whole generation, prefill included
    prefill_s: float
    steps: list[StepRecord] = field(default_factory=list)
    rollbacks: int = 0  # times a banned word completed and the output was rolled back (decoding/text_rules.py)
    finish_reason: str = "length"  # "stop": an end id or a stop string ended it | "length": max_new_tokens did
    batch_neighbours: list[int] = field(default_factory=list)  # decoded in a batch: the other prompts (indices into
    # the batch's prompts) that were in it while this one was

    @property
    def drafted(self) -> int:
        return sum(s.drafted for s in self.steps)

    @property
    def accepted(self) -> int:
        return sum(s.accepted for s in self.steps)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens; None when nothing was drafted."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted_tokens(self) -> float | None:
        """Tokens emitted per verification forward (1.0 for plain decoding)."""
        return sum(s.emitted for s in self.steps) / len(self.steps) if self.steps else None

    @property
    def gated_steps(self) -> int:
        return sum(s.gated for s in self.steps)

    @property
    def tokens_per_s(self) -> float:
        return len(self.new_tokens) / self.elapsed_s if self.elapsed_s > 0 else 0.0


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
