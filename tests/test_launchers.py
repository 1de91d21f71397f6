"""Hydra launchers: the joblib and submitit plugins compose, a submitit_local sweep writes every job's records, and a
job of a parallel launcher warns that its timings are not comparable and says so in summary.json."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.types import RunMode
from omegaconf import OmegaConf

from selfspec.evaluation.task import run
from selfspec.settings import LaunchSettings, launch_settings

from helpers import run_settings
from wandb_history import run_group

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model=tiny_llama", "data.name=chat", "data.limit=1", "sampling.max_new_tokens=8", "warmup=false"]


@pytest.mark.parametrize("launcher, target, option", [("joblib", "JoblibLauncher", "n_jobs"),
                                                      ("submitit_local", "LocalLauncher", "timeout_min"),
                                                      ("submitit_slurm", "SlurmLauncher", "partition")])
def test_the_launcher_plugins_are_installed_and_compose(launcher, target, option):
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"hydra/launcher={launcher}"], return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith(f".{target}") and option in cfg.hydra.launcher


def hydra_runtime(mode: RunMode, target: str = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"):
    return OmegaConf.create({"mode": mode, "sweep": {"dir": "multirun/x"}, "job": {"num": 3},
                             "launcher": {"_target_": target}})


def test_launch_settings_tell_single_runs_sequential_and_parallel_sweeps_apart():
    assert launch_settings(hydra_runtime(RunMode.RUN)) == LaunchSettings()
    sequential = launch_settings(hydra_runtime(RunMode.MULTIRUN))
    assert (sequential.sweep_dir, sequential.job_num, sequential.parallel) == ("multirun/x", 3, False)
    joblib = launch_settings(hydra_runtime(RunMode.MULTIRUN, "hydra_plugins.hydra_joblib_launcher.joblib_launcher."
                                                             "JoblibLauncher"))
    assert (joblib.launcher, joblib.parallel) == ("JoblibLauncher", True)


@pytest.mark.slow
def test_a_parallel_job_warns_once_and_marks_its_summary(tmp_path, capsys):
    settings = run_settings(*TINY, "logger=none")
    for job in ("single", "1"):
        (tmp_path / job).mkdir()
    run(settings, tmp_path / "single")
    assert "not comparable" not in capsys.readouterr().err
    assert "parallel_launcher" not in json.loads((tmp_path / "single" / "summary.json").read_text())["self_spec"]
    settings.launch = LaunchSettings(sweep_dir=str(tmp_path), job_num=1, launcher="JoblibLauncher")
    run(settings, tmp_path / "1")
    assert capsys.readouterr().err.count("not comparable") == 1
    summary = json.loads((tmp_path / "1" / "summary.json").read_text())
    assert {row["parallel_launcher"] for row in summary.values()} == {"JoblibLauncher"}


@pytest.mark.slow
def test_a_submitit_local_sweep_writes_both_jobs_records_in_one_wandb_group(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "run.py", "-m", "hydra/launcher=submitit_local", *TINY, "logger=wandb",
                             "draft=threshold", "draft.threshold=0.3,0.9", f"hydra.sweep.dir={tmp_path}"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=500)
    assert result.returncode == 0, result.stderr[-3000:]
    for job, threshold in ((0, 0.3), (1, 0.9)):
        records = [json.loads(line) for line in (tmp_path / str(job) / "records.jsonl").read_text().splitlines()]
        assert {r["strategy"] for r in records} == {"plain", "self_spec", "self_spec_hybrid"}
        assert {s["threshold"] for r in records if r["strategy"] == "self_spec" for s in r["steps"]} == {threshold}
        summary = json.loads((tmp_path / str(job) / "summary.json").read_text())
        assert summary["self_spec"]["parallel_launcher"] == "LocalLauncher"
        (wandb_run,) = (tmp_path / str(job) / "wandb").glob("offline-run-*")
        assert run_group(wandb_run) == str(tmp_path)
    logs = sorted((tmp_path / ".submitit").glob("*/*_log.err"))
    assert [log.read_text().count("not comparable") for log in logs] == [1, 1]
