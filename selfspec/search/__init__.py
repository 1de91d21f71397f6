"""Skip-set search with Optuna: which attention and MLP sublayers the draft leaves out (Draft & Verify's
Bayesian optimisation, with Optuna called directly).

A trial suggests one boolean per attention sublayer and one per MLP sublayer of the searched layers, decodes
the search prompts self-speculatively with that skip set, and scores it:

- `tokens_per_s`: decode speed (tokens after the first / seconds after the prefill), the paper's objective;
- `acceptance`: mean tokens emitted per verification forward (1.0 = the draft never helps);
- `pareto`: two objectives, the share of sublayers skipped (draft cost saved) and mean accepted tokens.
  best_skip.yaml gets the Pareto-front trial with the highest expected speedup (costs.expected_speedup:
  draft forwards cost (1 - skipped_fraction) of a full forward, a verification one full forward);
- `cost_model`: the speedup over plain decoding that this machine's measured step costs predict for the
  trial's draft/verify trace (selfspec/decoding/costs.py): no timing noise, and it prices what a CPU charges for
  long verifications and for the output layer.

With `search.early_exit` a trial also drops a contiguous top block of layers (`exit_layer`), and with
`search.draft_vocab_sizes` it picks the draft's output-layer size. Trials that skip nothing (at the full
vocabulary), everything, or a share outside [min_skip_fraction, max_skip_fraction] are pruned
without decoding. The study lives in a journal file (default `<run dir>/optuna_journal.log`) or an RDB, so a
rerun of the same command resumes it and other processes can join it as workers.

Modules: space (candidates and the search space), study (storage, sampler, pruner, dead workers), objective
(measuring a candidate, choosing the best trial), trial_log (trials.jsonl and the W&B run).
"""

import dataclasses
from pathlib import Path

from optuna.trial import FrozenTrial

from selfspec.data.prompt_sets import Prompt, encode_prompt, load_prompt_set
from selfspec.errors import SelfspecError
from selfspec.models.loading import LoadedModel
from selfspec.models.layouts import num_layers
from selfspec.models.skip_config import resolve_skip, write_skip_file
from selfspec.search.objective import TrialObjective, choose_best
from selfspec.search.space import Candidate, SearchSpace, make_candidate, search_space, seed_candidates
from selfspec.records.run_dir import replacing
from selfspec.search.study import (FINISHED, RESUME, fail_dead_trials, make_pruner, make_sampler, open_storage,
                                   open_study, quiet_optuna, storage_spec, storage_writes)
from selfspec.search.trial_log import TrialLog, run_trials
from selfspec.settings import DataSettings, RunSettings, SearchSettings, SkipSet, SkipSettings


def search_skip_set(settings: RunSettings, loaded: LoadedModel, out_dir: Path) -> Candidate:
    """Run (or resume) the Optuna study of `settings.search` on `loaded.model`; write out_dir/best_skip.yaml and
    out_dir/trials.jsonl; return the chosen skip set and draft vocabulary size."""
    search, layers = settings.search, num_layers(loaded.model)
    space = search_space(search, layers, settings.draft.vocab_size)
    sampling = dataclasses.replace(settings.sampling, max_new_tokens=search.max_new_tokens)
    prompts = search_prompts(search.data, settings.data)
    prompt_ids = [encode_prompt(loaded.tokenizer, p) for p in prompts]
    study_name = search.study_name or f"{loaded.name}-{search.objective}"
    with quiet_optuna(), storage_writes(storage_spec(search, out_dir)):
        storage, storage_text = open_storage(search, out_dir)
        study = open_study(storage, storage_text, study_name, search.objective, loaded.name, layers,
                           make_pruner(search.objective, search.prune_p))
        failed = fail_dead_trials(study, storage)
        seeds = seed_candidates(space, configured_skip(settings.skip, layers), settings.draft.vocab_size)
        start_sampling(study, search, space, seeds)
        done = len(study.get_trials(deepcopy=False, states=FINISHED))
        print(f"search: study {study_name!r} in {storage_text}: {done} of {search.n_trials} trials finished"
              + (f", {failed} abandoned trial(s) of dead workers marked FAIL (an RDB runs them again)" if failed else "")
              + f"; {len(prompts)} search prompts x {search.max_new_tokens} tokens, objective {search.objective}, "
                f"sampler {search.sampler}")
        log = TrialLog(out_dir / "trials.jsonl", study_name, settings, search.objective)
        try:
            if done < search.n_trials:
                objective = TrialObjective.prepared(loaded, prompt_ids, sampling, settings.draft, settings.seed,
                                                    space, search.objective)
                run_trials(study, objective, search.n_trials, search.n_trials - done, log)
            best = choose_best(study, search.objective)
            found = write_best(best, out_dir, loaded.name, layers, prompts, search.max_new_tokens,
                               {"study": study_name, "storage": storage_text, "objective": search.objective})
            log.finish(study, best, out_dir / "best_skip.yaml")  # after the file is written
        finally:
            log.close()
    return found


def start_sampling(study, search: SearchSettings, space: SearchSpace, seeds: list[Candidate]) -> None:
    """Seed the sampler and, in a new study (with search.enqueue_seeds), enqueue the seed candidates."""
    present = len(study.trials)
    # A worker joining a study that has trials must not replay the first worker's random draws.
    seed = None if search.seed is None else search.seed + present
    study.sampler = make_sampler(search.sampler, seed, search.n_startup_trials)
    if present == 0 and search.enqueue_seeds:
        for candidate in seeds:
            study.enqueue_trial(space.params(candidate), skip_if_exists=True)


def configured_skip(skip: SkipSettings, layers: int) -> SkipSet | None:
    """The model's configured skip set (conf/skip/<model>.yaml), if there is a valid one."""
    try:
        return resolve_skip(skip, layers)[0]
    except SelfspecError:
        return None


def search_prompts(search_data: DataSettings, eval_data: DataSettings | None = None) -> list[Prompt]:
    """Prompts `offset`..`offset+limit-1` of each set in search.data.name (conf: offset data.limit, so they
    follow the evaluation prompts). Warns when they overlap the evaluation prompts."""
    try:
        prompts = load_prompt_set(search_data)
    except SelfspecError as error:
        raise SelfspecError(f"search.data: {error}") from None
    if eval_data is not None:
        shared = {p.question_id for p in prompts} & _eval_ids(eval_data)
        if shared:
            print(f"search: warning: {len(shared)} search prompts are also evaluation prompts; "
                  f"set search.data.offset to keep them apart")
    return prompts


def _eval_ids(data: DataSettings) -> set:
    try:
        return {p.question_id for p in load_prompt_set(data)}
    except SelfspecError:
        return set()


def write_best(best: FrozenTrial, out_dir: Path, model: str, layers: int, prompts: list[Prompt], max_new_tokens: int,
               study: dict) -> Candidate:
    """Write and print out_dir/best_skip.yaml (the skip set, the trial's metrics, how it was found)."""
    candidate = make_candidate(best)
    metrics = {**study, "trial": best.number, "values": list(best.values),
               **best.user_attrs.get("metrics", {}), "search_prompts": [p.question_id for p in prompts],
               "search_max_new_tokens": max_new_tokens}
    path = out_dir / "best_skip.yaml"
    with replacing(path, RESUME) as temporary:  # a full disk leaves the earlier best_skip.yaml whole
        write_skip_file(temporary, candidate.skip, layers, model, metrics, candidate.vocab_size)
    shown = ", ".join(f"{key}={metrics[key]:.4g}" for key in ("tokens_per_s", "mean_accepted_tokens",
                                                               "skipped_fraction", "expected_speedup",
                                                               "modelled_speedup")
                      if metrics.get(key) is not None)
    vocab = f" draft.vocab_size={candidate.vocab_size}" if candidate.vocab_size else ""
    print(f"search: chose trial #{best.number} ({shown}); wrote {path}:\n{path.read_text()}"
          f"search: reuse it with `skip=file skip.path={path}{vocab}` or, beside the shipped set, "
          f"`searched_skip.path={path}` and strategy self_spec_searched; more workers: the same command with "
          f"`search.storage={study['storage']} search.study_name={study['study']}` and another search.seed")
    return candidate
