"""make reproduce: the plan of experiments per scale, skipping experiments done at the same scale, one real run."""

import subprocess
from pathlib import Path

import pytest

from selfspec.errors import SelfspecError
from selfspec.plots import reproduce as rep
from selfspec.plots.figures import FIGURE_GROUPS, SWEEPS
from selfspec.records.runs import load_runs

from helpers import run_settings


def one_job(overrides: tuple[str, ...]) -> list[str]:
    """A sweep's overrides with each swept list cut to its first value (lists in brackets are values)."""
    return [o if o.split("=", 1)[1].startswith("[") else o.split(",")[0] for o in overrides]


@pytest.mark.parametrize("scale", list(rep.PLANS))
def test_every_scale_runs_every_experiment_once_with_settings_that_compose(scale):
    experiments = rep.plan(scale)
    assert [e.name for e in experiments] == list(FIGURE_GROUPS)
    assert {e.name for e in experiments if e.multirun} == set(SWEEPS)
    for experiment in experiments:
        run_settings(f"experiment={experiment.name}", *one_job(experiment.overrides))  # a bad key or value raises


def test_smoke_decodes_fewer_prompts_and_tokens_than_paper():
    for smoke, paper in zip(rep.plan("smoke"), rep.plan("paper")):
        small, full = (run_settings(f"experiment={e.name}", *one_job(e.overrides)) for e in (smoke, paper))
        assert small.data.limit * small.sampling.max_new_tokens < full.data.limit * full.sampling.max_new_tokens
        assert small.model.name == "smollm2"  # the embedded model: no download


def test_extra_overrides_go_last_and_unknown_scales_are_one_line():
    assert all(e.overrides[-1] == "model=gemma3_270m" for e in rep.plan("smoke", ("model=gemma3_270m",)))
    with pytest.raises(SelfspecError, match="^scale='huge' is unknown; allowed: smoke, paper$"):
        rep.plan("huge")


class FakeRuns:
    """Stands in for subprocess.run: writes a records file where the command says, fails for `failing`."""

    def __init__(self, failing: str | None = None):
        self.commands, self.failing = [], failing

    def __call__(self, argv, cwd):
        self.commands.append(argv)
        folder = Path(argv[-1].split("=", 1)[1])
        (folder / ("0" if "-m" in argv else "")).mkdir(parents=True)
        (folder / ("0" if "-m" in argv else "") / "records.jsonl").write_text("")
        return subprocess.CompletedProcess(argv, 1 if f"experiment={self.failing}" in argv else 0)


def test_reproduce_skips_experiments_done_at_the_same_scale_and_retries_a_failed_one(tmp_path):
    lines = []
    broken = FakeRuns(failing="skip_ratio")
    with pytest.raises(SelfspecError, match="experiment skip_ratio failed .exit 1.; what it wrote is in .*rerun"):
        rep.reproduce("smoke", tmp_path, rep.plan("smoke"), run=broken, log=lines.append)
    assert [c[c.index("-m") + 1 if "-m" in c else 2] for c in broken.commands] == [
        "experiment=threshold_sweep", "experiment=adaptive_trace", "experiment=skip_ratio"]
    assert lines[0].startswith("[1/8] threshold_sweep: running ") and lines[1].startswith("[1/8] threshold_sweep: done")

    lines.clear()
    rerun = FakeRuns()
    folders = rep.reproduce("smoke", tmp_path, rep.plan("smoke"), run=rerun, log=lines.append)
    assert [c[-1].split("/")[-2] for c in rerun.commands] == ["skip_ratio", "search_history", "strategies", "sampling",
                                                              "batch", "field"]
    assert lines[:2] == [f"[1/8] threshold_sweep: skipped, done at scale smoke in {folders[0]}",
                         f"[2/8] adaptive_trace: skipped, done at scale smoke in {folders[1]}"]
    assert all((folder / rep.MARKER).is_file() for folder in folders)

    again = FakeRuns()
    rep.reproduce("smoke", tmp_path, rep.plan("smoke"), run=again, log=lines.append)
    assert again.commands == []  # everything done at this scale
    rep.reproduce("paper", tmp_path, rep.plan("paper")[:1], run=again, log=lines.append)
    rep.reproduce("smoke", tmp_path, rep.plan("smoke", ("seed=1",))[:1], run=again, log=lines.append)
    assert len(again.commands) == 2  # another scale, other overrides: not done yet


@pytest.mark.slow
def test_reproduce_runs_an_experiment_through_run_py_into_a_readable_run(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # tiny matmuls: a second thread only waits on a shared machine
    (experiment,) = [e for e in rep.plan("smoke", ("model=tiny_llama", "logger=none")) if e.name == "adaptive_trace"]
    (folder,) = rep.reproduce("smoke", tmp_path, [experiment])
    assert folder.parent == tmp_path / "experiments" / "adaptive_trace" and (folder / rep.MARKER).is_file()
    (run,) = load_runs(folder)
    assert run.model == "tiny_llama" and {r.strategy for r in run.records} == {"plain", "self_spec"}
    assert rep.reproduce("smoke", tmp_path, [experiment], run=None) == [folder]  # done: nothing is run
