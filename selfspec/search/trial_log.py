"""Running the trials of this process and logging each one: trials.jsonl, the progress bar and, with
logger.kind=wandb, one W&B run per search process (grouped by study, so workers of one study share the group)
that ends with the chosen trial and best_skip.yaml as an artifact."""

import dataclasses
import json
from pathlib import Path

import optuna
from optuna.trial import FrozenTrial, TrialState
from tqdm import tqdm

from selfspec.records.run_dir import append_line
from selfspec.records.wandb_logger import log_files, start_run
from selfspec.search.objective import TrialObjective, choose_best
from selfspec.search.study import FINISHED, RESUME
from selfspec.settings import RunSettings


def run_trials(study, objective: TrialObjective, n_trials: int, missing: int, log: "TrialLog") -> None:
    """Run up to `missing` trials here, each logged by `log`; stop once the study holds n_trials finished trials
    (other workers count)."""
    bar = tqdm(total=missing, desc="search", unit="trial")

    def progress(study, trial: FrozenTrial) -> None:
        bar.update(1)
        bar.set_postfix_str(_best_text(study, objective.objective))

    try:
        study.optimize(objective, n_trials=missing, gc_after_trial=False,  # the trial's line first, the study's
                       # read after: a kill between a trial's end and its line is as short as it can be
                       callbacks=[log, optuna.study.MaxTrialsCallback(n_trials, states=FINISHED), progress])
    finally:
        bar.close()


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

    def __init__(self, path: Path, study_name: str, settings: RunSettings, objective: str):
        self.path, self.study_name, self.objective = path, study_name, objective
        self.run = start_run(settings.logger, path.parent, dataclasses.asdict(settings), name=f"search-{study_name}",
                             group=study_name, job_type="search")
        if self.run is not None:
            self.run.define_metric("trial")
            self.run.define_metric("trial/*", step_metric="trial")
            self.run.define_metric("best/*", step_metric="trial")

    def __call__(self, study, trial: FrozenTrial) -> None:
        row = {"study": self.study_name, "number": trial.number, "state": trial.state.name,
               "attn": trial.user_attrs.get("attn"), "mlp": trial.user_attrs.get("mlp"),
               "draft_vocab_size": trial.user_attrs.get("draft_vocab_size"),
               "values": trial.values if trial.state == TrialState.COMPLETE else None,
               "metrics": trial.user_attrs.get("metrics"), "pruned": trial.user_attrs.get("pruned"),
               "duplicate_of": trial.user_attrs.get("duplicate_of"), "worker": trial.user_attrs.get("worker"),
               "duration_s": trial.duration.total_seconds() if trial.duration else None}
        append_line(self.path, json.dumps(row), RESUME)  # whole lines: a full disk keeps the earlier ones
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

    def finish(self, study, best: FrozenTrial, best_path: Path) -> None:
        """Skip mask of the chosen trial (and the Pareto front) as W&B tables; best_path (the written
        best_skip.yaml) and trials.jsonl as an artifact of the study."""
        if self.run is None:
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
        trials = [self.path] if self.path.is_file() else []  # none when this process ran no trial
        log_files(self.run, f"{self.study_name}-best_skip", "skip-config", [best_path, *trials])

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
