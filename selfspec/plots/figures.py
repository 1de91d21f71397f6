"""Make the figures of the latest records of each experiment: `python -m selfspec.figures [--outputs outputs]
[--out outputs/figures] [--wandb]` (make figures).

The latest run or sweep folder of each experiment (selfspec.records.runs) becomes PNG and PDF figures in `--out`;
an experiment without records is drawn from the shipped sample records, labelled so in every title. Notebooks call the same loaders and plot functions.
"""

import argparse
import sys
from pathlib import Path

from selfspec import plots
from selfspec.errors import SelfspecError, print_warnings_as_lines
from selfspec.records.run_dir import replacing
from selfspec.records.runs import SAMPLE_RECORDS, latest, load_runs, load_search
from selfspec.records.wandb_logger import start_run
from selfspec.settings import LoggerSettings


# --- figure groups: experiment folder -> {figure name: Figure} -----------------------------------------------------

def threshold_sweep_figures(path: str | Path) -> dict:
    runs = load_runs(path)
    return {"threshold_sweep": plots.plot_threshold_sweep(runs, model=runs[0].model, date=runs[0].date)}


def adaptive_trace_figures(path: str | Path) -> dict:
    run = load_runs(path)[0]
    return {
        "adaptive_trace": plots.plot_adaptive_trace(run.records, target_acceptance=run.target_acceptance,
                                                    model=run.model, date=run.date),
        "adaptive_accepted": plots.plot_accepted_histogram(run.records, model=run.model, date=run.date),
    }


def skip_ratio_figures(path: str | Path) -> dict:
    runs = load_runs(path)
    return {"skip_ratio": plots.plot_skip_ratio(runs, model=runs[0].model, date=runs[0].date)}


def search_history_figures(path: str | Path) -> dict:
    search = load_search(path)
    figures = {
        "search_history": plots.plot_search_history(search.trials, objective=search.objective, model=search.model,
                                                    date=search.date),
        "search_pareto": plots.plot_pareto_front(search.trials, chosen=search.best_trial, model=search.model,
                                                 date=search.date),
    }
    if search.best is not None:
        figures["search_skip_mask"] = plots.plot_skip_mask(search.best, search.num_layers,
                                                           title="Best skip mask of the search", model=search.model,
                                                           date=search.date)
    return figures


def strategies_figures(path: str | Path) -> dict:
    run = load_runs(path)[0]
    return {"strategies_speedup": plots.plot_strategy_speedups(run.records, model=run.model, date=run.date),
            "strategies_accepted": plots.plot_accepted_histogram(run.records, model=run.model, date=run.date)}


def sampling_figures(path: str | Path) -> dict:
    runs = load_runs(path)
    return {"sampling": plots.plot_sampling(runs, model=runs[0].model, date=runs[0].date)}


def batch_figures(path: str | Path) -> dict:
    runs = load_runs(path)
    return {"batch_speedup": plots.plot_batch_speedup(runs, model=runs[0].model, date=runs[0].date),
            "batch_throughput": plots.plot_batch_throughput(runs, model=runs[0].model, date=runs[0].date)}


def field_figures(path: str | Path) -> dict:
    run = load_runs(path)[0]
    greedy = run.sampling_label == "greedy"
    return {"field_speedup": plots.plot_field_speedups(run.records, greedy=greedy, model=run.model, date=run.date)}


SWEEPS = ("threshold_sweep", "skip_ratio", "sampling", "batch")  # experiments run with -m
FIGURE_GROUPS = {
    "threshold_sweep": threshold_sweep_figures,
    "adaptive_trace": adaptive_trace_figures,
    "skip_ratio": skip_ratio_figures,
    "search_history": search_history_figures,
    "strategies": strategies_figures,
    "sampling": sampling_figures,
    "batch": batch_figures,
    "field": field_figures,
}


def save_figure(fig, out: str | Path, name: str) -> list[Path]:
    """`name`.png and `name`.pdf in `out`, each replaced whole: a full disk or a read-only folder leaves the
    earlier file and no half one, and ends in one SelfspecError line naming the folder."""
    out = Path(out)
    rerun = f"rerun make figures, or choose another folder with --out (figures in {out} before are kept)"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise SelfspecError(f"cannot make the figure folder {out}: {err.strerror}; {rerun}") from None
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    for path in paths:
        with replacing(path, rerun) as temporary:
            fig.savefig(temporary, dpi=plots.STYLE["savefig.dpi"])
    return paths


def make_figures(outputs: str | Path = "outputs", out: str | Path | None = None, log=print,
                 samples: Path | None = SAMPLE_RECORDS) -> dict:
    """Every figure of every experiment, as PNG and PDF in `out` (default outputs/figures): from the latest records
    under `outputs`, else from `samples` (the shipped sample records, "sample records" in every title; None: skip
    the experiment); logs one line per figure (or per skipped experiment). Returns {name: Figure}."""
    out = Path(out) if out is not None else Path(outputs) / "figures"
    made = {}
    for experiment, make in FIGURE_GROUPS.items():
        path = latest(outputs, experiment)
        if path is None:
            path = latest(samples, experiment) if samples is not None else None
            log(f"{experiment}: no records under {Path(outputs) / 'experiments' / experiment}, "
                f"{'drawing the shipped sample records' if path else 'skipped'} (yours: python run.py"
                f"{' -m' if experiment in SWEEPS else ''} experiment={experiment}, or make reproduce)")
            if path is None:
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
    print_warnings_as_lines()
    import matplotlib

    matplotlib.use("Agg")
    try:
        figures = make_figures(args.outputs, args.out)
    except SelfspecError as error:
        print(f"selfspec: error: {str(error).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    if figures and args.wandb:
        run = start_run(LoggerSettings(kind="wandb", mode="offline"), Path(args.outputs), None, job_type="figures")
        if run is None:  # start_run warned: the figures are on disk
            return
        try:
            log_figures(run, figures)
        finally:
            run.finish()


if __name__ == "__main__":
    main()
