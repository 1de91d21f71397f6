"""The `skip_strategy` group: how `self_spec` chooses its skip set (conf/skip_strategy/<name>.yaml)."""

from dataclasses import dataclass

from selfspec.settings.typed import at_least, in_unit, one_of

SKIP_STRATEGIES = ("static", "swift", "clasp", "knapsack")


@dataclass(kw_only=True)
class SkipStrategySettings:
    """static: the `skip=` set (or the search's); swift: searched from the context in the first steps; clasp: chosen
    after each verification from its layer states; knapsack: the sublayers that maximise expected tokens per second."""
    name: str = "static"
    skip_fraction: float = 0.45  # swift, clasp: share of the layers skipped
    search_steps: int = 8  # swift: verifications whose context scores candidate sets (its optimisation phase)
    candidates: int = 4  # swift: candidate sets scored per search step
    window: int = 32  # swift: the context's last tokens a candidate's parallel draft is scored on
    confidence: float = 0.7  # swift: a draft stops below this top probability (confidence-aware drafting)
    rechoose_every: int = 4  # knapsack: verifications between choices

    def __post_init__(self):
        one_of("skip_strategy.name", self.name, SKIP_STRATEGIES)
        in_unit("skip_strategy.skip_fraction", self.skip_fraction)
        in_unit("skip_strategy.confidence", self.confidence)
        for name in ("search_steps", "candidates", "window", "rechoose_every"):
            at_least(f"skip_strategy.{name}", getattr(self, name), 1)
