"""Trajectories waiting to be routed: StaleFlow's trajectory server (TS; "StaleFlow", §5.1) for one fleet.

It holds initial groups drawn from the prompts (no V_traj until routing reserves the group with the
staleness policy, Algorithm 2), members of reserved groups not routed yet, and partial trajectories
returned by an Interrupt (they keep their oldest V_traj). Each waits as its Trajectory (stages/trajectory.py), which
the route to an instance carries; the coordinator sees each as a TrajView.
"""

from __future__ import annotations

from rlflow.operators.snapshot import TrajView
from rlflow.stages.trajectory import Trajectory


def traj_id(row: Trajectory) -> str:
    """The id of a routed trajectory."""
    return row.traj_id


def row_tokens(row: Trajectory) -> float:
    """KV tokens a trajectory brings: prompt + generated so far."""
    return float(len(row.prompt_ids) + len(row.completion_ids))


class TrajectoryServer:
    """The TS of one rollout fleet, held by its coordinator (rollout_coordinator.py) in the driver: what waits to be
    routed, by trajectory id. Finished trajectories leave it; their payloads go to the payload store."""

    def __init__(self):
        self.ts: dict[str, tuple[TrajView, Trajectory]] = {}  # tid -> (what the coordinator sees, what to route)
        self.initial: dict[str, list[str]] = {}  # unreserved groups: gid -> member tids
        self.reserved: dict[str, int] = {}  # open group -> reserved V_traj

    def __contains__(self, tid: str) -> bool:
        return tid in self.ts

    def views(self) -> list[TrajView]:
        return [view for view, _ in self.ts.values()]

    def pop(self, tid: str) -> Trajectory:
        return self.ts.pop(tid)[1]

    @property
    def initial_groups(self) -> int:
        return len(self.initial)

    def initial_rows(self) -> list[Trajectory]:
        """The first member of each unreserved group (its prompt), in draw order."""
        return [self.ts[tids[0]][1] for tids in self.initial.values()]

    def add_group(self, gid: str, rows: list[Trajectory]) -> None:
        """An initial group drawn from the prompts: no V_traj until routing reserves it (§5.1)."""
        self.initial[gid] = [traj_id(r) for r in rows]
        for row in rows:
            self.ts[traj_id(row)] = (TrajView(traj_id(row), gid, None, row_tokens(row)), row)

    def queue(self, row: Trajectory) -> None:
        """A reserved group's member back in the TS; a partial one keeps its oldest V_traj."""
        gid = row.group_id
        v_traj = row.version if row.completion_ids else self.reserved[gid]
        self.ts[traj_id(row)] = (TrajView(traj_id(row), gid, v_traj, row_tokens(row)), row)

    def reserve(self, gid: str, version: int) -> None:
        """Routing reserved the group on `version`: its members get that V_traj."""
        self.reserved[gid] = version
        for tid in self.initial.pop(gid):
            view, row = self.ts[tid]
            view.v_traj = row.version = version

    def forget_group(self, gid: str) -> set[str]:
        """The group is done or evicted: its members still here are not needed any more; returns them."""
        self.reserved.pop(gid, None)
        gone = {t for t, (view, _) in self.ts.items() if view.gid == gid}
        for tid in gone:
            del self.ts[tid]
        return gone

    def drop(self, tid: str) -> None:
        """An aborted trajectory waiting here."""
        self.ts.pop(tid, None)
