"""The small record set shipped in notebooks/sample_records (what `make figures` and the notebooks draw where
no experiment has run): `make reproduce SCALE=smoke`'s runs on SmolLM2, slimmed; and the tiny-Llama runs of
every experiment that the tests plot (seconds each).

    python experiments/sample_records.py [--outputs outputs] [--out notebooks/sample_records]

runs what `make reproduce SCALE=smoke` has not yet done under --outputs, then slims its runs into --out. Records
are slimmed for shipping (see `_slim_record`); the figures do not read what is dropped.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
from dataclasses import fields
from datetime import datetime
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from selfspec.plots.reproduce import plan, reproduce
from selfspec.records.prompt_records import RecordedStep, read_jsonl

ROOT = Path(__file__).resolve().parents[1]
TINY = {"model": "tiny_llama", "logger": "none", "data.limit": 2, "sampling.max_new_tokens": 16}
# experiment: (multirun, overrides on top of TINY), as small as still shows every figure element
TEST_RUNS = {
    "threshold_sweep": (True, {"draft.threshold": "0.3,0.9"}),
    "adaptive_trace": (False, {}),
    "skip_ratio": (True, {"skip_set": "p20a,p50a"}),
    "search_history": (False, {"search.n_trials": 6, "search.data.limit": 2, "search.max_new_tokens": 8}),
    "strategies": (False, {}),
    "sampling": (True, {}),
    "batch": (True, {"batch_size": "1,4", "data.limit": 1}),  # 7 prompts: batches of 4 and 3
    "field": (False, {"data.limit": 1, "repeats": 1}),  # 7 prompts, one per set
}
KEPT_FILES = ("records.jsonl", ".hydra/config.yaml", "trials.jsonl", "best_skip.yaml")
STEP_FIELDS = tuple(f.name for f in fields(RecordedStep))  # what the figures read of a verification step
STEP_FIGURES = ("adaptive_trace", "strategies")  # the experiments whose figures read verification steps


def command(experiment: str, outputs: Path, multirun: bool, overrides: dict, stamp: str) -> list[str]:
    """run.py's command line for a tiny run of `experiment` into outputs/experiments/<experiment>/<stamp>."""
    settings = {**TINY, **overrides}
    where = f"hydra.{'sweep' if multirun else 'run'}.dir={outputs}/experiments/{experiment}/{stamp}"
    return [sys.executable, str(ROOT / "run.py"), *(["-m"] if multirun else []), f"experiment={experiment}",
            *(f"{key}={value}" for key, value in settings.items()), where]


def run_experiments(outputs: Path, runs: dict = TEST_RUNS, jobs: int = 2, timeout: float = 300) -> None:
    """Run `runs` (default: the test set) into `outputs`, `jobs` at a time, one torch thread each, named as
    Hydra names a run started now; raises RuntimeError with the stderr tail of the first failure."""
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    pending = [command(name, Path(outputs), multirun, overrides, stamp) for name, (multirun, overrides) in runs.items()]
    running = []
    while pending or running:
        while pending and len(running) < jobs:
            argv = pending.pop(0)
            running.append((argv, subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                                   stderr=subprocess.PIPE, text=True)))
        argv, process = running.pop(0)
        _, stderr = process.communicate(timeout=timeout)
        if process.returncode != 0:
            for _, other in running:
                other.kill()
            raise RuntimeError(f"{' '.join(argv[1:])} failed ({process.returncode}):\n{stderr[-3000:]}")


def slim(outputs: Path, dest: Path, folders: list[Path] | None = None) -> None:
    """Copy the figure inputs of `folders` (default: all of outputs/experiments) into dest/experiments, records
    without outputs."""
    for source in sorted(p for folder in (folders or [Path(outputs) / "experiments"]) for p in Path(folder).rglob("*")):
        relative = source.relative_to(outputs)
        if not source.is_file() or not any(str(relative).endswith(name) for name in KEPT_FILES):
            continue
        target = Path(dest) / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.name == "records.jsonl":
            rows = [_slim_record(row, relative.parts[1] in STEP_FIGURES) for row in read_jsonl(source)]
            target.write_text("".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows))
        elif source.name == "config.yaml":  # resolved, without the skip_ratio table of every model's skip sets
            config = OmegaConf.to_container(OmegaConf.load(source), resolve=True)
            config.pop("random_skip_sets", None)
            target.write_text(yaml.safe_dump(config, sort_keys=False))
        else:
            shutil.copyfile(source, target)


def _slim_record(record: dict, keep_steps: bool) -> dict:
    """No outputs, timings to 4 digits, only the step fields figures read, and steps only where `keep_steps` (the
    figures read them) and something was drafted (plain decoding's steps: one token each)."""
    record = {k: _round(v) for k, v in record.items() if k not in ("output_ids", "output_text")}
    steps = record.get("steps", []) if record["drafted"] and keep_steps else []
    record["steps"] = [{k: _round(step[k]) for k in STEP_FIELDS} for step in steps]
    return record


def _round(value):
    return float(f"{value:.4g}") if isinstance(value, float) else value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outputs", type=Path, default=ROOT / "outputs")
    parser.add_argument("--out", type=Path, default=ROOT / "notebooks" / "sample_records")
    args = parser.parse_args()
    folders = reproduce("smoke", args.outputs, plan("smoke"))
    shutil.rmtree(args.out / "experiments", ignore_errors=True)
    slim(args.outputs, args.out, folders)
    size = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"sample records in {args.out}: {size / 1024:.0f} KB")


if __name__ == "__main__":
    main()
