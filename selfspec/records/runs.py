"""Experiment run folders read back typed: a run's records and the settings its figures plot them against, a
search's trials and best skip set.

Each experiment (`python run.py [-m] experiment=NAME`) writes its records to
`outputs/experiments/NAME/<date_time>/` (a run) or to numbered subfolders of it (a sweep). Hydra's
`.hydra/config.yaml` is read here, once; what leaves this module is typed.
"""

import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import yaml

from selfspec.errors import SelfspecError
from selfspec.records.prompt_records import PromptRecord, read_jsonl, read_records
from selfspec.settings import SkipSet, default_threshold, make_skip_set

EXPERIMENTS = ("threshold_sweep", "adaptive_trace", "skip_ratio", "search_history", "strategies", "sampling", "batch",
               "field")
REPOSITORY = Path(__file__).resolve().parents[2]
SAMPLE_RECORDS = REPOSITORY / "notebooks" / "sample_records"  # laid out like outputs/: experiments/<name>/<date_time>
_DATE = re.compile(r"(\d{4}-\d{2}-\d{2})(?:[_T ](\d{2})[-:](\d{2}))?")


@dataclass(kw_only=True)
class Run:
    """One run: its records and the settings the figures plot them against (from its Hydra config)."""
    records: list[PromptRecord]
    model: str | None = None
    date: str | None = None
    path: Path | None = None
    draft_policy: str = "?"  # fixed | threshold | adaptive; "?" without a config
    draft_threshold: float = default_threshold(greedy=True)  # the fixed threshold, or the adaptive policy's start
    target_acceptance: float | None = None  # the adaptive policy's, when the config sets it
    skip_set: str | None = None  # the skip_ratio experiment's name of the skip set; "searched": the search's
    skipped_fraction: float | None = None  # share of the 2 x layers sublayers skipped; None: no skip set or layer count
    sampling_label: str = "greedy"  # "greedy", or "T=0.7, top-p 0.9", ...
    batch_size: int | None = None  # prompts decoded together (run.py batch_size); None: a config without it


@dataclass
class TrialMetrics:
    """What the figures read of a trial's metrics (the search writes more)."""
    skipped_fraction: float | None = None
    mean_accepted_tokens: float | None = None
    expected_speedup: float | None = None  # what two-objective (pareto) searches rank their front by


@dataclass
class Trial:
    """One line of a search's trials.jsonl: a finished trial and what it measured."""
    number: int
    state: str  # COMPLETE | PRUNED | FAIL
    values: list[float] | None = None  # the objective values of a COMPLETE trial
    metrics: TrialMetrics | None = None

    def __post_init__(self):
        if self.state == "COMPLETE" and not self.values:
            raise SelfspecError(f"COMPLETE trial {self.number} has no values")


@dataclass
class Search:
    """A search run: its trials (the last line of each, in number order), the best skip set (None until
    best_skip.yaml is written) with the layer count it was searched on, and what the search maximised."""
    trials: list[Trial]
    model: str | None = None
    date: str | None = None
    objective: str | None = None  # tokens_per_s | acceptance | pareto | cost_model
    best: SkipSet | None = None
    best_trial: int | None = None
    num_layers: int | None = None
    path: Path | None = field(default=None, repr=False)


def records_date(path: Path) -> str:
    """The date (and time) in the folder name Hydra gave the run or sweep (`YYYY-MM-DD_HH-MM-SS`), else the
    modification time of its newest file; "(sample records)" follows for the shipped sample, so titles say so."""
    date = _folder_date(path)
    return f"{date} (sample records)" if Path(path).resolve().is_relative_to(SAMPLE_RECORDS) else date


def _folder_date(path: Path) -> str:
    for part in reversed(Path(path).parts):
        if match := _DATE.search(part):
            return match.group(1) + (f" {match.group(2)}:{match.group(3)}" if match.group(2) else "")
    files = [p for p in Path(path).rglob("*") if p.is_file()] or [Path(path)]
    return datetime.fromtimestamp(max(p.stat().st_mtime for p in files)).strftime("%Y-%m-%d %H:%M")


def read_config(run_dir: Path) -> dict:
    """The run's .hydra/config.yaml with interpolations resolved (left as written where they don't resolve)."""
    path = Path(run_dir) / ".hydra" / "config.yaml"
    if not path.is_file():
        return {}
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    cfg = OmegaConf.load(path)
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException:  # e.g. ${hydra:...} or an environment variable that is gone
        return OmegaConf.to_container(cfg, resolve=False)


def skipped_fraction(config: dict) -> float | None:
    """Share of the 2 x layers sublayers a run's skip set leaves out (layers: skip_num_layers of the skip_ratio
    experiment, or model.num_layers of tiny models); None without skip lists or a layer count."""
    skip = config.get("skip") or {}
    layers = config.get("skip_num_layers") or (config.get("model") or {}).get("num_layers")
    if not layers or not isinstance(skip.get("attn"), list) or not isinstance(skip.get("mlp"), list):
        return None
    return (len(skip["attn"]) + len(skip["mlp"])) / (2 * layers)


def sampling_label(config: dict) -> str:
    sampling = config.get("sampling") or {}
    if not sampling.get("temperature"):
        return "greedy"
    parts = [f"T={sampling['temperature']:g}"]
    if sampling.get("top_p", 1.0) < 1.0:
        parts.append(f"top-p {sampling['top_p']:g}")
    if sampling.get("top_k"):
        parts.append(f"top-k {sampling['top_k']}")
    return ", ".join(parts)


def run_from_config(records: list[PromptRecord], config: dict, path: Path | None = None) -> Run:
    """A Run of `records` with the settings of its resolved Hydra config; a null draft threshold is the policy's
    default (settings.default_threshold)."""
    draft = config.get("draft") or {}
    greedy = not (config.get("sampling") or {}).get("temperature")
    threshold = draft.get("threshold")
    return Run(records=records, model=(config.get("model") or {}).get("name"),
               date=records_date(path) if path is not None else None, path=path,
               draft_policy=str(draft.get("policy", "?")),
               draft_threshold=default_threshold(greedy) if threshold is None else threshold,
               target_acceptance=draft.get("target_acceptance"), skip_set=config.get("skip_set"),
               skipped_fraction=skipped_fraction(config), sampling_label=sampling_label(config),
               batch_size=config.get("batch_size"))


def load_run(run_dir: str | Path) -> Run:
    run_dir = Path(run_dir)
    path = run_dir / "records.jsonl"
    if not path.is_file():
        raise SelfspecError(f"{run_dir}: no records.jsonl (not a run folder, or the run has not finished a prompt)")
    return run_from_config(read_records(path), read_config(run_dir), run_dir)


def run_dirs(path: str | Path, marker: str = "records.jsonl") -> list[Path]:
    """`path` if it holds `marker`, else its subfolders that do (a Hydra sweep: 0, 1, 2, ... in job order)."""
    path = Path(path)
    if (path / marker).is_file():
        return [path]
    found = [p for p in path.iterdir() if (p / marker).is_file()] if path.is_dir() else []
    return sorted(found, key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name))


def load_runs(path: str | Path) -> list[Run]:
    """The run at `path`, or the runs of the sweep at `path`; SelfspecError if there are none."""
    dirs = run_dirs(path)
    if not dirs:
        raise SelfspecError(f"{path}: no records.jsonl in it or in its subfolders")
    return [load_run(d) for d in dirs]


def read_trials(path: str | Path) -> list[Trial]:
    """A trials.jsonl's trials: the last line of each trial number (a resumed search appends), in number order."""
    by_number = {trial.number: trial for trial in read_jsonl(path, Trial)}
    return [by_number[n] for n in sorted(by_number)]


def load_search(path: str | Path) -> Search:
    path = Path(path)
    if not (path / "trials.jsonl").is_file():
        raise SelfspecError(f"{path}: no trials.jsonl (run `python run.py experiment=search_history`)")
    best_path = path / "best_skip.yaml"
    best = (yaml.safe_load(best_path.read_text()) or {}) if best_path.is_file() else {}
    config = read_config(path)
    metrics = best.get("metrics") or {}
    search = Search(read_trials(path / "trials.jsonl"), date=records_date(path), path=path,
                    model=best.get("model") or (config.get("model") or {}).get("name"),
                    objective=metrics.get("objective") or (config.get("search") or {}).get("objective"),
                    best_trial=metrics.get("trial"), num_layers=best.get("num_layers"))
    if best:
        try:
            search.best = make_skip_set(best.get("attn"), best.get("mlp"), best.get("num_layers") or 0)
        except SelfspecError as err:
            raise SelfspecError(f"{best_path}: {err}") from None
    return search


def latest(outputs: str | Path, experiment: str) -> Path | None:
    """The newest (by folder name, Hydra's date_time) folder of outputs/experiments/<experiment> holding a run
    or a sweep; None if there is none."""
    root = Path(outputs) / "experiments" / experiment
    if not root.is_dir():
        return None
    candidates = [p for p in root.iterdir() if p.is_dir() and (run_dirs(p) or run_dirs(p, "trials.jsonl"))]
    return max(candidates, key=lambda p: p.name) if candidates else None


def find_records(experiment: str, path: str | Path | None = None, outputs: str | Path = "outputs") -> Path:
    """Where a notebook reads `experiment`'s records: `path` if given, else the latest run under `outputs`
    (relative to the working folder, then to the repository), else the shipped sample (notebooks/sample_records)."""
    if experiment not in EXPERIMENTS:
        raise SelfspecError(f"experiment {experiment!r} is unknown; allowed: {', '.join(EXPERIMENTS)}")
    if path is not None:
        if not Path(path).exists():
            raise SelfspecError(f"records path {str(path)!r} does not exist")
        return Path(path)
    for root in (Path(outputs), REPOSITORY / outputs, SAMPLE_RECORDS):
        if (found := latest(root, experiment)) is not None:
            return found
    raise SelfspecError(f"no records of {experiment!r}: run `python run.py -m experiment={experiment}` first")
