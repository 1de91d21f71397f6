"""Draft & Verify's drafter: the target model itself with a skip set, over the target's own cache."""

from collections.abc import Generator
from functools import partial

import torch

from selfspec.decoding.draft_exit import DraftExit
from selfspec.decoding.drafters.base import ChainDrafter, Draft, DraftForward, GenerationContext
from selfspec.decoding.registry import StrategyInputs, StrategySpec
from selfspec.errors import SelfspecError
from selfspec.models.cache import forward, forward_hidden
from selfspec.models.draft_vocabulary import DraftVocabulary
from selfspec.models.skip import skipping
from selfspec.settings import POLICIES, SkipSet


class SkippedModel:
    """The target model with `skip` sublayers left out, over the target's own cache (its draft entries are
    overwritten by the verification); with a `head`, it scores only that reduced vocabulary."""

    def __init__(self, model, skip: SkipSet, head: DraftVocabulary | None = None):
        self.model, self.skip, self.head = model, skip, head
        self.cache = None

    def begin(self, context: GenerationContext) -> None:
        self.cache = context.cache

    def drafting(self, tokens: list[int]):
        return skipping(self.model, self.skip)

    def next_logits(self, ids: list[int], start: int) -> torch.Tensor:
        if self.head is None:
            return forward(self.model, self.cache, ids, start, last_only=True)[-1]  # (vocab,)
        return self.head.logits(forward_hidden(self.model, self.cache, ids, start))


class SelfDrafter(ChainDrafter):
    """Draft & Verify's chain, which a batch drafts for all its rows with the same skip set and head at once."""

    def __init__(self, model, skip: SkipSet, exit_policy: DraftExit, head: DraftVocabulary | None = None):
        super().__init__(SkippedModel(model, skip, head), exit_policy)

    def batch_draft(self, tokens: list[int], max_tokens: int) -> Generator[DraftForward, torch.Tensor, Draft]:
        """`draft` for a row of a batch (decoding/batch.py): yields each draft forward and is sent its logits
        (vocab,)."""
        shared_by = []  # per draft forward, the rows that ran it
        steps = self.draft_steps(tokens, len(tokens) - 1, max_tokens, shared_by)
        try:
            ids, start = next(steps)
            while True:
                request = DraftForward(self.source.skip, self.source.head, ids, start)
                logits = yield request
                shared_by.append(request.rows)
                ids, start = steps.send(logits)
        except StopIteration as done:
            return done.value


def build_self_spec(inputs: StrategyInputs, policy: str | None = None) -> SelfDrafter:
    """The layer-skip drafter under `policy` (None: draft.policy); plain self_spec under a skip_strategy other than
    static chooses its set while decoding (decoding/skip_choice/)."""
    if policy is None and inputs.draft.skip_strategy.name != "static":
        from selfspec.decoding.skip_choice.drafter import BUILDERS  # it builds on this module's SelfDrafter
        return BUILDERS[inputs.draft.skip_strategy.name](inputs)
    policy = policy or inputs.draft.policy
    return SelfDrafter(inputs.model, inputs.skip, inputs.exit_policy(policy, inputs.skip, inputs.draft_vocabulary),
                       inputs.draft_vocabulary)


def build_self_spec_searched(inputs: StrategyInputs) -> SelfDrafter:
    if inputs.searched is None:
        raise SelfspecError("strategy self_spec_searched needs a searched skip set and this model ships none "
                            "(model.searched_skip): run `make search MODEL=<model>`, then pass "
                            "searched_skip.path=<its run dir>/best_skip.yaml, or drop the strategy")
    skip, head = inputs.searched
    return SelfDrafter(inputs.model, skip, inputs.exit_policy(inputs.draft.policy, skip, head), head)


STRATEGIES = (
    StrategySpec("self_spec", "Draft & Verify: the model drafts with its skip set left out, under draft.policy",
                 build_self_spec),
    *(StrategySpec(f"self_spec_{policy}", f"self_spec with draft.policy={policy}, whatever the config sets",
                   partial(build_self_spec, policy=policy)) for policy in POLICIES),
    StrategySpec("self_spec_searched", "self_spec with the searched skip set and draft vocabulary (searched_skip)",
                 build_self_spec_searched),
)
