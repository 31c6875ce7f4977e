"""A full disk as a named stop: what a checkpoint, ledger, MLflow or export write that failed for lack of space becomes.

Writes fail for lack of space in several costumes: an OSError with errno ENOSPC or EDQUOT (Python's own writes, an
injected fault), SQLite's "database or disk is full" (the ledger, MLflow's store), or, from DeepSpeed's torch.save,
"basic_ios::clear: iostream error" with no errno at all. `disk_full` recognises the first two by what they say and
the third by the free space left where the write went; the run then stops with `DiskFull` (exit 3, rule disk-full,
the path and the bytes needed). Checkpoints are published by one rename (checkpoint.py), so the last good one is
what state.json still names: free space and `rlflow run --resume` continues from it.

`check_before_save` warns ahead of a save when the free space is below what the last checkpoint took.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Callable
from pathlib import Path

from rlflow.errors import RunFailed

RULE = "disk-full"
_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_SAID = ("no space left on device", "database or disk is full", "disk quota exceeded")
#: free space below which a write failure that names no cause (torch.save's iostream error) counts as a full disk
LOW_FREE_BYTES = 64 * 2**20


class DiskFull(RunFailed):
    """A write failed for lack of space: `rlflow run` exits 3 with the message (rule, path, bytes needed)."""

    rule = RULE

    def __init__(self, what: str, path: Path, needed: int | None, err: BaseException):
        free = free_bytes(path)
        need = f"about {_size(needed)} needed, " if needed else ""
        super().__init__(
            f"{RULE}: {what} failed at {path}: {need}{_size(free)} free ({type(err).__name__}: {_first_line(err)}). "
            "The last good checkpoint is kept (state.json names it): free space on that filesystem, then "
            "`rlflow run --resume` continues from it")
        self.path, self.needed, self.free = Path(path), needed, free


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem holding `path` (or its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def disk_full(err: BaseException, path: Path) -> bool:
    """Whether `err` (or an exception it wraps: a Ray task error's cause, a `raise ... from`) is a write that failed
    for lack of space at `path`."""
    seen = set()
    stack = [err]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _ERRNOS:
            return True
        text = str(e).lower()
        if any(s in text for s in _SAID):
            return True
        if "iostream error" in text and free_bytes(path) < LOW_FREE_BYTES:
            return True
        stack += [getattr(e, "cause", None), e.__cause__, e.__context__]
    return False


def check_before_save(path: Path, needed: int | None, log: Callable[[str], None]) -> None:
    """Warn when the filesystem at `path` has less free space than `needed` (the last checkpoint's size)."""
    if not needed:
        return
    free = free_bytes(path)
    if free < needed:
        log(f"warning: {path} has {_size(free)} free and the last checkpoint took {_size(needed)}: the next save "
            f"may fail for lack of space ({RULE}); free space there, or lower train.keep_checkpoints")


def tree_bytes(path: Path) -> int:
    """Bytes of the files under `path` (0 if it does not exist)."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file()) if Path(path).exists() else 0


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[-1][:300] if lines else ""
