"""Decoding strategies with one `generate(prompt, generator)` signature, so runs and benchmarks loop over them.

Names: `plain`; `self_spec` (the configured draft exit) or `self_spec_<fixed|threshold|adaptive|cost>`;
`self_spec_searched` (the configured exit with the searched skip set and draft vocabulary, `searched_skip`);
`self_spec_hybrid` (an n-gram copy from the context when there is one, else the layer-skip draft; both under
`draft.hybrid_policy`, the cost-aware exit unless set otherwise, which may copy up to draft.ngram_tokens where
other policies stop copies at draft.max_tokens); `prompt_lookup` (n-gram copies only); `two_model` (needs
`draft_model`); `kangaroo` (needs `kangaroo.adapter_path`); the HF generate baselines `hf_*` (see hf_baselines.py). Token trees (decoding/tree.py,
`draft.tree_*`): `prompt_lookup_tree` (several n-gram copies in a trie) and `self_spec_tree` (that trie when the
context has matches, else the layer-skip draft branching where it is unsure); both under `draft.hybrid_policy` as
self_spec_hybrid, where the cost-aware exit shapes each tree (depth, branches, none) from the measured costs. Every drafting strategy
takes `draft.target_gate`.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from selfspec.decoding.costs import CostMeter
from selfspec.decoding.draft_exit import CostAwareExit, make_exit_policy
from selfspec.decoding.drafters import (Drafter, HybridDrafter, KangarooDrafter, ModelDrafter, NgramDrafter,
                                        NgramTreeDrafter, SelfDrafter, SelfTreeDrafter)
from selfspec.decoding.hf_baselines import HF_STRATEGIES, HFStrategy, make_hf_strategy
from selfspec.decoding.results import GenerationResult, StepRecord
from selfspec.decoding.speculative import decode_steps, generate
from selfspec.errors import SelfspecError
from selfspec.models.draft_head import DraftHead
from selfspec.models.kangaroo_adapter import load_adapter
from selfspec.models.skip import decoder_layers
from selfspec.settings import POLICIES, DraftSettings, HFSettings, KangarooSettings, SamplingSettings, SkipSet

TREE_STRATEGIES = ("prompt_lookup_tree", "self_spec_tree")  # their draft exit: draft.hybrid_policy, as self_spec_hybrid's
NAMES = ("plain", "self_spec", *(f"self_spec_{p}" for p in (*POLICIES, "searched", "hybrid")), "prompt_lookup",
         "two_model", "kangaroo", *HF_STRATEGIES, "prompt_lookup_tree", "self_spec_tree")


@dataclass
class Strategy:
    """Our decoder: plain when `drafter` is None, speculative otherwise."""
    name: str
    model: object
    settings: SamplingSettings
    end_ids: tuple[int, ...]  # any of them ends generation (LoadedModel.end_ids)
    drafter: Drafter | None = None
    target_gate: float | None = None

    def generate(self, prompt: list[int], generator: torch.Generator | None = None) -> GenerationResult:
        return generate(self.model, prompt, self.settings, self.drafter, self.end_ids, generator,
                        self.target_gate)

    def steps(self, prompt: list[int], generator: torch.Generator | None = None
              ) -> Iterator[tuple[list[int], StepRecord | None]]:
        """`generate` step by step (decoding/speculative.py `decode_steps`), for streaming."""
        return decode_steps(self.model, prompt, self.settings, self.drafter, self.end_ids, generator,
                            self.target_gate)


def make_strategy(name: str, model, settings: SamplingSettings, end_ids: tuple[int, ...], skip: SkipSet,
                  draft: DraftSettings, draft_model=None, draft_head: DraftHead | None = None,
                  hf: HFSettings | None = None, kangaroo: KangarooSettings | None = None,
                  searched: tuple[SkipSet, DraftHead | None] | None = None,
                  costs: CostMeter | None = None) -> Strategy | HFStrategy:
    """The strategy `name` (see NAMES); `searched`: the searched skip set and its draft head, for
    self_spec_searched; `costs`: this machine's step costs for the cost-aware policy, measured on first use and
    shared by the strategies of a run. Each strategy gets fresh draft-exit policies."""
    if name in HF_STRATEGIES:
        return make_hf_strategy(name, model, settings, end_ids, draft_model, **(vars(hf) if hf else {}))
    if name not in NAMES:
        raise SelfspecError(f"strategy {name!r} is unknown; allowed: {', '.join(NAMES)}")
    decoder_layers(model)  # our decoding needs the supported layout: say so before any prompt runs
    if name == "plain":
        return Strategy(name, model, settings, end_ids)
    suffix = name.removeprefix("self_spec_")
    policy = suffix if suffix in POLICIES else draft.policy
    if name in ("self_spec_hybrid", *TREE_STRATEGIES):
        policy = draft.hybrid_policy or draft.policy
    costs = costs or cost_meter(model, draft)

    def exit_policy(drafted_by: SkipSet | None = None, head: DraftHead | None = None, max_tokens: int | None = None):
        """A fresh policy; the cost-aware one gets the costs of drafting with `drafted_by` (None: copies)."""
        if policy == "cost" and name in ("two_model", "kangaroo"):
            raise SelfspecError(f"draft.policy=cost is for the layer-skip and copying drafters; strategy {name} "
                                f"takes draft.policy=fixed, threshold or adaptive")
        return make_exit_policy(draft, settings.greedy, policy,
                                costs.costs(drafted_by, head) if policy == "cost" else None, max_tokens)

    def copy_policy() -> CostAwareExit | None:
        """The copiers' cost-aware policy, which may copy up to draft.ngram_tokens; None under other policies."""
        return exit_policy(max_tokens=draft.ngram_tokens) if policy == "cost" else None

    if name == "self_spec" or suffix in POLICIES:
        drafter = SelfDrafter(model, skip, exit_policy(skip, draft_head), draft_head)
    elif name == "self_spec_searched":
        if searched is None:
            raise SelfspecError("strategy self_spec_searched needs a searched skip set and this model ships none "
                                "(model.searched_skip): run `make search MODEL=<model>`, then pass "
                                "searched_skip.path=<its run dir>/best_skip.yaml, or drop the strategy")
        drafter = SelfDrafter(model, searched[0], exit_policy(*searched), searched[1])
    elif name == "self_spec_hybrid":
        copy_cap = draft.ngram_tokens if policy == "cost" else min(draft.ngram_tokens, draft.max_tokens)
        copier = NgramDrafter(model, draft.ngram_size, copy_cap, copy_policy())
        drafter = HybridDrafter(copier, SelfDrafter(model, skip, exit_policy(skip, draft_head), draft_head))
    elif name == "prompt_lookup":
        drafter = NgramDrafter(model, draft.ngram_size, draft.ngram_tokens)
    elif name in TREE_STRATEGIES:
        drafter = NgramTreeDrafter(model, draft.ngram_size, draft.tree_nodes, draft.tree_depth, draft.tree_width,
                                   copy_policy())
        if name == "self_spec_tree":
            drafter = HybridDrafter(drafter, SelfTreeDrafter(model, skip, exit_policy(skip, draft_head), draft_head,
                                                             draft.tree_nodes, draft.tree_depth, draft.tree_width,
                                                             draft.tree_branch_below))
    elif name == "two_model":
        if draft_model is None:
            raise SelfspecError("strategy two_model needs a draft model: set draft_model=<option>, e.g. draft_model=tiny_llama")
        drafter = ModelDrafter(draft_model, exit_policy())
    else:  # kangaroo
        adapter, exit_layer = load_adapter(kangaroo and kangaroo.adapter_path, model, kangaroo and kangaroo.exit_layer)
        drafter = KangarooDrafter(model, adapter, exit_layer, exit_policy())
    return Strategy(name, model, settings, end_ids, drafter, draft.target_gate)


def cost_meter(model, draft: DraftSettings) -> CostMeter:
    """The meter the cost-aware exit reads, for verifies as wide as any draft of `draft`'s drafters (plus one)."""
    return CostMeter(model, max(draft.max_tokens, draft.ngram_tokens, draft.tree_nodes) + 1)
