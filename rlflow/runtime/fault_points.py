"""Named points inside a checkpoint's save where a test may kill the writer (fault injection, not random).

`RLFLOW_FAULT_AT=<point>` (or `<point>@<step>`: only in the save of that step) makes the process `os._exit(FAULT_EXIT)`
the moment it reaches that point: no handler, no flush, no cleanup, as under kill -9. `RLFLOW_FAULT_AT=enospc:<point>`
(`@<step>` as well) instead makes the write there fail as on a full disk: OSError ENOSPC. Unset, a point costs one
dictionary lookup. tests/unit/runtime/test_checkpoint_faults.py kills a save at each point in turn (and fills the
disk at each) and resumes.
"""

from __future__ import annotations

import errno
import os

ENV = "RLFLOW_FAULT_AT"
FAULT_EXIT = 87  # the exit status of a process killed at a fault point (tests tell it from a crash)

#: in the order a save reaches them (checkpoint.save; the first inside stages/trainer.py save_checkpoint)
POINTS = (
    "trainer_file",  # DeepSpeed wrote the first file of the tag: the tag is half written
    "trainer_saved",  # DeepSpeed wrote the whole tag; no run state yet
    "state_written",  # the run state is in the tag; no manifest yet
    "manifest_written",  # the tag is complete (manifest with sizes and checksums); state.json still names the previous
    "pointer_staged",  # state.json.tmp names the new tag; not yet renamed over state.json
    "published",  # state.json names the new tag (the rename is done); the driver has not told the ledger yet
)


def reach(point: str, step: int) -> None:
    """Exit at once if RLFLOW_FAULT_AT names `point` (and `step`, when it names one)."""
    want = os.environ.get(ENV)
    if not want:
        return
    name, _, at = want.partition("@")
    kind, _, name = name.rpartition(":")
    if name not in POINTS or kind not in ("", "enospc"):
        raise ValueError(f"{ENV}={want!r}: unknown fault point {name!r}; the points are {', '.join(POINTS)}, each "
                         "alone (the process exits) or as enospc:<point> (the write fails as on a full disk)")
    if name == point and (not at or int(at) == step):
        if kind == "enospc":
            raise OSError(errno.ENOSPC, f"No space left on device (injected at {point}, {ENV})")
        os._exit(FAULT_EXIT)
