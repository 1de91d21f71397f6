"""Load experiment records and make their figures: `python -m selfspec.figures [--outputs outputs]
[--out outputs/figures] [--wandb]` (make figures).

Each experiment (`python run.py [-m] experiment=NAME`) writes its records to
`outputs/experiments/NAME/<date_time>/` (a run) or to numbered subfolders of it (a sweep). The latest such
folder of each experiment becomes PNG and PDF figures in `--out`; experiments without records are skipped with
a note. Notebooks call the same loaders and plot functions.
"""

import argparse
import json
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import yaml

from selfspec import plots
from selfspec.errors import SelfspecError

EXPERIMENTS = ("threshold_sweep", "adaptive_trace", "skip_ratio", "search_history", "strategies", "sampling")
REPOSITORY = Path(__file__).resolve().parents[1]
SAMPLE_RECORDS = REPOSITORY / "notebooks" / "sample_records"  # laid out like outputs/: experiments/<name>/<date_time>
_DATE = re.compile(r"(\d{4}-\d{2}-\d{2})(?:[_T ](\d{2})[-:](\d{2}))?")


@dataclass
class Run:
    """One run folder: its records.jsonl rows and its Hydra config (.hydra/config.yaml, resolved; {} if none)."""
    path: Path
    config: dict
    records: list[dict]

    @property
    def model(self) -> str | None:
        return (self.config.get("model") or {}).get("name")

    @property
    def date(self) -> str:
        return records_date(self.path)


def records_date(path: Path) -> str:
    """The date (and time) in the folder name Hydra gave the run or sweep (`YYYY-MM-DD_HH-MM-SS`), else the
    modification time of its newest file."""
    for part in reversed(Path(path).parts):
        if match := _DATE.search(part):
            return match.group(1) + (f" {match.group(2)}:{match.group(3)}" if match.group(2) else "")
    files = [p for p in Path(path).rglob("*") if p.is_file()] or [Path(path)]
    return datetime.fromtimestamp(max(p.stat().st_mtime for p in files)).strftime("%Y-%m-%d %H:%M")


def read_jsonl(path: Path) -> list[dict]:
    """JSON lines, blank lines skipped; a bad line raises SelfspecError naming file:line."""
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise SelfspecError(f"{path}:{number}: not a JSON line ({err.msg})") from None
    return rows


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


def load_run(run_dir: str | Path) -> Run:
    run_dir = Path(run_dir)
    path = run_dir / "records.jsonl"
    if not path.is_file():
        raise SelfspecError(f"{run_dir}: no records.jsonl (not a run folder, or the run has not finished a prompt)")
    return Run(run_dir, read_config(run_dir), read_jsonl(path))


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


# --- from runs to plot inputs ----------------------------------------------------------------------------------

def threshold_settings(runs: list[Run]) -> list[dict]:
    """{policy, threshold, records} per run of a threshold sweep; a null threshold is the policy's default
    (0.8 greedy, 0.5 sampling), as in selfspec.decoding.strategies.make_exit_policy."""
    settings = []
    for run in runs:
        draft = run.config.get("draft") or {}
        threshold = draft.get("threshold")
        if threshold is None:
            greedy = ((run.config.get("sampling") or {}).get("temperature") or 0) == 0
            threshold = 0.8 if greedy else 0.5
        settings.append({"policy": draft.get("policy", "?"), "threshold": threshold, "records": run.records})
    return settings


def skipped_fraction(config: dict) -> float:
    """Share of the 2 x layers sublayers a run's skip set leaves out (layers: skip_num_layers of the skip_ratio
    experiment, or model.num_layers of tiny models)."""
    skip = config.get("skip") or {}
    layers = config.get("skip_num_layers") or (config.get("model") or {}).get("num_layers")
    if not layers or not isinstance(skip.get("attn"), list) or not isinstance(skip.get("mlp"), list):
        raise SelfspecError("run config lacks skip.attn/skip.mlp lists or the layer count (skip_num_layers); "
                            "run it with experiment=skip_ratio")
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


@dataclass
class Search:
    """A search run: trials.jsonl rows, best_skip.yaml ({} if not written yet), and the run's model."""
    path: Path
    trials: list[dict]
    best: dict
    model: str | None

    @property
    def date(self) -> str:
        return records_date(self.path)

    @property
    def objective(self) -> str | None:
        return (self.best.get("metrics") or {}).get("objective") or (read_config(self.path).get("search") or {}).get(
            "objective")


def load_search(path: str | Path) -> Search:
    path = Path(path)
    if not (path / "trials.jsonl").is_file():
        raise SelfspecError(f"{path}: no trials.jsonl (run `python run.py experiment=search_history`)")
    best_path = path / "best_skip.yaml"
    best = (yaml.safe_load(best_path.read_text()) or {}) if best_path.is_file() else {}
    model = best.get("model") or (read_config(path).get("model") or {}).get("name")
    return Search(path, read_jsonl(path / "trials.jsonl"), best, model)


# --- figure groups: experiment folder -> {figure name: Figure} -----------------------------------------------------

def threshold_sweep_figures(path: str | Path) -> dict:
    runs = load_runs(path)
    return {"threshold_sweep": plots.plot_threshold_sweep(threshold_settings(runs), model=runs[0].model,
                                                          date=runs[0].date)}


def adaptive_trace_figures(path: str | Path) -> dict:
    run = load_runs(path)[0]
    draft = run.config.get("draft") or {}
    return {
        "adaptive_trace": plots.plot_adaptive_trace(run.records, target_acceptance=draft.get("target_acceptance"),
                                                    model=run.model, date=run.date),
        "adaptive_accepted": plots.plot_accepted_histogram(run.records, model=run.model, date=run.date),
    }


def skip_ratio_points(runs: list) -> list[dict]:
    """plot_skip_ratio's input: each run's skipped fraction and records, flagged when it ran the searched set."""
    return [{"skipped_fraction": skipped_fraction(run.config), "records": run.records,
             "searched": run.config.get("skip_set") == "searched"} for run in runs]


def skip_ratio_figures(path: str | Path) -> dict:
    runs = load_runs(path)
    return {"skip_ratio": plots.plot_skip_ratio(skip_ratio_points(runs), model=runs[0].model, date=runs[0].date)}


def search_history_figures(path: str | Path) -> dict:
    search = load_search(path)
    figures = {
        "search_history": plots.plot_search_history(search.trials, objective=search.objective, model=search.model,
                                                    date=search.date),
        "search_pareto": plots.plot_pareto_front(search.trials, chosen=(search.best.get("metrics") or {}).get("trial"),
                                                 model=search.model, date=search.date),
    }
    if search.best:
        figures["search_skip_mask"] = plots.plot_skip_mask(
            search.best["attn"], search.best["mlp"], search.best["num_layers"], title="Best skip mask of the search",
            model=search.model, date=search.date)
    return figures


def strategies_figures(path: str | Path) -> dict:
    run = load_runs(path)[0]
    return {"strategies_speedup": plots.plot_strategy_speedups(run.records, model=run.model, date=run.date),
            "strategies_accepted": plots.plot_accepted_histogram(run.records, model=run.model, date=run.date)}


def sampling_figures(path: str | Path) -> dict:
    runs = load_runs(path)
    points = [{"label": sampling_label(run.config), "records": run.records} for run in runs]
    return {"sampling": plots.plot_sampling(points, model=runs[0].model, date=runs[0].date)}


FIGURE_GROUPS = {
    "threshold_sweep": threshold_sweep_figures,
    "adaptive_trace": adaptive_trace_figures,
    "skip_ratio": skip_ratio_figures,
    "search_history": search_history_figures,
    "strategies": strategies_figures,
    "sampling": sampling_figures,
}


def save_figure(fig, out: str | Path, name: str) -> list[Path]:
    """`name`.png and `name`.pdf in `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    for path in paths:
        fig.savefig(path, dpi=plots.STYLE["savefig.dpi"])
    return paths


def make_figures(outputs: str | Path = "outputs", out: str | Path | None = None, log=print) -> dict:
    """Every figure of every experiment with records under `outputs`, as PNG and PDF in `out` (default
    outputs/figures); logs one line per figure (or per skipped experiment). Returns {name: Figure}."""
    out = Path(out) if out is not None else Path(outputs) / "figures"
    made = {}
    for experiment, make in FIGURE_GROUPS.items():
        path = latest(outputs, experiment)
        if path is None:
            log(f"{experiment}: skipped, no records under {Path(outputs) / 'experiments' / experiment} "
                f"(python run.py{' -m' if experiment in ('threshold_sweep', 'skip_ratio', 'sampling') else ''} "
                f"experiment={experiment})")
            continue
        try:
            figures = make(path)
        except SelfspecError as err:
            log(f"{experiment}: skipped, {str(err).splitlines()[0]}")
            continue
        for name, fig in figures.items():
            save_figure(fig, out, name)
            log(f"{out / name}.{{png,pdf}} <- {path}")
        made.update(figures)
    return made


def log_figures(run, figures: dict) -> None:
    """Log figures to a W&B run as PNG images under `figures/<name>`."""
    import io

    import wandb
    from PIL import Image

    images = {}
    for name, fig in figures.items():
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=plots.STYLE["savefig.dpi"])  # wandb's own conversion needs pyplot
        images[f"figures/{name}"] = wandb.Image(Image.open(buffer))
    run.log(images)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m selfspec.figures", description=__doc__.splitlines()[0])
    parser.add_argument("--outputs", default="outputs", help="the folder run.py writes to (default: outputs)")
    parser.add_argument("--out", default=None, help="where figures go (default: <outputs>/figures)")
    parser.add_argument("--wandb", action="store_true", help="also log the figures to an offline W&B run")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    figures = make_figures(args.outputs, args.out)
    if not figures:
        print(f"no figures: no experiment records under {Path(args.outputs) / 'experiments'}")
    elif args.wandb:
        import wandb

        run = wandb.init(project="selfspec", job_type="figures", mode="offline", dir=args.outputs)
        try:
            log_figures(run, figures)
        finally:
            run.finish()


if __name__ == "__main__":
    main()
