"""What one generation produced and how: per-verification records and per-prompt metrics."""

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
