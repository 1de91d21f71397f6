"""Weights & Biases logging: per-verification acceptance and threshold, per-prompt speed, the summary; a run's
final files (records, summary, best_skip.yaml, a Kangaroo adapter) as artifacts.

Offline by default (no network; `wandb sync <dir>/wandb/offline-run-*` uploads later).
"""

import re
import warnings
from pathlib import Path

from selfspec.errors import SelfspecError, SelfspecWarning
from selfspec.models.cache_files import refuse_damaged
from selfspec.records.prompt_records import PromptRecord, skip_set_at
from selfspec.records.run_dir import check_output_dir
from selfspec.settings import LoggerSettings


def start_run(logger: LoggerSettings, out_dir: Path, config: dict | None = None, **init):
    """The W&B run of one process (None with logger.kind=none), its files under out_dir/wandb; `init`: further
    `wandb.init` arguments (name, group, job_type), over the logger settings'."""
    if logger.kind == "none":
        return None
    import wandb

    init = {"name": logger.name, "group": logger.group, **init}
    try:
        check_output_dir(Path(out_dir) / "wandb")  # else wandb quietly writes to a temporary folder instead
        return wandb.init(project=logger.project, mode=logger.mode, dir=str(out_dir), config=config, **init)
    except (OSError, SelfspecError, wandb.Error) as err:  # the records are the source of truth: go on without W&B
        warnings.warn(f"W&B is off for this run: its files in {Path(out_dir) / 'wandb'} cannot be written "
                      f"({_reason(err)}); the records are written "
                      f"as usual (free space or make the folder writable to log to W&B again)", SelfspecWarning)
        return None


def _reason(err: Exception) -> str:
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def log_files(run, name: str, kind: str, paths: list[Path], metadata: dict | None = None) -> None:
    """Log final files as a version of the W&B artifact `name` (type `kind`): runs logging the same name add
    versions v0, v1, ... Characters W&B refuses in a name become '-'. A file written with its sha256 beside it
    (models/cache_files.py) that no longer matches it is refused in one line before anything is logged."""
    import wandb

    for path in paths:
        refuse_damaged(Path(path), str(path), f"make it again before logging it as the W&B artifact {name}")
    artifact = wandb.Artifact(re.sub(r"[^\w.-]", "-", name), type=kind, metadata=metadata)
    for path in paths:
        artifact.add_file(str(path))  # copied to W&B's staging dir: a later resume changes no logged version
    run.log_artifact(artifact)


class WandbLogger:
    """Per-verification acceptance and threshold, per-prompt speed and the summary of an evaluation."""

    def __init__(self, run):
        self.run = run
        self.verify_steps: dict[str, int] = {}

    def _define(self, strategy: str) -> None:
        self.run.define_metric(f"{strategy}/verify_step")
        self.run.define_metric(f"{strategy}/step_*", step_metric=f"{strategy}/verify_step")
        self.run.define_metric("prompt")
        self.run.define_metric(f"{strategy}/prompt_*", step_metric="prompt")
        self.verify_steps[strategy] = 0

    def log_prompt(self, index: int, record: PromptRecord) -> None:
        name = record.strategy
        if name not in self.verify_steps:
            self._define(name)
        for index, step in enumerate(record.steps):
            self.verify_steps[name] += 1
            skip = skip_set_at(record.skip_sets, index)
            self._log({f"{name}/verify_step": self.verify_steps[name],
                       f"{name}/step_acceptance": step.accepted / step.drafted if step.drafted else None,
                       f"{name}/step_drafted": step.drafted,
                       f"{name}/step_threshold": step.threshold,
                       f"{name}/step_skipped_sublayers": len(skip.attn) + len(skip.mlp) if skip else None})
        self._log({"prompt": index, f"{name}/prompt_tokens_per_s": record.tokens_per_s,
                   f"{name}/prompt_speedup": record.speedup,
                   f"{name}/prompt_acceptance_rate": record.acceptance_rate})

    def _log(self, row: dict) -> None:
        self.run.log({k: v for k, v in row.items() if v is not None})

    def log_summary(self, summary: dict) -> None:
        for name, row in summary.items():
            for key, value in row.items():
                if key != "by_category":
                    self.run.summary[f"{name}/{key}"] = value

    def finish(self) -> None:
        self.run.finish()


def make_logger(logger: LoggerSettings, run_config: dict, out_dir: Path, group: str | None = None
                ) -> WandbLogger | None:
    """The evaluation's W&B run, in logger.group, else in `group` (a sweep's runs share its directory)."""
    run = start_run(logger, out_dir, run_config, group=logger.group or group)
    return WandbLogger(run) if run is not None else None
