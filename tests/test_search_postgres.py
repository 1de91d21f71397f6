"""The search on a real PostgreSQL server (started here by pgserver, the `test` extra): three workers share a study,
a SIGKILLed worker's trial is failed by Optuna's heartbeat and run again, a rerun resumes, optuna-dashboard serves
the study."""

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import replace
from pathlib import Path

import optuna
import pgserver
import pytest
import yaml
from optuna.trial import TrialState

from selfspec.errors import SelfspecError
from selfspec.records.prompt_records import read_jsonl
from selfspec.search.objective import choose_best
from selfspec.search.study import FINISHED, fail_dead_trials, open_storage, open_study, quiet_optuna

from helpers import run_settings

ROOT = Path(__file__).resolve().parents[1]
# Tiny trials (4 search prompts x 12 tokens on the tiny Llama), heartbeats every second, failed after 2 s of silence.
WORKER = ["search=optuna", "model=tiny_llama", "logger=none", "data.name=chat", "data.limit=1",
          "sampling.max_new_tokens=8", "warmup=false", "search.data.limit=4", "search.max_new_tokens=12",
          "search.study_name=shared", "search.heartbeat_interval=1", "search.grace_period=2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
SEARCH = run_settings("search=optuna").search  # the config's search settings


@pytest.fixture(scope="module")
def postgres():
    """A PostgreSQL server of this test module, deleted afterwards. As root, pgserver runs it as its own system
    user and opens the folder's parents to it: outside pytest's tmp root, which other pytest runs close again."""
    server = pgserver.get_server(tempfile.mkdtemp(prefix="selfspec-pg-"), cleanup_mode="delete")
    yield server
    server.cleanup()


@pytest.fixture
def database(postgres) -> str:
    """A fresh database's URL, the form users write: postgresql://user:password@/name?host=<socket dir>."""
    name = f"study_{uuid.uuid4().hex[:8]}"
    postgres.psql(f"CREATE DATABASE {name};")
    return postgres.get_uri(name)


def run_worker(url: str, out: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "run.py", *WORKER, f"search.storage='{url}'", f"hydra.run.dir={out}",
                             *overrides], cwd=ROOT, env=ENV, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


@functools.cache
def storage_of(url: str):
    return optuna.storages.RDBStorage(url)


def load(url: str):
    with quiet_optuna():
        return optuna.load_study(study_name="shared", storage=storage_of(url))


def running_trial_of(url: str, pid: int):
    """A trial that worker `pid` is inside the objective of (it marks its trials host:pid first thing)."""
    mark = f"{socket.gethostname()}:{pid}"
    try:
        trials = load(url).get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    except KeyError:  # the study is not created yet
        return None
    return next((t for t in trials if t.user_attrs.get("worker") == mark), None)


def decoding(trial) -> bool:
    """Whether a running trial has its whole skip set and decodes with it (neither empty nor over max_skip_fraction
    0.5 of the tiny Llama's 12 sublayers, which prune at once)."""
    attrs = trial.user_attrs if trial is not None else {}
    return "draft_vocab_size" in attrs and 1 <= len(attrs["attn"] + attrs["mlp"]) <= 6  # set last, after attn, mlp


def finished_records(out: Path) -> dict:
    path = out / "trials.jsonl"
    return {r["number"]: r for r in (read_jsonl(path) if path.is_file() else []) if r["state"] in ("COMPLETE", "PRUNED")}


@pytest.mark.slow
def test_three_workers_share_a_postgresql_study_and_a_killed_workers_trial_is_retried(database, tmp_path):
    n_trials = 20
    outs = [tmp_path / f"w{i}" for i in range(3)]
    workers = [run_worker(database, out, f"search.n_trials={n_trials}", f"search.seed={i}")
               for i, out in enumerate(outs)]
    deadline = time.monotonic() + 120
    while not decoding(killed := running_trial_of(database, workers[0].pid)):
        assert workers[0].poll() is None and time.monotonic() < deadline, "worker 0 never ran a trial"
        time.sleep(0.02)
    workers[0].send_signal(signal.SIGKILL)
    workers[0].wait()
    for worker in workers[1:]:
        _, stderr = worker.communicate(timeout=240)
        assert worker.returncode == 0, stderr[-2000:]

    trials = load(database).trials
    pids = {t.user_attrs.get("worker", "").rpartition(":")[2] for t in trials} - {""}
    assert pids == {str(w.pid) for w in workers}  # all three ran trials of the one study
    assert [t.number for t in trials] == list(range(len(trials)))
    assert trials[killed.number].state == TrialState.FAIL  # by the live workers' heartbeat check, before any rerun
    (retried,) = [t for t in trials if t.system_attrs.get("failed_trial") == killed.number]
    assert retried.params == killed.params and retried.state in FINISHED
    assert retried.user_attrs["worker"] != killed.user_attrs["worker"]
    finished = [t for t in trials if t.state in FINISHED]
    assert n_trials <= len(finished) <= n_trials + 1  # both live workers stop at n_trials; one may overshoot
    recorded = {n: r for out in outs for n, r in finished_records(out).items()}
    assert sorted(recorded) == sorted(t.number for t in finished)  # every finished trial is in some worker's log
    for t in finished:
        assert recorded[t.number]["state"] == t.state.name
        assert recorded[t.number]["values"] == (t.values if t.state == TrialState.COMPLETE else None)

    rerun = run_worker(database, outs[0], f"search.n_trials={n_trials + 3}", "search.seed=0")  # the killed command
    stdout, stderr = rerun.communicate(timeout=180)
    assert rerun.returncode == 0, stderr[-2000:]
    assert f"{len(finished)} of {n_trials + 3} trials finished" in stdout
    after = load(database).trials
    assert sum(t.state in FINISHED for t in after) == n_trials + 3  # it ran only the missing ones
    assert all((after[t.number].state, after[t.number].values) == (t.state, t.values) for t in finished)
    best = yaml.safe_load((outs[0] / "best_skip.yaml").read_text())
    study_best = choose_best(load(database), "tokens_per_s")
    assert best["metrics"]["trial"] == study_best.number and best["metrics"]["storage"] == database
    assert (best["attn"], best["mlp"]) == (study_best.user_attrs["attn"], study_best.user_attrs["mlp"])
    assert json.loads((outs[0] / "summary.json").read_text())["self_spec"]["n_prompts"] == 1


def test_a_dead_local_workers_trial_is_failed_and_queued_again_in_postgresql(database, tmp_path):
    with quiet_optuna():
        storage, _ = open_storage(replace(SEARCH, storage=database, heartbeat_interval=1, grace_period=2,
                                               max_retry=1), tmp_path)
        study = open_study(storage, database, "shared", "acceptance", "tiny", 6, optuna.pruners.NopPruner())
        dead = subprocess.Popen(["true"])
        dead.wait()
        trial = study.ask({"attn_0": optuna.distributions.CategoricalDistribution([False, True])})
        trial.set_user_attr("worker", f"{socket.gethostname()}:{dead.pid}")
        assert fail_dead_trials(study, storage) == 1
    first, again = study.trials
    assert first.state == TrialState.FAIL
    assert (again.state, again.params, again.system_attrs["failed_trial"]) == (TrialState.WAITING, first.params, 0)


def test_an_rdb_url_without_a_server_or_a_driver_is_one_line(tmp_path):
    with quiet_optuna(), pytest.raises(SelfspecError, match=r"^search.storage='postgresql://nobody@/none\?host=/no/"
                                                            r"such/dir' cannot be opened: OperationalError") as error:
        open_storage(replace(SEARCH, storage="postgresql://nobody@/none?host=/no/such/dir"), tmp_path)
    assert "\n" not in str(error.value)
    with quiet_optuna(), pytest.raises(SelfspecError, match=r"^search.storage='mysql://u@h/db' cannot be opened: no "
                                                            r"database driver: "):
        open_storage(replace(SEARCH, storage="mysql://u@h/db"), tmp_path)


@pytest.mark.slow
def test_optuna_dashboard_serves_a_postgresql_study(database, tmp_path):
    with quiet_optuna():
        storage, _ = open_storage(replace(SEARCH, storage=database), tmp_path)
        study = open_study(storage, database, "shared", "acceptance", "tiny", 6, optuna.pruners.NopPruner())
        for value in (1.5, 2.5):
            study.add_trial(optuna.trial.create_trial(value=value))
    with socket.socket() as probe:  # a free port on the loopback interface
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([str(Path(sys.executable).parent / "optuna-dashboard"), database, "--host", "127.0.0.1",
                               "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=5) as response:
                    studies = json.load(response)["study_summaries"]
                break
            except OSError:
                assert server.poll() is None, server.stderr.read()[-2000:]
                assert time.monotonic() < deadline, "optuna-dashboard did not answer within 60 s"
                time.sleep(0.2)
        (served,) = studies
        assert served["study_name"] == "shared"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies/{served['study_id']}", timeout=5) as response:
            detail = json.load(response)
        assert sorted(t["values"][0] for t in detail["trials"]) == [1.5, 2.5]
    finally:
        server.terminate()
        server.wait(timeout=30)
