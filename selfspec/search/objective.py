"""Scoring a candidate: decode the search prompts with it, aggregate the counts into metrics, turn them into the
objective's values; and the choice of the best trial."""

import dataclasses
from dataclasses import dataclass

import optuna
import torch
from optuna.trial import FrozenTrial, TrialState

from selfspec.data.prompt_sets import calibration_texts
from selfspec.decoding.costs import StepCosts, expected_speedup, measure_step_costs
from selfspec.decoding.draft_exit import make_exit_policy
from selfspec.decoding.drafters import SelfDrafter
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.results import GenerationResult
from selfspec.decoding.speculative import generate
from selfspec.errors import SelfspecError
from selfspec.models.devices import output_device
from selfspec.models.draft_vocabulary import DraftVocabulary, make_draft_vocabulary
from selfspec.models.loading import LoadedModel
from selfspec.search.space import Candidate, SearchSpace, make_candidate
from selfspec.search.study import FINISHED, WORKER
from selfspec.settings import DraftSettings, SamplingSettings, SkipSet


def prompt_counts(result: GenerationResult) -> dict:
    """What one generation contributes to a trial's metrics (seconds exclude the prefill, the same in every trial)."""
    return {"decode_tokens": len(result.new_tokens) - 1, "decode_s": result.elapsed_s - result.prefill_s,
            "verify_steps": len(result.steps), "emitted": sum(s.emitted for s in result.steps),
            "drafted": result.drafted, "accepted": result.accepted}


def prompt_value(counts: dict, key: str) -> float | None:
    """Per-prompt tokens_per_s, modelled_speedup or mean_accepted_tokens, reported to the pruner."""
    if key == "tokens_per_s":
        timed = counts["decode_tokens"] and counts["decode_s"] > 0
        return counts["decode_tokens"] / counts["decode_s"] if timed else None
    if key == "modelled_speedup":
        return counts["plain_modelled_ms"] / counts["modelled_ms"] if counts["modelled_ms"] else None
    return counts["emitted"] / counts["verify_steps"] if counts["verify_steps"] else None


def aggregate(per_prompt: list[dict], skipped_fraction: float) -> dict:
    """Trial metrics over all search prompts: tokens_per_s (decode only), mean_accepted_tokens (emitted per
    verification), acceptance_rate (accepted / drafted), drafted_per_step, skipped_fraction, expected_speedup."""
    total = {key: sum(c[key] for c in per_prompt) for key in per_prompt[0]}
    steps = total["verify_steps"]
    mean_accepted = total["emitted"] / steps if steps else None
    drafted_per_step = total["drafted"] / steps if steps else None
    return {
        "tokens_per_s": total["decode_tokens"] / total["decode_s"] if total["decode_s"] > 0 else None,
        "mean_accepted_tokens": mean_accepted,
        "acceptance_rate": total["accepted"] / total["drafted"] if total["drafted"] else None,
        "drafted_per_step": drafted_per_step,
        "skipped_fraction": skipped_fraction,
        "expected_speedup": (expected_speedup(mean_accepted, drafted_per_step, skipped_fraction)
                             if steps else None),
        "prompt_mean_accepted_tokens": [prompt_value(c, "mean_accepted_tokens") for c in per_prompt],
        **({"modelled_speedup": prompt_value(total, "modelled_speedup")} if "modelled_ms" in total else {}),
    }


def measure(model, prompt_ids: list[list[int]], settings: SamplingSettings, candidate: Candidate | None,
            draft: DraftSettings, end_ids: tuple[int, ...], seed: int, layers: int, on_prompt=None,
            head: DraftVocabulary | None = None, costs: StepCosts | None = None) -> dict:
    """Decode every prompt (self-speculatively with `candidate` and its `head`, plainly when candidate is None)
    with one fresh exit policy; with `costs`, also price each step by the cost model. `on_prompt(index, counts)`
    runs after each prompt (it may raise TrialPruned). Returns `aggregate(...)`."""
    drafter, draft_ms = None, None
    if candidate is not None:
        drafter = SelfDrafter(model, candidate.skip, make_exit_policy(draft, settings.greedy), head)
        draft_ms = costs.draft_ms(candidate.skip, candidate.vocab_size) if costs is not None else None
    per_prompt = []
    for index, ids in enumerate(prompt_ids):
        generator = torch.Generator(device=output_device(model)).manual_seed(seed + index)
        result = generate(model, ids, GenerationOptions(settings, end_ids=end_ids, generator=generator), drafter)
        counts = prompt_counts(result)
        if draft_ms is not None:
            trace = [(step.drafted, step.emitted) for step in result.steps]
            counts["plain_modelled_ms"], counts["modelled_ms"] = costs.trace_ms(trace, draft_ms)
        per_prompt.append(counts)
        if on_prompt is not None:
            on_prompt(index, counts)
    return aggregate(per_prompt, candidate.skip.fraction(layers) if candidate is not None else 0.0)


def warm_up(loaded: LoadedModel, ids: list[int], settings: SamplingSettings, draft: DraftSettings,
            space: SearchSpace) -> None:
    """One short untimed plain and self-speculative generation, so trial 0 is not charged for first calls."""
    short = dataclasses.replace(settings, max_new_tokens=min(8, settings.max_new_tokens))
    skip = SkipSet((space.hi - 1,), ())
    for drafter in (None, SelfDrafter(loaded.model, skip, make_exit_policy(draft, settings.greedy))):
        generate(loaded.model, ids[:64], GenerationOptions(short, end_ids=loaded.end_ids), drafter)


@dataclass
class TrialObjective:
    """The Optuna objective: suggest a skip set, prune it if degenerate or a duplicate of a pruned trial, reuse
    the values of a finished duplicate, otherwise decode the search prompts with it."""
    model: object
    prompt_ids: list
    settings: SamplingSettings
    draft: DraftSettings
    end_ids: tuple[int, ...]
    seed: int
    space: SearchSpace
    objective: str
    plain_tokens_per_s: float | None = None
    heads: dict = dataclasses.field(default_factory=dict)  # draft vocabulary size -> DraftVocabulary
    costs: StepCosts | None = None  # for objective cost_model

    @classmethod
    def prepared(cls, loaded: LoadedModel, prompt_ids: list[list[int]], settings: SamplingSettings,
                 draft: DraftSettings, seed: int, space: SearchSpace, objective: str) -> "TrialObjective":
        """Build the draft vocabularies, warm up, measure the step costs (objective cost_model) and plain decoding."""
        texts = calibration_texts()
        heads = {n: make_draft_vocabulary(loaded.model, loaded.tokenizer, n, texts) for n in space.vocab_sizes if n}
        warm_up(loaded, prompt_ids[0], settings, draft, space)
        costs = None
        if objective == "cost_model":
            costs = measure_step_costs(loaded.model, draft.max_tokens + 1, heads)
            print(f"search: step costs on this machine: {costs.summary()}")
        plain = measure(loaded.model, prompt_ids, settings, None, draft, loaded.end_ids, seed, space.num_layers)
        return cls(loaded.model, prompt_ids, settings, draft, loaded.end_ids, seed, space, objective, plain["tokens_per_s"],
                   heads, costs)

    @property
    def report_key(self) -> str:
        return {"tokens_per_s": "tokens_per_s", "cost_model": "modelled_speedup"}.get(self.objective,
                                                                                   "mean_accepted_tokens")

    def __call__(self, trial: optuna.Trial):
        trial.set_user_attr("worker", WORKER)
        candidate = self.space.suggest(trial)
        trial.set_user_attr("attn", list(candidate.skip.attn))
        trial.set_user_attr("mlp", list(candidate.skip.mlp))
        trial.set_user_attr("draft_vocab_size", candidate.vocab_size)
        reason = self.space.reject_reason(candidate)
        if reason is not None:
            self._prune(trial, reason)
        twin = self._finished_twin(trial, candidate)
        if twin is not None:
            return self._copy(trial, twin)

        def on_prompt(index: int, counts: dict) -> None:
            value = prompt_value(counts, self.report_key)
            if self.objective != "pareto" and value is not None:
                trial.report(value, index)
                if index < len(self.prompt_ids) - 1 and trial.should_prune():  # the last prompt completes it
                    self._prune(trial, f"wilcoxon test after prompt {index}")

        metrics = measure(self.model, self.prompt_ids, self.settings, candidate, self.draft, self.end_ids,
                          self.seed, self.space.num_layers, on_prompt, self.heads.get(candidate.vocab_size),
                          self.costs)
        if metrics["mean_accepted_tokens"] is None or metrics["tokens_per_s"] is None:
            self._prune(trial, "no verification step on the search prompts")
        if self.plain_tokens_per_s:
            metrics["plain_tokens_per_s"] = self.plain_tokens_per_s
            metrics["speedup"] = metrics["tokens_per_s"] / self.plain_tokens_per_s
        trial.set_user_attr("metrics", metrics)
        return objective_values(self.objective, metrics)

    @staticmethod
    def _prune(trial, reason: str):
        trial.set_user_attr("pruned", reason)
        raise optuna.TrialPruned(reason)

    def _finished_twin(self, trial, candidate: Candidate) -> FrozenTrial | None:
        """A finished trial with the same skip set and vocabulary (samplers repeat themselves on boolean spaces)."""
        for other in trial.study.get_trials(deepcopy=False, states=FINISHED):
            if "attn" in other.user_attrs and make_candidate(other) == candidate:
                return other
        return None

    def _copy(self, trial, twin: FrozenTrial):
        trial.set_user_attr("duplicate_of", twin.number)
        if twin.state == TrialState.PRUNED:
            self._prune(trial, f"same skip set as pruned trial {twin.number}")
        for step, value in twin.intermediate_values.items():
            trial.report(value, step)
        trial.set_user_attr("metrics", twin.user_attrs.get("metrics", {}))
        return tuple(twin.values) if len(twin.values) > 1 else twin.values[0]


def objective_values(objective: str, metrics: dict):
    if objective == "tokens_per_s":
        return metrics["tokens_per_s"]
    if objective == "acceptance":
        return metrics["mean_accepted_tokens"]
    if objective == "cost_model":
        return metrics["modelled_speedup"]
    return metrics["skipped_fraction"], metrics["mean_accepted_tokens"]


def choose_best(study, objective: str) -> FrozenTrial:
    """The best trial; for `pareto`, the Pareto-front trial with the highest expected speedup (ties: the higher
    mean_accepted_tokens)."""
    completed = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not completed:
        pruned = len(study.get_trials(deepcopy=False, states=(TrialState.PRUNED,)))
        raise SelfspecError(f"study {study.study_name!r} has no completed trial ({pruned} pruned); widen "
                            f"search.min_skip_fraction/max_skip_fraction or raise search.n_trials")
    if objective != "pareto":
        return study.best_trial
    return max(study.best_trials, key=lambda t: (t.user_attrs["metrics"]["expected_speedup"], t.values[1]))
