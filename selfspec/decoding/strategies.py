"""Decoding strategies with one `generate(prompt, generator)` signature, so runs and benchmarks loop over them.

`REGISTRY` names every strategy (`python -m selfspec strategies` lists them with what each does); each module that
implements strategies lists them beside its drafter (decoding/registry.py), and `make_strategy` builds one by name.
Every drafting strategy takes `draft.target_gate`.
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch

from selfspec.decoding import hf_baselines
from selfspec.decoding.batch import decode_batch_steps, generate_batch
from selfspec.decoding.costs import CostMeter
from selfspec.decoding.drafters import (Drafter, feature_head, hybrid, layer_skip, layer_skip_tree, lookahead, ngram,
                                       ngram_tree, token_recycling, two_model)
from selfspec.decoding.drafters import kangaroo as kangaroo_drafter
from selfspec.decoding.hf_baselines import HFStrategy
from selfspec.decoding.skip_choice import drafter as skip_choice
from selfspec.decoding.registry import StrategyInputs, StrategySpec
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.results import Emitted, GenerationResult
from selfspec.decoding.speculative import decode_steps, generate
from selfspec.errors import SelfspecError
from selfspec.models.draft_vocabulary import DraftVocabulary
from selfspec.models.layouts import decoder_layers
from selfspec.settings import DraftSettings, HFSettings, KangarooSettings, SkipSet

PLAIN = StrategySpec("plain", "the full model alone, one token per forward: the output every strategy must equal",
                     lambda inputs: None)
# every strategy by name, in the order listings show them; a module with new strategies joins here
REGISTRY = {spec.name: spec for spec in (PLAIN, *layer_skip.STRATEGIES, *hybrid.STRATEGIES, *feature_head.STRATEGIES,
                                         *ngram.STRATEGIES, *two_model.STRATEGIES, *kangaroo_drafter.STRATEGIES,
                                         *hf_baselines.STRATEGIES, *ngram_tree.STRATEGIES, *layer_skip_tree.STRATEGIES,
                                         *token_recycling.STRATEGIES, *lookahead.STRATEGIES, *skip_choice.STRATEGIES)}
NAMES = tuple(REGISTRY)


@dataclass
class Strategy:
    """Our decoder: plain when `drafter` is None, speculative otherwise."""
    name: str
    model: object
    options: GenerationOptions  # a call's generator replaces options.generator
    drafter: Drafter | None = None
    new_drafter: Callable[[int], Drafter | None] = lambda rows: None  # a fresh drafter for a row of a batch of rows
    row_drafters: dict[int, list[Drafter | None]] = field(default_factory=dict)  # by batch size; shared by replace()

    def drafters(self, rows: int) -> list[Drafter | None]:
        """One drafter per row of a batch of `rows`, kept for the next batch of that size (their draft-exit
        policies go on learning from one prompt to the next, as the batch-1 drafter's do)."""
        if rows not in self.row_drafters:
            self.row_drafters[rows] = [self.new_drafter(rows) for _ in range(rows)]
        return self.row_drafters[rows]

    def generate(self, prompt: list[int], generator: torch.Generator | None = None) -> GenerationResult:
        return generate(self.model, prompt, replace(self.options, generator=generator), self.drafter)

    def steps(self, prompt: list[int], generator: torch.Generator | None = None) -> Iterator[Emitted]:
        """`generate` step by step (decode_steps), for streaming."""
        return decode_steps(self.model, prompt, replace(self.options, generator=generator), self.drafter)

    def generate_batch(self, prompts: list[list[int]], generators: list[torch.Generator | None] | None = None,
                       batch_size: int | None = None) -> list[GenerationResult]:
        """`generate` for several prompts, `batch_size` (default: all) decoding together at a time, a waiting prompt
        joining as a row ends (decoding/batch.py): one result per prompt. The rows' drafters are those of batches
        of `batch_size`, so fewer prompts than rows draft as a full batch's would."""
        rows = min(batch_size or len(prompts), len(prompts))
        drafters = self.drafters(batch_size or len(prompts))[:rows]
        return generate_batch(self.model, prompts, self.options, drafters, generators, rows)

    def batch_steps(self, prompts: list[list[int]], generators: list[torch.Generator | None] | None = None
                    ) -> Iterator[tuple[int, Emitted]]:
        """`generate_batch` step by step: (prompt index, what it emitted), for streaming."""
        return decode_batch_steps(self.model, prompts, self.options, self.drafters(len(prompts)), generators)


def make_strategy(name: str, model, options: GenerationOptions, *, skip: SkipSet, draft: DraftSettings,
                  draft_model=None, draft_vocabulary: DraftVocabulary | None = None, hf: HFSettings | None = None,
                  kangaroo: KangarooSettings | None = None,
                  searched: tuple[SkipSet, DraftVocabulary | None] | None = None,
                  costs: CostMeter | None = None) -> Strategy | HFStrategy:
    """The strategy `name` (see REGISTRY), with fresh draft-exit policies. `skip`: the layer-skip draft's skip set;
    `searched`: self_spec_searched's skip set and draft vocabulary; `costs`: this machine's step costs for the
    cost-aware policy, measured on first use and shared by a run's strategies."""
    spec = REGISTRY.get(name)
    if spec is None:
        raise SelfspecError(f"strategy {name!r} is unknown; allowed: {', '.join(REGISTRY)}")
    if spec.hf_baseline and options.rules is not None:
        raise SelfspecError(f"strategy {name} is transformers' own generate, which has no banned words with "
                            f"rollback; drop it from strategies, or constraints.banned_words and sampling.stop")
    if not spec.hf_baseline:
        decoder_layers(model)  # our decoding needs the supported layout: say so before any prompt runs
    inputs = StrategyInputs(model, options, skip, draft, costs or cost_meter(model, draft), draft_model,
                            draft_vocabulary, hf, kangaroo, searched)
    if spec.hf_baseline:
        return spec.build(inputs)
    drafter = spec.build(inputs)
    gated = replace(options, target_gate=draft.target_gate if drafter is not None else None)
    return Strategy(name, model, gated, drafter, lambda rows: spec.build(inputs.for_batch(rows)))


def cost_meter(model, draft: DraftSettings) -> CostMeter:
    """The meter the cost-aware exit reads, for verifies as wide as any draft of `draft`'s drafters (plus one)."""
    return CostMeter(model, max(draft.max_tokens, draft.ngram_tokens, draft.tree_nodes) + 1)
