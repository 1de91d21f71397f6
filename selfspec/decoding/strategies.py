"""Decoding strategies with one `generate(prompt, generator)` signature, so runs and benchmarks loop over them.

Names: `plain`; `self_spec` (the configured draft exit) or `self_spec_<fixed|threshold|adaptive>`;
`self_spec_searched` (the configured exit with the searched skip set and draft vocabulary, `searched_skip`);
`self_spec_hybrid` (an n-gram copy from the context when there is one, else the layer-skip draft with the
configured exit); `prompt_lookup` (n-gram copies only); `two_model` (needs `draft_model`); `kangaroo` (needs
`kangaroo.adapter_path`); the HF generate baselines `hf_*` (see hf_baselines.py). Every drafting strategy
takes `draft.target_gate`.
"""

from dataclasses import dataclass

import torch

from selfspec.decoding.draft_exit import AdaptiveExit, DraftExit, ThresholdExit
from selfspec.decoding.drafters import HybridDrafter, ModelDrafter, NgramDrafter, SelfDrafter
from selfspec.decoding.hf_baselines import HF_STRATEGIES, HFStrategy, make_hf_strategy
from selfspec.decoding.kangaroo import KangarooDrafter
from selfspec.decoding.results import GenerationResult
from selfspec.decoding.sampling import SamplingSettings
from selfspec.decoding.speculative import generate
from selfspec.errors import SelfspecError
from selfspec.models.draft_head import DraftHead
from selfspec.models.kangaroo_adapter import load_adapter
from selfspec.models.skip import SkipSet

POLICIES = ("fixed", "threshold", "adaptive")


@dataclass
class Strategy:
    """Our decoder: plain when `drafter` is None, speculative otherwise."""
    name: str
    model: object
    settings: SamplingSettings
    eos_token_id: int | None
    drafter: object | None = None
    exit_policy: DraftExit | None = None
    target_gate: float | None = None

    def generate(self, prompt: list[int], generator: torch.Generator | None = None) -> GenerationResult:
        return generate(self.model, prompt, self.settings, self.drafter, self.exit_policy, self.eos_token_id,
                        generator, self.target_gate)


def make_exit_policy(cfg, greedy: bool, policy: str | None = None) -> DraftExit:
    """The draft-exit policy from the `draft` config group; `policy` overrides its kind."""
    policy = policy or cfg["policy"]
    if policy not in POLICIES:
        raise SelfspecError(f"draft.policy={policy!r} is unknown; allowed: {', '.join(POLICIES)}")
    threshold = cfg.get("threshold")
    if threshold is None:
        threshold = 0.8 if greedy else 0.5
    if policy == "fixed":
        return DraftExit(cfg["max_tokens"])
    if policy == "threshold":
        return ThresholdExit(cfg["max_tokens"], threshold)
    return AdaptiveExit(cfg["max_tokens"], threshold, **{k: cfg[k] for k in
                                                         ("beta1", "target_acceptance", "epsilon", "beta2") if k in cfg})


def make_strategy(name: str, model, settings: SamplingSettings, eos_token_id, skip: SkipSet, draft_cfg,
                  draft_model=None, draft_head: DraftHead | None = None, hf_cfg=None,
                  kangaroo_cfg=None,
                  searched: tuple[SkipSet, DraftHead | None] | None = None) -> Strategy | HFStrategy:
    """`hf_cfg`: keyword arguments of make_hf_strategy (the `hf` config block) for the hf_* baselines;
    `kangaroo_cfg`: the `kangaroo` config block (adapter_path, exit_layer); `searched`: the searched skip set
    and its draft head, for self_spec_searched."""
    if name in HF_STRATEGIES:
        return make_hf_strategy(name, model, settings, eos_token_id, draft_model, **(hf_cfg or {}))
    if name == "plain":
        return Strategy(name, model, settings, eos_token_id)
    gate = draft_cfg.get("target_gate")
    if name == "self_spec" or name.removeprefix("self_spec_") in POLICIES:
        policy = make_exit_policy(draft_cfg, settings.greedy, name.removeprefix("self_spec_") if name != "self_spec" else None)
        return Strategy(name, model, settings, eos_token_id, SelfDrafter(model, skip, draft_head), policy, gate)
    if name == "self_spec_searched":
        if searched is None:
            raise SelfspecError("strategy self_spec_searched needs a searched skip set and this model ships none "
                                "(model.searched_skip): run `make search MODEL=<model>`, then pass "
                                "searched_skip.path=<its run dir>/best_skip.yaml, or drop the strategy")
        return Strategy(name, model, settings, eos_token_id, SelfDrafter(model, *searched),
                        make_exit_policy(draft_cfg, settings.greedy), gate)
    ngram = NgramDrafter(model, draft_cfg.get("ngram_size", 2), draft_cfg.get("ngram_tokens", 10))
    if name == "self_spec_hybrid":
        return Strategy(name, model, settings, eos_token_id, HybridDrafter(ngram, SelfDrafter(model, skip, draft_head)),
                        make_exit_policy(draft_cfg, settings.greedy), gate)
    if name == "prompt_lookup":
        return Strategy(name, model, settings, eos_token_id, ngram, DraftExit(ngram.num_tokens), gate)
    if name == "two_model":
        if draft_model is None:
            raise SelfspecError("strategy two_model needs a draft model: set draft_model=<option>, e.g. draft_model=tiny_llama")
        return Strategy(name, model, settings, eos_token_id, ModelDrafter(draft_model),
                        make_exit_policy(draft_cfg, settings.greedy), gate)
    if name == "kangaroo":
        adapter, exit_layer = load_adapter((kangaroo_cfg or {}).get("adapter_path"), model,
                                           (kangaroo_cfg or {}).get("exit_layer"))
        return Strategy(name, model, settings, eos_token_id, KangarooDrafter(model, adapter, exit_layer),
                        make_exit_policy(draft_cfg, settings.greedy), gate)
    raise SelfspecError(f"strategy {name!r} is unknown; allowed: plain, self_spec, "
                        f"{', '.join('self_spec_' + p for p in (*POLICIES, 'searched', 'hybrid'))}, prompt_lookup, "
                        f"two_model, kangaroo, {', '.join(HF_STRATEGIES)}")
