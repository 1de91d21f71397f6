"""The Optuna study: its storage (a journal file or an RDB, shared by workers), sampler, pruner, and the trials
that dead workers left RUNNING."""

import importlib.util
import json
import logging
import os
import socket
import warnings
from contextlib import contextmanager
from pathlib import Path

import optuna
import sqlalchemy.exc
from optuna.trial import TrialState

from selfspec.errors import SelfspecError
from selfspec.records.run_dir import append_line, disk_trouble, drop_torn_tail, is_torn
from selfspec.settings import SearchSettings

JOURNAL_NAME = "optuna_journal.log"
JOURNAL_LOCK_GRACE_S = 10  # appends hold the lock for milliseconds; optuna's default waits 30 s on a stale lock
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)  # what counts towards search.n_trials
WORKER = f"{socket.gethostname()}:{os.getpid()}"  # written on every trial, to spot trials of dead workers
RESUME = "rerun the same command: the study resumes with the trials it holds"
# SQLite's words for a full disk and a read-only database file, inside SQLAlchemy's OperationalError
SQLITE_TROUBLE = {"database or disk is full": "the disk is full", "readonly database": "the database is read-only"}


@contextmanager
def quiet_optuna():
    """Optuna's INFO lines and experimental-feature warnings off: trials.jsonl and the bar say what happened; so is
    its warning with a traceback about a trial the storage failed (storage_writes says that in one line)."""
    verbosity = optuna.logging.get_verbosity()
    trial_logger = logging.getLogger("optuna.study._optimize")  # where Optuna logs a failed trial
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        trial_logger.addFilter(_not_storage_failures)
        try:
            yield
        finally:
            trial_logger.removeFilter(_not_storage_failures)
            optuna.logging.set_verbosity(verbosity)


def _not_storage_failures(record: logging.LogRecord) -> bool:
    """False for Optuna's lines about a trial that failed on a full or read-only storage: its warning with the
    traceback, and the `failed with value None` after it (the objective never returns None)."""
    error = record.exc_info[1] if record.exc_info else None
    failed_on_storage = error is not None and storage_trouble(error) is not None
    return not (failed_on_storage or record.getMessage().endswith("failed with value None."))


def storage_spec(search: SearchSettings, out_dir: Path) -> str:
    """search.storage, or the journal file in the run folder."""
    return search.storage or str(out_dir / JOURNAL_NAME)


def open_storage(search: SearchSettings, out_dir: Path):
    """(storage, text) of `search.storage`: a journal file (None = out_dir/optuna_journal.log, or a path) or an RDB
    URL. In an RDB every running trial sends a heartbeat; any worker marks a trial silent for `search.grace_period` s
    as FAIL and queues its skip set again (at most `search.max_retry` times)."""
    spec = storage_spec(search, out_dir)
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
            if storage_trouble(err) is not None:
                raise  # storage_writes says it
            raise SelfspecError(f"search.storage={spec!r} cannot be opened: {type(err).__name__}: "
                                f"{_first_line(err)}") from None
    path = Path(spec).expanduser()
    if path.is_dir() or not path.parent.is_dir():
        raise SelfspecError(f"search.storage={spec!r} cannot be opened: give a journal file in an existing "
                            f"directory, or an RDB URL (sqlite:///study.db, postgresql://...)")
    # A worker killed while appending leaves the lock file; the next opener breaks it after the grace period.
    lock = optuna.storages.journal.JournalFileSymlinkLock(str(path), grace_period=JOURNAL_LOCK_GRACE_S)
    try:
        backend = WholeLineJournal(path, lock)
    except OSError as err:
        if disk_trouble(err) is not None:
            raise  # storage_writes says it
        raise SelfspecError(f"search.storage={spec!r} cannot be opened: {_first_line(err)}") from None
    return optuna.storages.JournalStorage(backend), str(path)


class WholeLineJournal(optuna.storages.journal.JournalFileBackend):
    """Optuna's journal file, appended in whole lines or not at all (run_dir.append_line): a write the disk cut
    short is cut off again, where Optuna's own append would leave part of a line for the next one to join, and the
    journal could no longer be read. A torn last line that a killed writer left is cut off on opening."""

    def __init__(self, path: Path, lock):
        super().__init__(str(path), lock_obj=lock)
        self.path, self.lock = path, lock
        if path.is_file() and is_torn(path.read_text(errors="replace")):
            with self.locked():
                drop_torn_tail(path)

    @contextmanager
    def locked(self):
        self.lock.acquire()
        try:
            yield
        finally:
            self.lock.release()

    def append_logs(self, logs: list[dict]) -> None:
        with self.locked():
            append_line(self.path, "\n".join(json.dumps(log, separators=(",", ":")) for log in logs), RESUME)


@contextmanager
def storage_writes(storage_text: str):
    """A full disk or a read-only storage met anywhere in the study (opening it, a trial, the chosen trial) as one
    SelfspecError line naming the storage: the trials it holds stay whole (SQLite rolls the write back; the journal
    cuts it off), and a rerun resumes the study."""
    try:
        yield
    except SelfspecError:
        raise
    except Exception as err:
        why = storage_trouble(err)
        if why is None:
            raise
        raise SelfspecError(f"cannot write the study's storage {storage_text}: {why}; the trials it holds are kept "
                            f"(free space or make it writable, then {RESUME})") from None


def storage_trouble(err: BaseException) -> str | None:
    """What a full disk or a read-only file did, found in `err` or the errors behind it (Optuna wraps SQLAlchemy's
    OperationalError in a StorageInternalError); None for any other failure."""
    while err is not None:
        if isinstance(err, OSError) and disk_trouble(err):
            return disk_trouble(err)
        if isinstance(err, sqlalchemy.exc.OperationalError):
            found = [why for words, why in SQLITE_TROUBLE.items() if words in str(err.orig)]
            if found:
                return found[0]
        err = err.__cause__ or err.__context__
    return None


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [""])[0]


def open_study(storage, storage_text: str, name: str, objective: str, model: str, layers: int, pruner):
    """Load the study or create it, checking that it was made for this model and objective. Loading writes
    nothing, so a finished study on a read-only storage still gives its best trial."""
    directions = ["maximize", "maximize"] if objective == "pareto" else ["maximize"]
    try:
        if name in optuna.get_all_study_names(storage):
            study = optuna.load_study(storage=storage, study_name=name, pruner=pruner)
        else:  # load_if_exists: another worker may create it first
            study = optuna.create_study(storage=storage, study_name=name, directions=directions, pruner=pruner,
                                        load_if_exists=True)
    except Exception as err:  # a journal of another format, a database without rights, ...
        if storage_trouble(err) is not None:
            raise  # storage_writes says it
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
