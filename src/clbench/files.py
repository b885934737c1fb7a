"""The run folder's file operations: atomic writes, the up-front check that a folder can be written, and the lock
that keeps a second run out of it.

Free of torch, so the CLI can refuse a bad output folder before anything heavy is imported.
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

from clbench.errors import ConfigError, DataError

LOCK_FILE, PID_FILE = ".clbench.lock", ".clbench.pid"
_HELD: dict[Path, FileLock] = {}  # the run folders this process holds
_USED: set[Path] = set()  # the run folders a run of this process has begun to write (a refusal comes before)


def begin_writing(folder: Path) -> None:
    """Mark ``folder`` as used by this process's run: from here on a failure is the run's, not a refused start."""
    _USED.add(folder.resolve())


def began_writing(folder: Path) -> bool:
    return folder.resolve() in _USED


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_umask()  # what open() would give: lab-mates on a shared filesystem can read the results


@contextmanager
def undone_on_failure(undo: Callable[[], None], no_space: Callable[[str], str]) -> Iterator[None]:
    """Run the block; if it fails, ``undo()`` (remove what it half wrote) and re-raise, a full disk or quota as a
    :class:`DataError` with the message ``no_space(strerror)``."""
    try:
        yield
    except OSError as err:
        undo()
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DataError(no_space(err.strerror or "no space")) from None
        raise
    except BaseException:
        undo()
        raise


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write via a temporary file in the same folder and rename, so readers never see a partial file; the file gets
    the user's umask (``mkstemp`` alone makes it 0600). A full disk is a :class:`DataError` naming the file, and the
    previous version of the file stays as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    no_space = (
        f"No space left to write {path} ({{}}); its previous version is unchanged. Free space or move the run "
        "(hydra.run.dir=PATH), then continue with resume=true."
    ).format
    with undone_on_failure(lambda: Path(tmp).unlink(missing_ok=True), no_space):
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def remove_stale_temporaries(folder: Path) -> None:
    """Delete the temporary files of writes a killed run left behind (``.<name>.*.tmp``); call with the lock held."""
    for tmp in folder.glob(".*.tmp"):
        tmp.unlink(missing_ok=True)


def lock_run_folder(folder: Path) -> bool:
    """Hold ``folder`` for this process (an OS file lock through filelock, released when the process ends, so a killed
    run's folder can be resumed at once). A folder another process holds is refused, naming its PID. Returns False
    when this process already held it."""
    key = folder.resolve()
    if key in _HELD:
        return False
    lock = FileLock(key / LOCK_FILE)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        pid = (key / PID_FILE).read_text().strip() if (key / PID_FILE).is_file() else "unknown"
        raise ConfigError(
            f"The run folder {folder} is in use by another clbench run (PID {pid}). Wait for it to end, or choose "
            "another folder with hydra.run.dir=PATH."
        ) from None
    write_atomic(key / PID_FILE, f"{os.getpid()}\n")
    _HELD[key] = lock
    atexit.register(unlock_run_folder, key)
    return True


def unlock_run_folder(folder: Path, *, keep_pid: bool = False) -> None:
    """Release a folder this process holds, removing its PID file (``keep_pid``: the caller restores the file)."""
    lock = _HELD.pop(folder.resolve(), None)
    if lock is not None:
        if not keep_pid:
            (folder / PID_FILE).unlink(missing_ok=True)
        lock.release()


RESULTS_FILE, CHECKPOINT_FILE = "results.json", "checkpoint.pt"


def existing_run(folder: Path) -> str | None:
    """The run ``folder`` holds, in words ("a finished run", "an interrupted run", ...: its results.json's status),
    or None where it holds neither results.json nor checkpoint.pt. A results.json that cannot be read still counts."""
    results, saved = folder / RESULTS_FILE, folder / CHECKPOINT_FILE
    if not results.is_file():
        return "a run's checkpoint" if saved.is_file() else None
    try:
        status = json.loads(results.read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return "a run (its results.json cannot be read)"
    if status == "running":  # a run killed before it could say otherwise, or one that runs now
        return "a run that did not finish (its results.json says running)"
    return f"{'an' if str(status)[:1] in 'aeiou' else 'a'} {status} run" if isinstance(status, str) else "a run"


def check_new_run(folder: Path, resume: bool | str) -> None:
    """A run is never written over another: a new run (``resume`` false; ``auto`` without a checkpoint to resume) is
    refused in a folder that holds a run's results or checkpoint (``auto``: a finished run's results), before
    anything is written."""
    held = existing_run(folder)
    if held is None or resume is True or (resume == "auto" and (folder / CHECKPOINT_FILE).is_file()):
        return
    if resume == "auto" and held != "a finished run":
        return  # an unfinished run without a checkpoint: resume=auto starts it afresh
    action = (
        "run it again in another folder"
        if held == "a finished run"
        else "continue it with resume=true"
        if (folder / CHECKPOINT_FILE).is_file()
        else "start it afresh there with resume=auto"
    )
    raise ConfigError(
        f"The folder {folder} holds {held} already, and a new run is never written over one: {action}, or choose "
        "another folder with hydra.run.dir=PATH. The folder is left as it was."
    )


RUN_FOLDER_HINT = "Choose another with hydra.run.dir=PATH (hydra.sweep.dir=PATH for -m), or free space there."


def check_writable(folder: Path, hint: str = RUN_FOLDER_HINT) -> None:
    """Refuse an output folder that cannot be written (a file in the way, no permission, a full disk) before any
    work starts; creates it otherwise. ``hint``: how to choose another."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(folder / ".clbench_write_test", b"")
        (folder / ".clbench_write_test").unlink()
    except OSError as err:
        raise ConfigError(
            f"Cannot write in the output folder {folder} ({type(err).__name__}: {err.strerror or err}). {hint}"
        ) from None
