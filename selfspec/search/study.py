"""The Optuna study: its storage (a journal file or an RDB, shared by workers), sampler, pruner, and the trials
that dead workers left RUNNING."""

import importlib.util
import os
import socket
import warnings
from contextlib import contextmanager
from pathlib import Path

import optuna
from optuna.trial import TrialState

from selfspec.errors import SelfspecError
from selfspec.settings import SearchSettings

JOURNAL_NAME = "optuna_journal.log"
JOURNAL_LOCK_GRACE_S = 10  # appends hold the lock for milliseconds; optuna's default waits 30 s on a stale lock
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)  # what counts towards search.n_trials
WORKER = f"{socket.gethostname()}:{os.getpid()}"  # written on every trial, to spot trials of dead workers


@contextmanager
def quiet_optuna():
    """Optuna's INFO lines and experimental-feature warnings off: trials.jsonl and the bar say what happened."""
    verbosity = optuna.logging.get_verbosity()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        try:
            yield
        finally:
            optuna.logging.set_verbosity(verbosity)


def open_storage(search: SearchSettings, out_dir: Path):
    """(storage, text) of `search.storage`: a journal file (None = out_dir/optuna_journal.log, or a path) or an RDB
    URL. In an RDB every running trial sends a heartbeat; any worker marks a trial silent for `search.grace_period` s
    as FAIL and queues its skip set again (at most `search.max_retry` times)."""
    spec = search.storage or str(out_dir / JOURNAL_NAME)
    if "://" in spec:
        retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=search.max_retry)
        try:
            return optuna.storages.RDBStorage(spec, heartbeat_interval=search.heartbeat_interval,
                                              grace_period=search.grace_period,
                                              heartbeat_stale_trial_callback=retry), spec
        except ImportError as err:  # SQLAlchemy found no driver for the URL's database
            hint = " (pip install -e '.[distributed]' installs psycopg 3)" if spec.startswith("postgresql") else ""
            raise SelfspecError(f"search.storage={spec!r} cannot be opened: no database driver{hint}: "
                                f"{_first_line(err)}") from None
        except Exception as err:  # sqlalchemy and driver errors have no common base
            raise SelfspecError(f"search.storage={spec!r} cannot be opened: {type(err).__name__}: "
                                f"{_first_line(err)}") from None
    path = Path(spec).expanduser()
    if path.is_dir() or not path.parent.is_dir():
        raise SelfspecError(f"search.storage={spec!r} cannot be opened: give a journal file in an existing "
                            f"directory, or an RDB URL (sqlite:///study.db, postgresql://...)")
    # A worker killed while appending leaves the lock file; the next opener breaks it after the grace period.
    lock = optuna.storages.journal.JournalFileSymlinkLock(str(path), grace_period=JOURNAL_LOCK_GRACE_S)
    try:
        backend = optuna.storages.journal.JournalFileBackend(str(path), lock_obj=lock)
    except OSError as err:
        raise SelfspecError(f"search.storage={spec!r} cannot be opened: {_first_line(err)}") from None
    return optuna.storages.JournalStorage(backend), str(path)


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [""])[0]


def open_study(storage, storage_text: str, name: str, objective: str, model: str, layers: int, pruner):
    """Create the study or load it (load_if_exists), checking that it was made for this model and objective."""
    directions = ["maximize", "maximize"] if objective == "pareto" else ["maximize"]
    try:
        study = optuna.create_study(storage=storage, study_name=name, directions=directions, pruner=pruner,
                                    load_if_exists=True)
    except Exception as err:  # a journal of another format, a database without rights, ...
        raise SelfspecError(f"search.storage={storage_text!r}: study {name!r} cannot be opened: "
                            f"{type(err).__name__}: {_first_line(err)}") from None
    made_for = {"model": model, "num_layers": layers, "objective": objective}
    for key, value in made_for.items():
        found = study.user_attrs.get(key)
        if found is None:
            study.set_user_attr(key, value)
        elif found != value:
            raise SelfspecError(f"study {name!r} in {storage_text} was made for {key}={found!r}, not {value!r}; "
                                f"set another search.study_name")
    return study


def make_sampler(name: str, seed: int | None, n_startup_trials: int):
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=n_startup_trials)
    if name == "gp":
        if importlib.util.find_spec("scipy") is None:
            raise SelfspecError("search.sampler='gp' needs scipy: pip install scipy, or use search.sampler=tpe")
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=n_startup_trials)
    return optuna.samplers.RandomSampler(seed=seed)


def make_pruner(objective: str, p_threshold: float):
    """Wilcoxon signed-rank test of the per-prompt values against the best trial's (single objective only)."""
    if objective == "pareto" or p_threshold == 0:
        return optuna.pruners.NopPruner()
    if importlib.util.find_spec("scipy") is None:
        print("search: scipy is not installed, so trials are not pruned early (pip install scipy)")
        return optuna.pruners.NopPruner()
    return optuna.pruners.WilcoxonPruner(p_threshold=p_threshold)


def fail_dead_trials(study, storage) -> int:
    """Mark RUNNING trials whose worker process on this host is gone (killed mid-trial) as FAIL, and queue them
    again where the storage retries heartbeat-stale trials (RDB); returns how many.

    Trials of live workers and of other hosts are left alone (RDB storages also fail them by heartbeat). A trial
    killed before its objective began (while sampling) carries no worker mark and no parameters: it stays RUNNING
    and is ignored, since only complete and pruned trials count."""
    host = socket.gethostname()
    retry = storage.get_heartbeat_stale_trial_callback() if isinstance(storage, optuna.storages.RDBStorage) else None
    failed = 0
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker_host, _, pid = str(trial.user_attrs.get("worker", "")).rpartition(":")
        if worker_host == host and pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
            if retry is not None:
                retry(study, trial)  # reads only the trial's number, parameters and attributes
            failed += 1
    return failed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
