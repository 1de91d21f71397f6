"""What a registered strategy is: a name, a one-line description and a builder, and the inputs every builder gets.

Each module that implements strategies lists them in its `STRATEGIES`, beside the drafter they build (the
self_spec family in drafters/layer_skip.py, the HF baselines in hf_baselines.py, ...); decoding/strategies.py
gathers those lists into `REGISTRY`, the one table `make_strategy` and `python -m selfspec strategies` read.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace

from selfspec.decoding.costs import CostMeter, DraftCosts
from selfspec.decoding.draft_exit import CostAwareExit, DraftExit, make_exit_policy
from selfspec.decoding.options import GenerationOptions
from selfspec.errors import SelfspecError
from selfspec.models.draft_vocabulary import DraftVocabulary
from selfspec.models.feature_head import FeatureHead, loaded_feature_head
from selfspec.models.token_store import TokenStore, loaded_token_store
from selfspec.settings import DraftSettings, HFSettings, KangarooSettings, SkipSet


@dataclass(frozen=True)
class StrategyInputs:
    """Everything a strategy may be built from (make_strategy's arguments), so every builder takes one argument."""
    model: object
    options: GenerationOptions
    skip: SkipSet  # the layer-skip draft's
    draft: DraftSettings
    costs: CostMeter  # measured on first use, shared by the strategies of a run
    draft_model: object = None
    draft_vocabulary: DraftVocabulary | None = None
    hf: HFSettings | None = None
    kangaroo: KangarooSettings | None = None
    searched: tuple[SkipSet, DraftVocabulary | None] | None = None  # self_spec_searched's skip set and draft vocabulary

    def for_batch(self, rows: int) -> "StrategyInputs":
        """These inputs for a row of a batch of `rows`: the cost-aware exit weighs a row's share of the batch's
        verify (CostMeter.for_batch)."""
        return replace(self, costs=self.costs.for_batch(rows))

    @property
    def feature_head(self) -> FeatureHead | None:
        """draft.head, loaded on first use (once per model): the model draft of self_spec_head, hybrid and tree."""
        return loaded_feature_head(self.model, self.draft.head)

    @property
    def token_store(self) -> TokenStore | None:
        """draft.store, loaded on first use (once per model): self_spec_tree's draft where the context has no copy."""
        return loaded_token_store(self.model, self.draft.store)

    @property
    def hybrid_policy(self) -> str:
        """The policy of the strategies that mix copies and model drafts: draft.hybrid_policy, else draft.policy."""
        return self.draft.hybrid_policy or self.draft.policy

    def exit_policy(self, policy: str, drafted_by: SkipSet | None = None, head: DraftVocabulary | None = None,
                    max_tokens: int | None = None, alone: bool = False) -> DraftExit:
        """A fresh policy, so no two strategies share one; the cost-aware one gets the costs of drafting with
        `drafted_by` and `head` (None: copies, which cost nothing to draft); `alone`: in a batch, the drafter drafts
        each row on its own instead of the rows together (CostMeter.costs)."""
        costs = self.costs.costs(drafted_by, head, alone) if policy == "cost" else None
        return self.make_exit_policy(policy, costs, max_tokens)

    def make_exit_policy(self, policy: str, costs: DraftCosts | None, max_tokens: int | None = None) -> DraftExit:
        """A fresh `policy`; the cost-aware one needs the drafter's `costs` (a row's, in a batch of costs.rows)."""
        return make_exit_policy(self.draft, self.options.sampling.greedy, policy, costs, max_tokens, self.costs.rows)

    def require_feature_head(self, strategy: str) -> None:
        if self.feature_head is None:
            raise SelfspecError(f"strategy {strategy} needs draft.head=<head.pt> (or shipped, where the model ships "
                                f"one); train one with python run.py experiment=train_draft trained_draft=feature")

    def require_token_store(self, strategy: str) -> None:
        if self.token_store is None:
            raise SelfspecError(f"strategy {strategy} needs draft.store=<store.pt> (or shipped, where the model ships "
                                f"one); python run.py experiment=train_draft writes one beside head.pt")

    def copy_policy(self, policy: str) -> CostAwareExit | None:
        """The copiers' cost-aware policy, which may copy up to draft.ngram_tokens; None under other policies."""
        return self.exit_policy(policy, max_tokens=self.draft.ngram_tokens) if policy == "cost" else None

    def unpriced_exit_policy(self, strategy: str) -> DraftExit:
        """draft.policy for a drafter whose draft-token cost the cost meter does not measure (a separate model, an
        adapter), which therefore cannot take the cost-aware policy."""
        if self.draft.policy == "cost":
            raise SelfspecError(f"draft.policy=cost is for the layer-skip and copying drafters; strategy {strategy} "
                                f"takes draft.policy=fixed, threshold or adaptive")
        return self.exit_policy(self.draft.policy)


@dataclass(frozen=True)
class StrategySpec:
    name: str
    description: str  # one line: what `python -m selfspec strategies` prints after the name
    build: Callable[[StrategyInputs], object]  # the drafter (None: plain decoding); an HF baseline's whole strategy
    hf_baseline: bool = False  # HF's own generate (hf_baselines.py): takes any model layout, builds no drafter
