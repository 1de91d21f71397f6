"""The layer-skip drafter whose skip set a chooser re-chooses while decoding, and the strategies it makes.

`ChoosingDrafter` is Draft & Verify's chain (SelfDrafter) told every verification (`observe_verification`): it arms
hooks that capture the full model's layer states during that verification (capture.py; its own skipped forwards run
before), hands them with the verification to its chooser, and drafts with the set the chooser returns. Every set it
drafts with is kept with the verification it took effect after (`chosen`, per generation in `history`), for records
and the figure of which layers each strategy skips (plots/skip_choice.py). Any skip set keeps decoding lossless:
only the draft changes, and the full model verifies every token.
"""

from collections.abc import Generator
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from selfspec.decoding.draft_exit import CostAwareExit, DraftExit
from selfspec.decoding.drafters.base import Draft, DraftForward, GenerationContext, Verification
from selfspec.decoding.drafters.layer_skip import SelfDrafter
from selfspec.decoding.registry import StrategyInputs, StrategySpec
from selfspec.decoding.skip_choice.capture import LayerStates, StateCapture
from selfspec.decoding.skip_choice.clasp import clasp_skip_layers
from selfspec.decoding.skip_choice.knapsack import (SublayerPrices, fitted_lambda, knapsack_skip, sublayer_losses,
                                                     sublayer_prices)
from selfspec.decoding.skip_choice.swift import SwiftSearch
from selfspec.models.layouts import num_layers
from selfspec.settings import SkipSet


@dataclass(frozen=True)
class ChosenSet:
    step: int  # the verifications of its generation before it drafted (0: from the start)
    skip: SkipSet


class SkipChooser(Protocol):
    needs_states: bool  # whether it reads the verification's layer states

    def begin(self) -> None:
        """A new generation starts."""

    def choose(self, step: int, states: LayerStates | None, verification: Verification, tokens: list[int],
               current: SkipSet) -> SkipSet | None:
        """The set to draft with after verification `step` (1-based) of `tokens` so far; None: keep `current`."""


class ChoosingDrafter(SelfDrafter):
    def __init__(self, model, chooser: SkipChooser, first: SkipSet, exit_policy: DraftExit,
                 prices: SublayerPrices | None = None):
        super().__init__(model, first, exit_policy)
        self.chooser, self.prices = chooser, prices  # prices: to re-price a cost-aware exit's draft token
        self.capture = StateCapture(model) if chooser.needs_states else None
        self.history: list[list[ChosenSet]] = []  # per generation, the sets it drafted with
        self.steps, self.tokens = 0, []

    @property
    def chosen(self) -> list[ChosenSet]:
        """This generation's sets, in order."""
        return self.history[-1] if self.history else []

    def begin(self, context: GenerationContext) -> None:
        super().begin(context)
        self.chooser.begin()
        self.steps = 0
        self.history.append([ChosenSet(0, self.source.skip)])

    def draft(self, tokens: list[int], max_tokens: int) -> Draft:
        draft = super().draft(tokens, max_tokens)
        self._await_verification(tokens)
        return draft

    def batch_draft(self, tokens: list[int], max_tokens: int) -> Generator[DraftForward, torch.Tensor, Draft]:
        draft = yield from super().batch_draft(tokens, max_tokens)
        self._await_verification(tokens)
        return draft

    def _await_verification(self, tokens: list[int]) -> None:
        self.tokens = tokens
        if self.capture is not None:
            self.capture.arm()

    def observe_verification(self, verification: Verification) -> None:
        self.steps += 1
        states = self._states(verification)
        accepted = [verification.draft.tokens[i] for i in verification.path]
        skip = self.chooser.choose(self.steps, states, verification, self.tokens + accepted, self.source.skip)
        if skip is not None and skip != self.source.skip:
            self.use(skip)

    def _states(self, verification: Verification) -> LayerStates | None:
        """The full model's states at the last accepted token of the verification just captured."""
        if self.capture is None or not self.capture.handles:
            return None
        rows = next(iter(self.capture.seen.values())).shape[0] if self.capture.seen else 0
        self.capture.disarm()
        last = verification.path[-1] + 1 if verification.path else 0  # the accepted path's row among 1 + drafted
        return self.capture.states(rows - 1 - len(verification.draft.tokens) + last)

    def use(self, skip: SkipSet) -> None:
        self.source.skip = skip
        self.history[-1].append(ChosenSet(self.steps, skip))
        if self.prices is not None and isinstance(self.exit_policy, CostAwareExit):
            self.exit_policy.costs = self.prices.draft_costs(skip)


class ClaspChooser:
    """CLaSp: after every verification, the `budget` layers (both sublayers) clasp_skip_layers picks."""
    needs_states = True

    def __init__(self, budget: int):
        self.budget = budget

    def begin(self) -> None:
        pass

    def choose(self, step, states, verification, tokens, current):
        if states is None:
            return None
        layers = clasp_skip_layers(states, self.budget)
        return SkipSet(layers, layers)


class KnapsackChooser:
    """The cost-aware knapsack (knapsack.py), re-chosen every `every` verifications from the sublayer losses and the
    acceptance met since the last choice."""
    needs_states = True

    def __init__(self, prices: SublayerPrices, max_tokens: int, every: int):
        self.prices, self.max_tokens, self.every = prices, max_tokens, every
        self.losses: list[torch.Tensor] = []
        self.accepted = self.trials = 0
        self.lam: float | None = None

    def begin(self) -> None:
        pass

    def choose(self, step, states, verification, tokens, current):
        if states is not None:
            self.losses.append(sublayer_losses(states))
        drafted, accepted = len(verification.draft.tokens), len(verification.path)
        self.accepted += accepted
        self.trials += accepted + (accepted < drafted)  # each acceptance and the rejection that ended a draft
        if step % self.every or not self.losses or not self.trials:
            return None
        losses = torch.stack(self.losses).mean(dim=0)  # (2, layers)
        self.lam = fitted_lambda(current, losses, self.accepted / self.trials) or self.lam
        self.losses, self.accepted, self.trials = [], 0, 0
        return None if self.lam is None else knapsack_skip(losses, self.prices, self.lam, self.max_tokens)[0]


class SwiftChooser:
    """SWIFT: the search's best set after each verification of the optimisation phase, then that set."""
    needs_states = False

    def __init__(self, search: SwiftSearch, steps: int):
        self.search, self.steps = search, steps

    def begin(self) -> None:
        pass

    def choose(self, step, states, verification, tokens, current):
        return self.search.best(current, tokens) if step <= self.steps else None


def _prices(inputs: StrategyInputs) -> SublayerPrices:
    return sublayer_prices(inputs.model, inputs.costs.costs(None).verify_ms)


def build_clasp(inputs: StrategyInputs) -> ChoosingDrafter:
    budget = round(inputs.draft.skip_strategy.skip_fraction * num_layers(inputs.model))
    return _drafter(inputs, ClaspChooser(budget), inputs.exit_policy(inputs.draft.policy, inputs.skip))


def build_knapsack(inputs: StrategyInputs) -> ChoosingDrafter:
    chooser = KnapsackChooser(_prices(inputs), inputs.draft.max_tokens, inputs.draft.skip_strategy.rechoose_every)
    return _drafter(inputs, chooser, inputs.exit_policy(inputs.draft.policy, inputs.skip))


def build_swift(inputs: StrategyInputs) -> ChoosingDrafter:
    settings, layers = inputs.draft.skip_strategy, num_layers(inputs.model)
    search = SwiftSearch(inputs.model, layers, round(settings.skip_fraction * 2 * layers), settings.candidates,
                         settings.window)
    confident = replace(inputs, draft=replace(inputs.draft, threshold=settings.confidence))
    exit_policy = confident.exit_policy("threshold", inputs.skip)
    return _drafter(inputs, SwiftChooser(search, settings.search_steps), exit_policy)


def _drafter(inputs: StrategyInputs, chooser: SkipChooser, exit_policy: DraftExit) -> ChoosingDrafter:
    prices = _prices(inputs) if isinstance(exit_policy, CostAwareExit) else None
    return ChoosingDrafter(inputs.model, chooser, inputs.skip, exit_policy, prices)


BUILDERS = {"swift": build_swift, "clasp": build_clasp, "knapsack": build_knapsack}
STRATEGIES = (
    StrategySpec("self_spec_swift", "self_spec whose skip set SWIFT searches from the context in the first steps "
                 "(skip_strategy.*)", build_swift),
    StrategySpec("self_spec_clasp", "self_spec whose skipped layers CLaSp's dynamic programme picks after each "
                 "verification", build_clasp),
    StrategySpec("self_spec_knapsack", "self_spec skipping the sublayers a cost-aware knapsack picks for tokens/s",
                 build_knapsack),
)
