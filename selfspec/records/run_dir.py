"""The run directory's files, safe against a kill, a full disk and a rerun: records appended as whole lines,
other files replaced atomically, the run's settings stored beside its records, an earlier run's files kept.

A run writes `settings.json` (its typed settings) first. `resume=true` continues the records.jsonl already there
only if settings.json says the same settings wrote it; any other rerun into the folder moves the earlier run's
files, its selfspec.log among them, aside to `<name>-<date>-<time><suffix>` before writing its own.
"""

import errno
import json
import logging
import os
import time
import warnings
from contextlib import contextmanager, suppress
from pathlib import Path

from selfspec.errors import SelfspecError, SelfspecWarning

RECORDS_FILE = "records.jsonl"
SETTINGS_FILE = "settings.json"
RUN_FILES = (RECORDS_FILE, "summary.json", "summary.md", SETTINGS_FILE, "model_answer")
LOG_FILE = "selfspec.log"  # Hydra's job log (hydra.job.name, conf/config.yaml), open in this run's logging
UNCHECKED_KEYS = ("resume", "spec_bench_answers", "logger", "launch")  # change neither what is decoded nor what is recorded
RERUN = "rerun the same command with resume=true"  # the way out of a failed write, for a run's records
FULL = (errno.ENOSPC, errno.EDQUOT)
READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)


def check_output_dir(path: Path) -> None:
    """SelfspecError unless `path` is a writable folder or can be made one."""
    existing = Path(path).absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise SelfspecError(f"output directory {path} cannot be made: {existing} is a file, not a folder; "
                            f"choose another with hydra.run.dir=...")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SelfspecError(f"output directory {path} is not writable ({existing} is read-only); "
                            f"choose another with hydra.run.dir=...")


def append_line(path: Path, line: str, rerun: str = RERUN) -> None:
    """Append `line` and a newline in one os.write on an O_APPEND descriptor, synced to disk: a kill leaves whole
    lines only. A failed or short write (disk full) is cut off again and raises one SelfspecError line that ends
    in `rerun`, the way to complete the work."""
    data = (line + "\n").encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as err:
        raise _write_error(path, err, rerun) from None
    try:
        size = os.fstat(fd).st_size
        try:
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # a short write: no room for the rest
            os.fsync(fd)
        except OSError as err:
            with suppress(OSError):
                os.ftruncate(fd, size)
            raise _write_error(path, err, rerun) from None
    finally:
        os.close(fd)


def write_file(path: Path, text: str, rerun: str = RERUN) -> None:
    """Write `text` to a temporary file beside `path`, then rename it over `path`: a failure (disk full) leaves the
    earlier file as it was and raises one SelfspecError line."""
    with replacing(path, rerun) as temporary:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            data = memoryview(text.encode())
            while data:
                data = data[os.write(fd, data):]
        finally:
            os.close(fd)


@contextmanager
def replacing(path: Path, rerun: str = RERUN):
    """Yield a temporary path beside `path` (same suffix, so writers that go by it still can) for the caller to
    write; then sync it and rename it over `path`. An OSError (disk full, read-only folder) leaves the earlier file
    as it was, no temporary, and raises one SelfspecError line that ends in `rerun`."""
    path = Path(path)
    temporary = path.with_name(f".{path.stem}.tmp{path.suffix}")
    try:
        yield temporary
        fd = os.open(temporary, os.O_RDONLY)
        try:
            os.fsync(fd)  # the data is on disk before the name points at it
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except OSError as err:
        raise _write_error(path, err, rerun) from None
    finally:
        with suppress(OSError):
            temporary.unlink(missing_ok=True)


def disk_trouble(err: OSError) -> str | None:
    """What a full disk or a read-only place did (`the disk is full`, `...: read-only`); None for other errors."""
    if err.errno in FULL:
        return "the disk is full"
    if err.errno in READ_ONLY:
        return f"{err.strerror or os.strerror(err.errno)} (read-only)"
    return None


def _write_error(path: Path, err: OSError, rerun: str = RERUN) -> SelfspecError:
    why = disk_trouble(err) or err.strerror or str(err)
    fix = "free space" if err.errno in FULL else f"make {Path(path).parent} writable" if err.errno in READ_ONLY else \
        "fix that"
    return SelfspecError(f"cannot write {path}: {why}; what was written before is kept ({fix}, then {rerun})")


def is_torn(text: str) -> bool:
    """Whether the last line of a JSON-lines text is a torn write: no newline after it and not JSON."""
    if not text or text.endswith("\n"):
        return False
    try:
        json.loads(text[text.rfind("\n") + 1:])
    except json.JSONDecodeError:
        return True
    return False


def open_run_dir(out_dir: Path, settings: dict, resume: bool) -> bool:
    """Make `out_dir` ready for a run with `settings` (JSON-able); True when it continues the records there.

    resume: keep records.jsonl if settings.json says these settings wrote it (else one SelfspecError line naming
    the keys that differ), cutting off a torn last line. Otherwise the earlier run's files are moved aside and
    settings.json is written.
    """
    check_output_dir(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = json.loads(json.dumps(settings))  # as it reads back: tuples are lists
    records = out_dir / RECORDS_FILE
    if resume and records.is_file():
        stored_path = out_dir / SETTINGS_FILE
        if not stored_path.is_file():
            raise SelfspecError(f"resume=true: {records} has no {SETTINGS_FILE} beside it, so the settings that "
                                f"wrote it are unknown; rerun without resume=true (the earlier files are kept)")
        try:
            stored = json.loads(stored_path.read_text())
        except json.JSONDecodeError as err:
            raise SelfspecError(f"resume=true: {stored_path} is not JSON ({err.msg})") from None
        differing = differing_keys(stored, settings)
        if differing:
            raise SelfspecError(f"resume=true: {records} was written with other settings: {'; '.join(differing)}; rerun "
                                f"with those, or without resume=true to start afresh (the earlier files are kept)")
        drop_torn_tail(records)
        return True
    move_aside(out_dir)
    write_file(out_dir / SETTINGS_FILE, json.dumps(settings, indent=2))
    return False


def differing_keys(stored: dict, current: dict) -> list[str]:
    """`key=stored (now current)` for every dotted key whose value differs, UNCHECKED_KEYS aside."""
    old, new = _flat(stored), _flat(current)
    keys = [key for key in dict.fromkeys([*old, *new]) if old.get(key, "unset") != new.get(key, "unset")
            and key.split(".")[0] not in UNCHECKED_KEYS]
    return [f"{key}={json.dumps(old.get(key, 'unset'))} (now {json.dumps(new.get(key, 'unset'))})" for key in keys]


def _flat(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def move_aside(out_dir: Path) -> list[Path]:
    """Rename the run files in `out_dir`, and the log beside them, to `<stem>-<date>-<time><suffix>` (the time the
    last run wrote its records); returns the new paths. This run's log then starts afresh in selfspec.log."""
    present = [out_dir / name for name in RUN_FILES if (out_dir / name).exists()]
    if not present:
        return []  # a first run: a selfspec.log there is this run's own
    newest = max(path.stat().st_mtime for path in present)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(newest))
    log = out_dir / LOG_FILE
    moved = []
    for path in present + ([log] if log.exists() else []):
        target = path.with_name(f"{path.stem}-{stamp}{path.suffix}")
        number = 1
        while target.exists():
            target, number = path.with_name(f"{path.stem}-{stamp}-{number}{path.suffix}"), number + 1
        path.rename(target)
        moved.append(target)
    _reopen_log(log)
    print(f"kept the earlier run's files in {out_dir}: {', '.join(p.name for p in moved)}")
    return moved


def _reopen_log(path: Path) -> None:
    """Logging's file handlers on `path` (Hydra's, opened before the run began) write to a new file there: the file
    they held was moved aside and would otherwise go on collecting this run's lines."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).resolve() == path.resolve():
            held = handler.setStream(open(path, handler.mode, encoding=handler.encoding))
            if held is not None:  # None: a delayed handler that had not opened its file yet
                held.close()


def drop_torn_tail(path: Path) -> None:
    """Cut a torn last line (see is_torn) off `path` before appending to it, with a warning; a last line that is
    whole JSON but lacks its newline gets one."""
    text = path.read_text()
    if not text or text.endswith("\n"):
        return
    if not is_torn(text):
        append_line(path, "")
        return
    keep = text.rfind("\n") + 1
    warnings.warn(f"{path}: dropped a torn last line ({len(text) - keep} characters of an interrupted write)",
                  SelfspecWarning)
    with open(path, "r+") as f:
        f.truncate(len(text[:keep].encode()))
