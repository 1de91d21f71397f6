"""Every experiment behind the figures, at one scale, in one command: `python -m selfspec.plots.reproduce --scale
smoke|paper [override ...]` (make reproduce SCALE=...; `make figures` then draws them).

Each experiment runs as `python run.py [-m] experiment=NAME <scale's overrides> <extra overrides>` into
outputs/experiments/NAME/<date_time>/, one after another (timings stay comparable); a finished one gets a
`reproduce.json` there, so a rerun skips experiments already done at the same scale and overrides and retries
only the one that failed or was killed.
"""

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from selfspec.errors import SelfspecError
from selfspec.records.run_dir import write_file
from selfspec.records.runs import EXPERIMENTS, REPOSITORY
from selfspec.timing import clock

MARKER = "reproduce.json"


@dataclass(frozen=True)
class Experiment:
    """One run.py command of a plan: the experiment, whether it is a sweep (-m), and its overrides."""
    name: str
    multirun: bool
    overrides: tuple[str, ...]


# smoke: every figure element on the embedded SmolLM2 at the smallest useful scale (1-3 prompts, 32 tokens, short sweeps)
SMOKE = (
    Experiment("threshold_sweep", True, ("draft=threshold,adaptive", "draft.threshold=0.2,0.8", "data.limit=2",
                                         "sampling.max_new_tokens=32")),
    Experiment("adaptive_trace", False, ("data.limit=3", "sampling.max_new_tokens=48")),
    Experiment("skip_ratio", True, ("skip_set=p10a,p30a,searched", "data.limit=2", "sampling.max_new_tokens=32")),
    Experiment("search_history", False, ("search.n_trials=8", "search.data.limit=2", "search.max_new_tokens=8",
                                         "data.limit=2", "sampling.max_new_tokens=32")),
    Experiment("strategies", False, ("data.limit=2", "sampling.max_new_tokens=32")),
    Experiment("sampling", True, ("data.limit=2", "sampling.max_new_tokens=32")),
    Experiment("batch", True, ("batch_size=1,4", "data.limit=1", "sampling.max_new_tokens=32")),
    Experiment("field", False, ("data.limit=1", "repeats=1", "sampling.max_new_tokens=32")),
)
# paper: the commands behind docs/results.md's figures; the experiments' own settings where it shows none
PAPER = (
    Experiment("threshold_sweep", True, ("draft=threshold,adaptive", "draft.threshold=0.0,0.2,0.4,0.6,0.8,1.0",
                                         "data.limit=3", "sampling.max_new_tokens=64")),
    Experiment("adaptive_trace", False, ("data.limit=8",)),
    Experiment("skip_ratio", True, ("data.limit=5", "sampling.max_new_tokens=96")),
    Experiment("search_history", False, ()),
    Experiment("strategies", False, ("model=gemma3_270m", "data.limit=4",
                                     "strategies=[plain,self_spec_adaptive,self_spec_hybrid,prompt_lookup]")),
    Experiment("sampling", True, ()),
    Experiment("batch", True, ()),
    Experiment("field", False, ()),
)
PLANS = {"smoke": SMOKE, "paper": PAPER}


def plan(scale: str, extra: tuple[str, ...] = ()) -> list[Experiment]:
    """The experiments of `scale`, each with the `extra` overrides appended (they win over the scale's)."""
    if scale not in PLANS:
        raise SelfspecError(f"scale={scale!r} is unknown; allowed: {', '.join(PLANS)}")
    return [Experiment(e.name, e.multirun, (*e.overrides, *extra)) for e in PLANS[scale]]


def command(experiment: Experiment, folder: Path) -> list[str]:
    """run.py's command line writing `experiment` into `folder` (a sweep: numbered subfolders)."""
    where = f"hydra.{'sweep' if experiment.multirun else 'run'}.dir={folder}"
    return [sys.executable, str(REPOSITORY / "run.py"), *(["-m"] if experiment.multirun else []),
            f"experiment={experiment.name}", *experiment.overrides, where]


def done_folder(outputs: Path, experiment: Experiment, scale: str) -> Path | None:
    """The folder of outputs/experiments/<name> that a finished run of `experiment` at `scale` marked, if any."""
    for marker in sorted((Path(outputs) / "experiments" / experiment.name).glob(f"*/{MARKER}")):
        done = json.loads(marker.read_text())
        if done.get("scale") == scale and done.get("overrides") == list(experiment.overrides):
            return marker.parent
    return None


def new_folder(parent: Path) -> Path:
    """parent/<date_time> as Hydra names runs, with -2, -3, ... if a run (a failed one) already has that second."""
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    folder, n = parent / stamp, 1
    while folder.exists():
        n += 1
        folder = parent / f"{stamp}-{n}"
    return folder


def reproduce(scale: str, outputs: Path, experiments: list[Experiment], run=subprocess.run, log=print) -> list[Path]:
    """Run every experiment not yet done at `scale` under `outputs`, one after another; returns their folders.
    `run(argv, cwd=...)` runs a command line (subprocess.run; tests pass a fake)."""
    folders = []
    for index, experiment in enumerate(experiments, 1):
        step = f"[{index}/{len(experiments)}] {experiment.name}"
        folder = done_folder(outputs, experiment, scale)
        if folder is not None:
            log(f"{step}: skipped, done at scale {scale} in {folder}")
            folders.append(folder)
            continue
        folder = new_folder(Path(outputs) / "experiments" / experiment.name)
        argv = command(experiment, folder)
        log(f"{step}: running {' '.join(argv[1:])}")
        start = clock()
        returncode = run(argv, cwd=REPOSITORY).returncode
        if returncode != 0:
            raise SelfspecError(f"experiment {experiment.name} failed (exit {returncode}); what it wrote is in "
                                f"{folder}; rerun to retry it (finished experiments are skipped)")
        seconds = clock() - start
        write_file(folder / MARKER, json.dumps({"scale": scale, "overrides": list(experiment.overrides),
                                                "seconds": round(seconds, 1)}, indent=2),
                   "rerun make reproduce (finished experiments are skipped)")
        log(f"{step}: done in {seconds:.0f} s -> {folder}")
        folders.append(folder)
    return folders


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m selfspec.plots.reproduce", description=__doc__.splitlines()[0])
    parser.add_argument("--scale", default="smoke", help=f"one of {', '.join(PLANS)} (default: smoke)")
    parser.add_argument("--outputs", type=Path, default=REPOSITORY / "outputs", help="default: <repository>/outputs")
    parser.add_argument("overrides", nargs="*", help="run.py overrides added to every experiment, e.g. model=...")
    args = parser.parse_args(argv)
    start = clock()
    try:
        reproduce(args.scale, args.outputs.resolve(), plan(args.scale, tuple(args.overrides)))
    except SelfspecError as error:
        print(f"selfspec: error: {error}", file=sys.stderr)
        sys.exit(2)
    print(f"reproduce: every experiment of scale {args.scale} done ({clock() - start:.0f} s); "
          f"figures: make figures")


if __name__ == "__main__":
    main()
