"""Files and folders written whole or not at all, and checked before they are read: the GGUF conversions, trained
parts, the training data and the files W&B logs.

A file is written into a temporary `.<name>.tmp-XXXX` beside it, flushed to disk and renamed over it; then its sha256
goes into `<name>.sha256` beside it (sha256sum's format: `sha256sum -c` checks it). A folder is built in a temporary
`.<name>.tmp-XXXX` beside it, `checksums.sha256` (every file's sha256) written last, and renamed into place, one
process at a time (a file lock beside it): a second process converting the same model waits, then reads the first's.
A writer holds a lock on its temporary entry while it writes (fcntl.flock), so one whose lock is free was left by a
killed process: the next writer in that folder removes it. A reader checks a file's sha256 (a folder's, every file's)
before loading it: a damaged one (truncated, changed, without its checksum) is made again after one warning line.
"""

import fcntl
import hashlib
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import torch
from filelock import FileLock, Timeout

from selfspec.errors import SelfspecError, SelfspecWarning

SUMS = "checksums.sha256"  # a folder's checksums, its last file written
LEFTOVER = ".*.tmp-*"


def file_sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def locked_temporary(path: Path, folder: bool = False) -> tuple[Path, int]:
    """(a new temporary file or folder beside `path`, the descriptor that holds its lock): the lock says its writer
    is alive. Taken again should `remove_leftovers` have removed it between its making and its locking."""
    while True:
        if folder:
            temporary = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
        else:
            made, name = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
            os.close(made)
            temporary = Path(name)
        try:
            descriptor = os.open(temporary, os.O_RDONLY)
        except FileNotFoundError:
            continue
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        if temporary.exists() and temporary.stat().st_ino == os.fstat(descriptor).st_ino:
            return temporary, descriptor
        os.close(descriptor)


def remove(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
    else:
        entry.unlink(missing_ok=True)


def remove_leftovers(folder: Path) -> None:
    """Remove the temporary entries in `folder` that killed writers left (those whose lock no process holds)."""
    for entry in folder.glob(LEFTOVER):
        try:
            descriptor = os.open(entry, os.O_RDONLY)
        except OSError:  # gone meanwhile
            continue
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            remove(entry)
        except BlockingIOError:  # its writer is alive
            pass
        finally:
            os.close(descriptor)


def replace(path: Path, write: Callable[[BinaryIO], None], before_rename: Callable[[], None] = lambda: None) -> str:
    """Write `path` whole or not at all: `write(handle)` into a locked temporary file beside it, flushed to disk,
    renamed over `path` (after `before_rename()`). Returns its sha256. A failure leaves the earlier file as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(path.parent)
    temporary, descriptor = locked_temporary(path)
    try:
        with open(temporary, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        digest = file_sha256(temporary)
        before_rename()
        os.replace(temporary, path)
        return digest
    finally:
        temporary.unlink(missing_ok=True)
        os.close(descriptor)


def sums_file(path: Path) -> Path:
    return path.with_name(f"{path.name}.sha256")


def write_checked(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """`replace`, then its sha256 beside it (`<name>.sha256`). The old checksum goes just before the rename: a
    process killed in between leaves a file without one, never one with a wrong one."""
    digest = replace(path, write, before_rename=lambda: sums_file(path).unlink(missing_ok=True))
    replace(sums_file(path), lambda handle: handle.write(f"{digest}  {path.name}\n".encode()))


def save_checked(obj, path: Path) -> None:
    """torch.save `obj` to `path` by `write_checked`."""
    write_checked(Path(path), lambda handle: torch.save(obj, handle))


def read_sums(file: Path) -> dict[str, str]:
    """name -> sha256 of a checksums file (`<sha256>  <name>` per line)."""
    return {name: digest for digest, name in (line.split("  ", 1) for line in file.read_text().splitlines())}


def mismatch(folder: Path, sums: dict[str, str]) -> str | None:
    """Why the files `sums` names in `folder` are not as written (a file missing, its sha256 another), or None."""
    for name, digest in sums.items():
        file = folder / name
        if not file.is_file():
            return f"{name} is missing"
        if file_sha256(file) != digest:
            return f"{name} ({file.stat().st_size} bytes) does not match its sha256"
    return None


def file_damage(path: Path) -> str | None:
    """Why the file at `path` is not as `write_checked` wrote it, or None when it is."""
    if not sums_file(path).is_file():
        return f"{sums_file(path).name} is missing"
    return mismatch(path.parent, read_sums(sums_file(path)))


def load_checked(path: Path, what: str):
    """torch.load of a cache file written by `save_checked`; None where there is none, or (after one warning line)
    where it is damaged, so that the caller makes it again. `what`: what the file holds, for the warning."""
    path = Path(path)
    if not path.exists():
        return None
    if (problem := file_damage(path)) is not None:
        warnings.warn(f"{what} {path} is damaged ({problem}); making it again", SelfspecWarning, stacklevel=2)
        return None
    return torch.load(path, map_location="cpu", weights_only=True)


def refuse_damaged(path: Path, named: str, way_out: str) -> None:
    """Refuse in one line (`named`: how the file was given; `way_out`) a file that has its sha256 beside it and does
    not match it. A file without one (copied alone) passes."""
    if sums_file(path).is_file() and (problem := file_damage(path)) is not None:
        raise SelfspecError(f"{named} is damaged ({problem}); {way_out}")


def folder_damage(folder: Path) -> str | None:
    """Why `folder` is not as `cached_folder` built it, or None when it is."""
    if not (folder / SUMS).is_file():
        return f"{SUMS} is missing"
    return mismatch(folder, read_sums(folder / SUMS))


def write_sums(folder: Path) -> None:
    """Write `folder`'s checksums file, its last: the sha256 of every file in it."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != SUMS)
    text = "".join(f"{file_sha256(p)}  {p.relative_to(folder).as_posix()}\n" for p in files)
    replace(folder / SUMS, lambda handle: handle.write(text.encode()))


def cached_folder(target: Path, build: Callable[[Path], Path], what: str) -> Path:
    """The folder `target`, built on first use by `build(staging)` (which returns the finished folder inside the
    temporary folder `staging`) and made again where it is damaged. One process builds it at a time; another that
    finds it missing waits for that one and reads what it built. `what`: what the folder holds, for the lines."""
    if target.is_dir() and folder_damage(target) is None:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(target.parent / f".{target.name}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"selfspec: waiting for another process making {what} in {target}", file=sys.stderr)
        lock.acquire()
    try:
        problem = folder_damage(target) if target.exists() else None
        if target.exists() and problem is None:  # made by the process this one waited for
            return target
        if problem is not None:
            warnings.warn(f"{what} in {target} is damaged ({problem}); making it again", SelfspecWarning,
                          stacklevel=2)
        remove_leftovers(target.parent)
        staging, descriptor = locked_temporary(target, folder=True)
        try:
            built = build(staging)
            write_sums(built)
            if target.exists():
                target.rename(staging / "damaged")
            built.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            os.close(descriptor)
    finally:
        lock.release()
    return target
