"""Draft-exit policies: when to stop drafting and verify.

`fixed` drafts `max_tokens` tokens; `threshold` stops after a draft token whose draft probability (the
draft distribution's top probability) falls below a fixed threshold; `adaptive` is Draft & Verify's rule,
which moves that threshold after every verification towards a target acceptance rate.
"""

from dataclasses import dataclass, field

from selfspec.errors import SelfspecError
from selfspec.settings import DraftSettings


def default_threshold(greedy: bool) -> float:
    """The starting draft-exit threshold when `draft.threshold` is null: the paper code's 0.8 for greedy decoding,
    0.5 for sampling."""
    return 0.8 if greedy else 0.5


def _check_unit(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise SelfspecError(f"{name}={value} is outside [0, 1]")


@dataclass
class DraftExit:
    """Fixed draft length: never stops early."""
    max_tokens: int = 12

    def __post_init__(self):
        if self.max_tokens < 1:
            raise SelfspecError(f"max_tokens={self.max_tokens} must be >= 1")

    @property
    def threshold(self) -> float:
        return 0.0

    def should_stop(self, confidence: float) -> bool:
        return False

    def update(self, drafted: int, accepted: int) -> None:
        pass


@dataclass
class ThresholdExit(DraftExit):
    """Stop after a draft token whose confidence is below a fixed threshold."""
    initial_threshold: float = 0.8

    def __post_init__(self):
        super().__post_init__()
        _check_unit("threshold", self.initial_threshold)
        self.current = self.initial_threshold

    @property
    def threshold(self) -> float:
        return self.current

    def should_stop(self, confidence: float) -> bool:
        return confidence < self.current


@dataclass
class AdaptiveExit(ThresholdExit):
    """Draft & Verify's adaptive threshold (their code's `auto_parameters`, one update per verification)."""
    beta1: float = 0.5  # smoothing of the acceptance rate
    target_acceptance: float = 0.9  # alpha
    epsilon: float = 0.01
    beta2: float = 0.9  # smoothing of the threshold
    mean_acceptance: float = field(default=0.0, init=False)

    def __post_init__(self):
        super().__post_init__()
        for name in ("beta1", "target_acceptance", "epsilon", "beta2"):
            _check_unit(name, getattr(self, name))

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.mean_acceptance = self.beta1 * self.mean_acceptance + (1 - self.beta1) * accepted / drafted
        if self.mean_acceptance < self.target_acceptance:
            candidate = self.current + self.epsilon
        elif drafted == self.max_tokens:
            candidate = self.current
        else:
            candidate = self.current - self.epsilon
        self.current = self.beta2 * self.current + (1 - self.beta2) * candidate


def make_exit_policy(draft: DraftSettings, greedy: bool, policy: str | None = None) -> DraftExit:
    """A fresh draft-exit policy from the `draft` settings; `policy` overrides their kind."""
    policy = policy or draft.policy
    threshold = draft.threshold if draft.threshold is not None else default_threshold(greedy)
    if policy == "fixed":
        return DraftExit(draft.max_tokens)
    if policy == "threshold":
        return ThresholdExit(draft.max_tokens, threshold)
    if policy == "adaptive":
        return AdaptiveExit(draft.max_tokens, threshold, **draft.adaptive_options)
    raise SelfspecError(f"draft.policy={policy!r} is unknown; allowed: fixed, threshold, adaptive")
