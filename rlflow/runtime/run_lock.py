"""One owner per run: an exclusive lock on the run directory for the life of a run or resume, and a lock that
serialises the creation of a shared store (MLflow's sqlite file) between runs starting side by side.

The lock is `flock` on a file in the directory (`run.lock`), taken without waiting: a second `rlflow run` of the
same run is refused at once (PipelineInvalid, rule run-in-use, exit 2) naming the process and host that hold it.
The kernel (or NFS's lock manager) drops a flock when its holder dies however it dies (kill -9 included), so a
dead holder's lock is taken over by the next run; the holder's pid, host, start time and command written in the
file only inform: a clean release empties it, so a file still naming a holder when the lock is free is a holder
that died, and the taker-over says so. The file is never deleted: deleting a lock file lets two processes lock
two different inodes under one name.

Where flock is not supported (ENOLCK: NFS mounted without a lock manager), nothing can tell a live holder from a
dead one across hosts, and a pid-file protocol cannot take over a dead holder's file without a race that lets
two runs in, so the run is refused (rule run-lock-unsupported) rather than run unowned; RLFLOW_RUN_LOCK=off runs
it unlocked, said out loud, for the user who knows nothing else uses that directory.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

from rlflow.errors import PipelineInvalid, Problem, RunFailed

LOCK_FILE = "run.lock"
UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
OFF = "RLFLOW_RUN_LOCK"  # =off: run without the lock (where the filesystem has none)
READ_RETRY_S = 1.0  # a holder writes its details just after it locks; a refusal waits this long to read them


def _me() -> dict:
    now = time.time()
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": now,
            "started_utc": datetime.fromtimestamp(now, UTC).isoformat(timespec="seconds"),
            "command": " ".join(["rlflow", *sys.argv[1:]]) if sys.argv and "rlflow" in sys.argv[0]
            else " ".join(sys.argv) or "python"}


def _read(path: Path) -> dict | None:
    try:
        text = path.read_text()
        return json.loads(text) if text.strip() else None
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _describe(holder: dict | None, path: Path) -> str:
    if not holder:
        return f"another process (it has not written its details in {path}; `fuser {path}` names it)"
    ago = time.time() - float(holder.get("started", time.time()))
    said = (f"process {holder.get('pid')} on host {holder.get('host')} (`{holder.get('command')}`, started "
            f"{holder.get('started_utc')}, {ago / 60:.0f} min ago)")
    if holder.get("host") == socket.gethostname() and not _alive(int(holder.get("pid", 0))):
        said += (f"; that process has ended, so a process it started still has the lock file open: `fuser {path}` "
                 "names it")
    return said


def _unsupported(path: Path, err: OSError, source: str) -> PipelineInvalid:
    return PipelineInvalid(source, [Problem(
        ("run directory",), f"the filesystem of {path.parent} does not support file locks ({err.strerror}), so "
        "nothing can stop a second rlflow run from training into the same run", "run-lock-unsupported",
        "run from a directory on a local disk (or NFS with a lock manager), or set RLFLOW_RUN_LOCK=off if you are "
        "sure nothing else runs in it")])


class RunLock:
    """The held lock of one run directory; `release()` (or leaving the `with`) gives it up."""

    def __init__(self, path: Path, fd: int | None):
        self.path, self.fd = path, fd

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)  # empty: released cleanly (a file still naming a holder means one that died)
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def acquire(run_dir: Path, *, source: str = "rlflow run", log=print) -> RunLock:
    """Own `run_dir` for this process, or PipelineInvalid (exit 2, rule run-in-use) naming the holder."""
    path = Path(run_dir) / LOCK_FILE
    if os.environ.get(OFF, "").lower() == "off":
        log(f"{OFF}=off: run directory {run_dir} not locked; nothing stops a second run of it")
        return RunLock(path, None)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            if err.errno in UNSUPPORTED:
                raise _unsupported(path, err, source) from None
            raise
        raise _in_use(run_dir, source, "and then resume it; to train alongside it, start a new run (rlflow run "
                      "without --resume)") from None
    dead = _read(path)
    if dead:
        log(f"taking over run directory {run_dir}: its last owner, process {dead.get('pid')} on host "
            f"{dead.get('host')} (started {dead.get('started_utc')}), ended without releasing it")
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(_me()).encode(), 0)
    os.fsync(fd)
    return RunLock(path, fd)


def _in_use(run_dir: Path, source: str, then: str) -> PipelineInvalid:
    path = Path(run_dir) / LOCK_FILE
    deadline, holder = time.monotonic() + READ_RETRY_S, _read(path)
    while holder is None and time.monotonic() < deadline:
        time.sleep(0.05)
        holder = _read(path)
    pid = holder.get("pid") if holder else None
    return PipelineInvalid(source, [Problem(
        ("run directory",), f"run {Path(run_dir).name} ({run_dir}) is in use by {_describe(holder, path)}",
        "run-in-use", "wait for that run to end, or stop it"
        + (f" (Ctrl-C there, or `kill -TERM {pid}`, saves a checkpoint)" if pid else "") + f" {then}")])


def refuse_if_held(run_dir: Path, *, source: str, then: str) -> None:
    """For a command that would write into a run's directory: PipelineInvalid (run-in-use) while a run holds it."""
    if holder(run_dir) is not None:
        raise _in_use(run_dir, source, then)


def holder(run_dir: Path) -> dict | None:
    """Who holds `run_dir`'s lock now (its details), or None when no live process does."""
    path = Path(run_dir) / LOCK_FILE
    if not path.is_file():
        return None
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return _read(path) or {}
        return None  # no locks on this filesystem: nobody can be said to hold it
    finally:
        os.close(fd)  # closing drops the probe's shared lock
    return None


@contextmanager
def serialised(path: Path, *, what: str, timeout_s: float = 120.0):
    """Hold an exclusive lock on `path` (created beside what it guards) while the block runs, waiting at most
    `timeout_s` for another process that holds it; RunFailed naming `what` after that."""
    path = Path(path)
    if os.environ.get(OFF, "").lower() == "off":
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as err:
                if err.errno in UNSUPPORTED:
                    raise _unsupported(path, err, "rlflow run") from None
                if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
            if time.monotonic() > deadline:
                raise RunFailed(f"waited {timeout_s:g} s for another process to finish {what} (it holds {path}: "
                                f"`fuser {path}` names it); run again when it has, or remove the lock's holder")
            time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
