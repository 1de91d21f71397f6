"""Skip-set search with Optuna: which attention and MLP sublayers the draft leaves out (Draft & Verify's
Bayesian optimisation, with Optuna called directly).

A trial suggests one boolean per attention sublayer and one per MLP sublayer of the searched layers, decodes
the search prompts self-speculatively with that skip set, and scores it:

- `tokens_per_s`: decode speed (tokens after the first / seconds after the prefill), the paper's objective;
- `acceptance`: mean tokens emitted per verification forward (1.0 = the draft never helps);
- `pareto`: two objectives, the share of sublayers skipped (draft cost saved) and mean accepted tokens.
  best_skip.yaml gets the Pareto-front trial with the highest expected speedup
  `mean_accepted_tokens / (1 + drafted_per_step * (1 - skipped_fraction))` (draft forwards cost
  (1 - skipped_fraction) of a full forward, a verification one full forward);
- `cost_model`: the speedup over plain decoding that this machine's measured step costs predict for the
  trial's draft/verify trace (selfspec/cost_model.py): no timing noise, and it prices what a CPU charges for
  long verifications and for the output layer.

With `search.early_exit` a trial also drops a contiguous top block of layers (`exit_layer`), and with
`search.draft_vocab_sizes` it picks the draft's output-layer size. Trials that skip nothing (at the full
vocabulary), everything, or a share outside [min_skip_fraction, max_skip_fraction] are pruned
without decoding. The study lives in a journal file (default `<run dir>/optuna_journal.log`) or an RDB, so a
rerun of the same command resumes it and other processes can join it as workers.
"""

import dataclasses
import importlib.util
import json
import math
import os
import socket
import warnings
from dataclasses import dataclass
from pathlib import Path

import optuna
import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from optuna.trial import FrozenTrial, TrialState
from tqdm import tqdm

from selfspec.cost_model import StepCosts, measure_step_costs
from selfspec.data import Prompt, encode_prompt, load_prompts
from selfspec.decoding.drafters import SelfDrafter
from selfspec.decoding.results import GenerationResult
from selfspec.decoding.sampling import SamplingSettings
from selfspec.decoding.speculative import generate
from selfspec.decoding.strategies import make_exit_policy
from selfspec.errors import SelfspecError
from selfspec.models.draft_head import DraftHead, make_draft_head
from selfspec.models.skip import SkipSet, num_layers
from selfspec.models.skip_config import skip_from_config, write_skip_file

OBJECTIVES = ("tokens_per_s", "acceptance", "pareto", "cost_model")
SAMPLERS = ("tpe", "gp", "random")
JOURNAL_NAME = "optuna_journal.log"
JOURNAL_LOCK_GRACE_S = 10  # appends hold the lock for milliseconds; optuna's default waits 30 s on a stale lock
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)  # what counts towards search.n_trials
WORKER = f"{socket.gethostname()}:{os.getpid()}"  # written on every trial, to spot trials of dead workers


@dataclass(frozen=True)
class Candidate:
    """What a trial drafts with: a skip set and a draft vocabulary size (None: the full output layer)."""
    skip: SkipSet
    vocab_size: int | None = None


@dataclass(frozen=True)
class SearchSpace:
    """Booleans `attn_<i>` / `mlp_<i>` for layers lo..hi-1 (layers outside are never skipped); with
    `early_exit`, an `exit_layer` in lo+1..hi from which every layer up to hi is skipped (hi: none); with more
    than one `vocab_sizes`, a categorical `draft_vocab_size`."""
    num_layers: int
    lo: int
    hi: int
    min_fraction: float = 0.0
    max_fraction: float = 1.0
    early_exit: bool = False
    vocab_sizes: tuple = (None,)

    def suggest(self, trial: optuna.Trial) -> Candidate:
        top = trial.suggest_int("exit_layer", self.lo + 1, self.hi) if self.early_exit else self.hi
        attn = [i for i in range(self.lo, top) if trial.suggest_categorical(f"attn_{i}", [False, True])]
        mlp = [i for i in range(self.lo, top) if trial.suggest_categorical(f"mlp_{i}", [False, True])]
        dropped = tuple(range(top, self.hi))
        vocab_size = (trial.suggest_categorical("draft_vocab_size", list(self.vocab_sizes))
                      if len(self.vocab_sizes) > 1 else self.vocab_sizes[0])
        return Candidate(SkipSet(tuple(attn) + dropped, tuple(mlp) + dropped), vocab_size)

    def params(self, candidate: Candidate) -> dict:
        """Trial parameters for `candidate` (layers outside the range dropped), for `study.enqueue_trial`."""
        skip = candidate.skip
        params = {**{f"attn_{i}": i in skip.attn for i in range(self.lo, self.hi)},
                  **{f"mlp_{i}": i in skip.mlp for i in range(self.lo, self.hi)}}
        if self.early_exit:
            params["exit_layer"] = self.hi
        if len(self.vocab_sizes) > 1:
            params["draft_vocab_size"] = candidate.vocab_size
        return params

    def clip(self, skip: SkipSet) -> SkipSet:
        inside = range(self.lo, self.hi)
        return SkipSet(tuple(i for i in skip.attn if i in inside), tuple(i for i in skip.mlp if i in inside))

    def reject_reason(self, candidate: Candidate) -> str | None:
        """Why `candidate` is not worth decoding (pruned unscored), or None."""
        skip = candidate.skip
        fraction = skip.fraction(self.num_layers)
        if skip.is_empty and candidate.vocab_size is None:
            return "nothing skipped"
        if fraction == 1:
            return "everything skipped"
        if fraction > self.max_fraction:
            return f"skips {fraction:.3f} > max_skip_fraction {self.max_fraction}"
        if fraction < self.min_fraction:
            return f"skips {fraction:.3f} < min_skip_fraction {self.min_fraction}"
        return None


def search_skip_set(cfg, loaded, settings: SamplingSettings, out_dir: Path) -> Candidate:
    """Run (or resume) the Optuna study of `cfg.search` on `loaded.model`; write out_dir/best_skip.yaml and
    out_dir/trials.jsonl; return the chosen skip set and draft vocabulary size."""
    search = cfg.search
    layers = num_layers(loaded.model)
    objective_name, sampler_name, n_trials = _check_choices(search)
    space = search_space(search, layers, cfg.draft.get("vocab_size"))
    prune_p = _unit(search, "prune_p", 0.1)
    max_new_tokens = search.get("max_new_tokens", 16)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 2:
        raise SelfspecError(f"search.max_new_tokens={max_new_tokens!r} must be an integer >= 2")
    search_settings = dataclasses.replace(settings, max_new_tokens=max_new_tokens)
    make_exit_policy(cfg.draft, settings.greedy)  # a bad draft config fails now, not in trial 0
    prompts = search_prompts(search.get("data") or {}, cfg.get("data"))
    prompt_ids = [encode_prompt(loaded.tokenizer, p) for p in prompts]
    study_name = search.get("study_name") or f"{loaded.name}-{objective_name}"

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        verbosity = optuna.logging.get_verbosity()
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # trials.jsonl and the bar say what happened
        try:
            storage, storage_text = open_storage(search.get("storage"), out_dir)
            study = open_study(storage, storage_text, study_name, objective_name, loaded.name, layers,
                               make_pruner(objective_name, prune_p))
            failed = fail_dead_trials(study)
            present = len(study.trials)
            seed = search.get("seed")
            # A worker joining a study that has trials must not replay the first worker's random draws.
            study.sampler = make_sampler(sampler_name, None if seed is None else seed + present,
                                         search.get("n_startup_trials", 10))
            if present == 0 and search.get("enqueue_seeds", True):
                for candidate in seed_candidates(space, _configured_skip(cfg, layers), cfg.draft.get("vocab_size")):
                    study.enqueue_trial(space.params(candidate), skip_if_exists=True)
            done = len(study.get_trials(deepcopy=False, states=FINISHED))
            print(f"search: study {study_name!r} in {storage_text}: {done} of {n_trials} trials finished"
                  + (f", {failed} abandoned trial(s) of dead workers marked FAIL" if failed else "")
                  + f"; {len(prompts)} search prompts x {max_new_tokens} tokens, objective {objective_name}, "
                    f"sampler {sampler_name}")
            if done < n_trials:
                eos = loaded.tokenizer.eos_token_id
                heads = {n: make_draft_head(loaded.model, loaded.tokenizer, n) for n in space.vocab_sizes if n}
                _warm_up(loaded, prompt_ids[0], search_settings, cfg.draft, space)
                costs = None
                if objective_name == "cost_model":
                    costs = measure_step_costs(loaded.model, make_exit_policy(cfg.draft, settings.greedy).max_tokens + 1,
                                               heads)
                    print(f"search: step costs on this machine: {costs.summary()}")
                plain = measure(loaded.model, prompt_ids, search_settings, None, cfg.draft, eos, cfg.seed, layers)
                objective = TrialObjective(loaded.model, prompt_ids, search_settings, cfg.draft, eos, cfg.seed,
                                           space, objective_name, plain["tokens_per_s"], heads, costs)
                run_trials(study, objective, n_trials, n_trials - done, out_dir, cfg, study_name)
            best = choose_best(study, objective_name)
        finally:
            optuna.logging.set_verbosity(verbosity)
    return write_best(best, out_dir, loaded.name, layers, prompts, max_new_tokens,
                      {"study": study_name, "storage": storage_text, "objective": objective_name})


def write_best(best: FrozenTrial, out_dir: Path, model: str, layers: int, prompts: list[Prompt], max_new_tokens: int,
               study: dict) -> Candidate:
    """Write and print out_dir/best_skip.yaml (the skip set, the trial's metrics, how it was found)."""
    candidate = make_candidate(best)
    metrics = {**study, "trial": best.number, "values": list(best.values),
               **best.user_attrs.get("metrics", {}), "search_prompts": [p.question_id for p in prompts],
               "search_max_new_tokens": max_new_tokens}
    path = out_dir / "best_skip.yaml"
    write_skip_file(path, candidate.skip, layers, model, metrics, candidate.vocab_size)
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


def _check_choices(search) -> tuple[str, str, int]:
    objective, sampler = search.get("objective", "tokens_per_s"), search.get("sampler", "tpe")
    n_trials = search.get("n_trials")
    if objective not in OBJECTIVES:
        raise SelfspecError(f"search.objective={objective!r} is unknown; allowed: {', '.join(OBJECTIVES)}")
    if sampler not in SAMPLERS:
        raise SelfspecError(f"search.sampler={sampler!r} is unknown; allowed: {', '.join(SAMPLERS)}")
    if isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1:
        raise SelfspecError(f"search.n_trials={n_trials!r} must be a positive integer (trials in the study in total)")
    return objective, sampler, n_trials


def _unit(search, key: str, default: float) -> float:
    value = search.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise SelfspecError(f"search.{key}={value!r} is outside [0, 1]")
    return float(value)


def search_space(search, layers: int, draft_vocab_size: int | None = None) -> SearchSpace:
    """The validated search space from search.layer_range, min_skip_fraction, max_skip_fraction, early_exit and
    draft_vocab_sizes (null: the draft's configured `draft_vocab_size` only)."""
    lo, hi = 0, layers
    layer_range = search.get("layer_range")
    if layer_range is not None:
        values = list(layer_range) if OmegaConf.is_list(layer_range) or isinstance(layer_range, (list, tuple)) else None
        if (values is None or len(values) != 2 or any(isinstance(v, bool) or not isinstance(v, int) for v in values)
                or not 0 <= values[0] < values[1] <= layers):
            raise SelfspecError(f"search.layer_range={_plain(layer_range)!r} is not allowed; use [lo, hi] with "
                                f"0 <= lo < hi <= {layers} (layers lo..hi-1 are searched) or null for all")
        lo, hi = values
    low, high = _unit(search, "min_skip_fraction", 0.0), _unit(search, "max_skip_fraction", 0.5)
    total = 2 * layers
    fewest, most = max(1, math.ceil(low * total - 1e-9)), min(2 * (hi - lo), math.floor(high * total + 1e-9), total - 1)
    if fewest > most:
        raise SelfspecError(f"search.min_skip_fraction={low}, max_skip_fraction={high} and layer_range [{lo}, {hi}) "
                            f"allow no skip set of the {total} sublayers; widen them")
    early_exit = search.get("early_exit", False)
    if not isinstance(early_exit, bool):
        raise SelfspecError(f"search.early_exit={early_exit!r} must be true or false")
    sizes = search.get("draft_vocab_sizes")
    sizes = tuple(_plain(sizes)) if sizes is not None else (draft_vocab_size,)
    if not sizes or any(n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1) for n in sizes):
        raise SelfspecError(f"search.draft_vocab_sizes={_plain(search.get('draft_vocab_sizes'))!r} is not allowed; "
                            f"use a list of positive token counts, null for the full vocabulary, e.g. [null, 16384]")
    return SearchSpace(layers, lo, hi, low, high, early_exit, tuple(dict.fromkeys(sizes)))


def _plain(value):
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def search_prompts(search_data, eval_data=None) -> list[Prompt]:
    """Prompts `offset`..`offset+limit-1` of each set in search.data.name (default offset: data.limit, so they
    follow the evaluation prompts). Warns when they overlap the evaluation prompts."""
    names = search_data.get("name", "chat")
    names = list(names) if OmegaConf.is_list(names) or isinstance(names, (list, tuple)) else [names]
    path, offset, limit = search_data.get("path"), search_data.get("offset") or 0, search_data.get("limit", 8)
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise SelfspecError(f"search.data.offset={offset!r} must be an integer >= 0")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise SelfspecError(f"search.data.limit={limit!r} must be a positive integer or null (all after offset)")
    prompts = []
    for name in names:
        chosen = load_prompts(name, path)[offset:][:limit]
        if not chosen:
            raise SelfspecError(f"search.data.offset={offset} leaves no prompts in set {name!r}; lower it")
        prompts += chosen
    if eval_data is not None:
        shared = {p.question_id for p in prompts} & _eval_ids(eval_data)
        if shared:
            print(f"search: warning: {len(shared)} search prompts are also evaluation prompts; "
                  f"set search.data.offset to keep them apart")
    return prompts


def _eval_ids(data) -> set:
    try:
        names = data.get("name")
        names = list(names) if OmegaConf.is_list(names) or isinstance(names, (list, tuple)) else [names]
        return {p.question_id for name in names for p in load_prompts(name, data.get("path"), data.get("limit"))}
    except (SelfspecError, OmegaConfBaseException):
        return set()


def open_storage(spec, out_dir: Path):
    """(storage, text): a journal file (None = out_dir/optuna_journal.log, or a path) or an RDB URL."""
    if not spec:
        spec = str(out_dir / JOURNAL_NAME)
    spec = str(spec)
    if "://" in spec:
        try:
            # Heartbeats let any worker mark trials of a crashed worker as FAIL (RDB only).
            return optuna.storages.RDBStorage(spec, heartbeat_interval=60, grace_period=180), spec
        except Exception as err:  # sqlalchemy and driver errors have no common base
            raise SelfspecError(f"search.storage={spec!r} cannot be opened: {type(err).__name__}: "
                                f"{_first_line(err)}") from None
    path = Path(spec).expanduser()
    if path.is_dir() or not path.parent.is_dir():
        raise SelfspecError(f"search.storage={spec!r} cannot be opened: give a journal file in an existing "
                            f"directory, or an RDB URL (sqlite:///study.db, postgresql://...)")
    # A worker killed while appending leaves the lock file; the next opener breaks it after the grace period.
    lock = optuna.storages.journal.JournalFileSymlinkLock(str(path), grace_period=JOURNAL_LOCK_GRACE_S)
    try:
        backend = optuna.storages.journal.JournalFileBackend(str(path), lock_obj=lock)
    except OSError as err:
        raise SelfspecError(f"search.storage={spec!r} cannot be opened: {_first_line(err)}") from None
    return optuna.storages.JournalStorage(backend), str(path)


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [""])[0]


def open_study(storage, storage_text: str, name: str, objective: str, model: str, layers: int, pruner):
    """Create the study or load it (load_if_exists), checking that it was made for this model and objective."""
    directions = ["maximize", "maximize"] if objective == "pareto" else ["maximize"]
    try:
        study = optuna.create_study(storage=storage, study_name=name, directions=directions, pruner=pruner,
                                    load_if_exists=True)
    except Exception as err:  # a journal of another format, a database without rights, ...
        raise SelfspecError(f"search.storage={storage_text!r}: study {name!r} cannot be opened: "
                            f"{type(err).__name__}: {_first_line(err)}") from None
    made_for = {"model": model, "num_layers": layers, "objective": objective}
    for key, value in made_for.items():
        found = study.user_attrs.get(key)
        if found is None:
            study.set_user_attr(key, value)
        elif found != value:
            raise SelfspecError(f"study {name!r} in {storage_text} was made for {key}={found!r}, not {value!r}; "
                                f"set another search.study_name")
    return study


def make_sampler(name: str, seed: int | None, n_startup_trials: int = 10):
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=n_startup_trials)
    if name == "gp":
        if importlib.util.find_spec("scipy") is None:
            raise SelfspecError("search.sampler='gp' needs scipy: pip install scipy, or use search.sampler=tpe")
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=n_startup_trials)
    return optuna.samplers.RandomSampler(seed=seed)


def make_pruner(objective: str, p_threshold: float):
    """Wilcoxon signed-rank test of the per-prompt values against the best trial's (single objective only)."""
    if objective == "pareto" or p_threshold == 0:
        return optuna.pruners.NopPruner()
    if importlib.util.find_spec("scipy") is None:
        print("search: scipy is not installed, so trials are not pruned early (pip install scipy)")
        return optuna.pruners.NopPruner()
    return optuna.pruners.WilcoxonPruner(p_threshold=p_threshold)


def fail_dead_trials(study) -> int:
    """Mark RUNNING trials whose worker process on this host is gone (killed mid-trial) as FAIL; returns how many.

    Trials of live workers and of other hosts are left alone (RDB storages also fail them by heartbeat). A trial
    killed before its objective began (while sampling) carries no worker mark and no parameters: it stays RUNNING
    and is ignored, since only complete and pruned trials count."""
    host = socket.gethostname()
    failed = 0
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker_host, _, pid = str(trial.user_attrs.get("worker", "")).rpartition(":")
        if worker_host == host and pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
            failed += 1
    return failed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _configured_skip(cfg, layers: int) -> SkipSet | None:
    """The model's configured skip set (conf/skip/<model>.yaml), if there is a valid one."""
    try:
        return skip_from_config(cfg.skip, layers) if cfg.get("skip") else None
    except (SelfspecError, OmegaConfBaseException):
        return None


def seed_candidates(space: SearchSpace, configured: SkipSet | None = None,
                    vocab_size: int | None = None) -> list[Candidate]:
    """Known-good starting points, tried first: the configured skip set and every other layer of the upper half
    (attention and MLP, the pattern Draft & Verify's searches favour), clipped to the layer range, with the
    configured draft vocabulary where the space has it (else its first); sets the space would prune are dropped."""
    layers = space.num_layers
    upper = tuple(range(layers // 2 + 1, layers - 2, 2)) or tuple(range(layers // 2, layers, 2))
    vocab = vocab_size if vocab_size in space.vocab_sizes else space.vocab_sizes[0]
    seeds = []
    for skip in (configured, SkipSet(upper, upper)):
        if skip is None:
            continue
        candidate = Candidate(space.clip(skip), vocab)
        if candidate not in seeds and space.reject_reason(candidate) is None:
            seeds.append(candidate)
    return seeds


def make_candidate(trial: FrozenTrial) -> Candidate:
    return Candidate(SkipSet(tuple(trial.user_attrs["attn"]), tuple(trial.user_attrs["mlp"])),
                     trial.user_attrs.get("draft_vocab_size"))


# --- measuring a skip set --------------------------------------------------------------------------------------

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


def expected_speedup(mean_accepted_tokens: float, drafted_per_step: float, skipped_fraction: float) -> float:
    """Tokens per cycle over the cycle's cost in full forwards: each draft forward costs (1 - skipped_fraction),
    the verification one. A proxy; memory-bound GPUs verify k tokens at about the cost of one."""
    return mean_accepted_tokens / (1 + drafted_per_step * (1 - skipped_fraction))


def measure(model, prompt_ids: list[list[int]], settings: SamplingSettings, skip: SkipSet | None, draft_cfg,
            eos_token_id, seed: int, layers: int, on_prompt=None, head: DraftHead | None = None,
            costs: StepCosts | None = None, vocab_size: int | None = None) -> dict:
    """Decode every prompt (self-speculatively with `skip` and `head`, plainly when skip is None) with one fresh
    exit policy; with `costs`, also price each step by the cost model (`vocab_size`: the head's size).
    `on_prompt(index, counts)` runs after each prompt (it may raise TrialPruned). Returns `aggregate(...)`."""
    drafter = SelfDrafter(model, skip, head) if skip is not None else None
    policy = make_exit_policy(draft_cfg, settings.greedy) if skip is not None else None
    draft_ms = costs.draft_ms(skip, vocab_size) if costs is not None and skip is not None else None
    per_prompt = []
    for index, ids in enumerate(prompt_ids):
        generator = torch.Generator(device=model.device).manual_seed(seed + index)
        result = generate(model, ids, settings, drafter, policy, eos_token_id, generator)
        counts = prompt_counts(result)
        if draft_ms is not None:
            counts["modelled_ms"] = sum(costs.step_ms(s.drafted, draft_ms) for s in result.steps)
            counts["plain_modelled_ms"] = counts["emitted"] * costs.verify_ms[0]
        per_prompt.append(counts)
        if on_prompt is not None:
            on_prompt(index, counts)
    return aggregate(per_prompt, skip.fraction(layers) if skip is not None else 0.0)


def _warm_up(loaded, ids: list[int], settings: SamplingSettings, draft_cfg, space: SearchSpace) -> None:
    """One short untimed plain and self-speculative generation, so trial 0 is not charged for first calls."""
    short = dataclasses.replace(settings, max_new_tokens=min(8, settings.max_new_tokens))
    skip = SkipSet((space.hi - 1,), ())
    for drafter in (None, SelfDrafter(loaded.model, skip)):
        generate(loaded.model, ids[:64], short, drafter, make_exit_policy(draft_cfg, settings.greedy),
                 loaded.tokenizer.eos_token_id)


@dataclass
class TrialObjective:
    """The Optuna objective: suggest a skip set, prune it if degenerate or a duplicate of a pruned trial, reuse
    the values of a finished duplicate, otherwise decode the search prompts with it."""
    model: object
    prompt_ids: list
    settings: SamplingSettings
    draft_cfg: object
    eos_token_id: int | None
    seed: int
    space: SearchSpace
    objective: str
    plain_tokens_per_s: float | None = None
    heads: dict = dataclasses.field(default_factory=dict)  # draft vocabulary size -> DraftHead
    costs: StepCosts | None = None  # for objective cost_model

    @property
    def report_key(self) -> str:
        return {"tokens_per_s": "tokens_per_s", "cost_model": "modelled_speedup"}.get(self.objective,
                                                                                   "mean_accepted_tokens")

    def __call__(self, trial: optuna.Trial):
        trial.set_user_attr("worker", WORKER)
        candidate = self.space.suggest(trial)
        skip = candidate.skip
        trial.set_user_attr("attn", list(skip.attn))
        trial.set_user_attr("mlp", list(skip.mlp))
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

        metrics = measure(self.model, self.prompt_ids, self.settings, skip, self.draft_cfg, self.eos_token_id,
                          self.seed, self.space.num_layers, on_prompt, self.heads.get(candidate.vocab_size),
                          self.costs, candidate.vocab_size)
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


# --- running trials and logging them ---------------------------------------------------------------------------

def run_trials(study, objective: TrialObjective, n_trials: int, missing: int, out_dir: Path, cfg,
               study_name: str) -> None:
    """Run up to `missing` trials here; stop once the study holds n_trials finished trials (other workers count)."""
    log = TrialLog(out_dir / "trials.jsonl", study_name, cfg, objective.objective)
    bar = tqdm(total=missing, desc="search", unit="trial")

    def progress(study, trial: FrozenTrial) -> None:
        bar.update(1)
        bar.set_postfix_str(_best_text(study, objective.objective))

    try:
        study.optimize(objective, n_trials=missing, gc_after_trial=False,
                       callbacks=[optuna.study.MaxTrialsCallback(n_trials, states=FINISHED), log, progress])
        log.finish(study, choose_best(study, objective.objective) if _has_complete(study) else None)
    finally:
        bar.close()
        log.close()


def _has_complete(study) -> bool:
    return bool(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))


def _best_text(study, objective: str) -> str:
    if not _has_complete(study):
        return "best=-"
    best = choose_best(study, objective)
    if objective == "pareto":
        speedup = best.user_attrs["metrics"]["expected_speedup"]
        return f"front={len(study.best_trials)} chosen=#{best.number} (expected {speedup:.3g}x)"
    return f"best={best.value:.4g} (#{best.number})"


class TrialLog:
    """trials.jsonl (one line per trial this process finished) and, with logger.kind=wandb, one W&B run."""

    def __init__(self, path: Path, study_name: str, cfg, objective: str):
        self.path, self.study_name, self.objective = path, study_name, objective
        self.run = _wandb_run(cfg, study_name, path.parent)

    def __call__(self, study, trial: FrozenTrial) -> None:
        row = {"study": self.study_name, "number": trial.number, "state": trial.state.name,
               "attn": trial.user_attrs.get("attn"), "mlp": trial.user_attrs.get("mlp"),
               "draft_vocab_size": trial.user_attrs.get("draft_vocab_size"),
               "values": trial.values if trial.state == TrialState.COMPLETE else None,
               "metrics": trial.user_attrs.get("metrics"), "pruned": trial.user_attrs.get("pruned"),
               "duplicate_of": trial.user_attrs.get("duplicate_of"), "worker": trial.user_attrs.get("worker"),
               "duration_s": trial.duration.total_seconds() if trial.duration else None}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.run is not None:
            self._log_wandb(study, trial)

    def _log_wandb(self, study, trial: FrozenTrial) -> None:
        metrics = trial.user_attrs.get("metrics") or {}
        skipped = len(trial.user_attrs.get("attn") or []) + len(trial.user_attrs.get("mlp") or [])
        row = {"trial": trial.number, "trial/pruned": int(trial.state == TrialState.PRUNED),
               "trial/skipped_fraction": skipped / (2 * study.user_attrs["num_layers"])}
        for key in ("tokens_per_s", "mean_accepted_tokens", "acceptance_rate", "expected_speedup", "speedup"):
            if metrics.get(key) is not None and trial.state == TrialState.COMPLETE:
                row[f"trial/{key}"] = metrics[key]
        if _has_complete(study):
            best = choose_best(study, self.objective)
            row["best/trial"] = best.number
            row["best/expected_speedup"] = best.user_attrs["metrics"]["expected_speedup"]
            if self.objective != "pareto":
                row["best/value"] = best.value
        self.run.log(row)

    def finish(self, study, best: FrozenTrial | None) -> None:
        """Skip mask of the chosen trial (and the Pareto front) as W&B tables."""
        if self.run is None or best is None:
            return
        import wandb

        layers = study.user_attrs["num_layers"]
        attn, mlp = set(best.user_attrs["attn"]), set(best.user_attrs["mlp"])
        self.run.log({"best/skip_mask": wandb.Table(columns=["layer", "attn_skipped", "mlp_skipped"],
                                                    data=[[i, i in attn, i in mlp] for i in range(layers)])})
        if self.objective == "pareto":
            front = [[t.number, t.values[0], t.values[1], t.user_attrs["metrics"]["expected_speedup"],
                      t.number == best.number] for t in study.best_trials]
            self.run.log({"pareto_front": wandb.Table(columns=["trial", "skipped_fraction", "mean_accepted_tokens",
                                                               "expected_speedup", "chosen"], data=front)})
        for key, value in (best.user_attrs.get("metrics") or {}).items():
            if not isinstance(value, list):
                self.run.summary[f"best/{key}"] = value
        self.run.summary["best/trial"] = best.number

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def _wandb_run(cfg, study_name: str, out_dir: Path):
    """One W&B run per search process, grouped by study (workers of one study share the group)."""
    logger = cfg.get("logger") or {}
    if logger.get("kind", "none") != "wandb":
        return None
    import wandb

    from selfspec.wandb_logger import MODES

    mode = logger.get("mode", "offline")
    if mode not in MODES:
        raise SelfspecError(f"logger.mode={mode!r} is unknown; allowed: {', '.join(MODES)}")
    run = wandb.init(project=logger.get("project", "selfspec"), name=f"search-{study_name}", group=study_name,
                     job_type="search", mode=mode, dir=str(out_dir), config=OmegaConf.to_container(cfg, resolve=True))
    run.define_metric("trial")
    run.define_metric("trial/*", step_metric="trial")
    run.define_metric("best/*", step_metric="trial")
    return run
