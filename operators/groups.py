"""Group sampling for executors (StaleFlow §4.3, Figure 8a/b): when is a group done, with which version.

A group of size S may launch S + r members (group-level redundancy). It is done when S members have
finished and been rewarded; its V_traj is the minimum over those S members, and the members still
running are surplus for the caller to abort. Each member keeps its oldest tolerated version, so a
partial rollout that resumes on newer weights does not change it.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from .policy import GroupId, StalenessError

MemberId = Hashable


@dataclass(frozen=True)
class GroupDone:
    """A group ready to occupy: its V_traj and the running members to abort."""

    gid: GroupId
    version: int  # min V_traj over the S members that finished first
    surplus: list[MemberId]


@dataclass
class _Group:
    version: int  # the group's reserved V_traj; no member may be older
    running: dict[MemberId, int] = field(default_factory=dict)  # member -> V_traj
    finished: list[int] = field(default_factory=list)  # V_traj of finished members
    launched: int = 0


class GroupAssembler:
    """Tracks the members of each open group until S of them are done."""

    def __init__(self, group_size: int, redundancy: int = 0):
        if group_size < 1 or redundancy < 0:
            raise StalenessError(f"group_size must be >= 1 and redundancy >= 0, got {group_size}, {redundancy}")
        self.group_size = group_size
        self.redundancy = redundancy  # extra members a group may launch (Figure 8b, group level)
        self._groups: dict[GroupId, _Group] = {}

    def __contains__(self, gid: GroupId) -> bool:
        return gid in self._groups

    def open(self, gid: GroupId, version: int) -> None:
        """Start tracking a group reserved with V_traj = version."""
        if gid in self._groups:
            raise StalenessError(f"group {gid!r} is already open")
        self._groups[gid] = _Group(version)

    def launch(self, gid: GroupId, member: MemberId, version: int) -> None:
        """Member started generating; version is its V_traj (oldest weights it will use)."""
        g = self._group(gid)
        if member in g.running:
            raise StalenessError(f"group {gid!r}: member {member!r} is already running")
        if g.launched >= self.group_size + self.redundancy:
            raise StalenessError(
                f"group {gid!r}: member {member!r} would be launch {g.launched + 1}, over group_size"
                f" {self.group_size} + redundancy {self.redundancy}"
            )
        if version < g.version:
            raise StalenessError(
                f"group {gid!r}: member {member!r} V_traj={version} is older than the group's reserved"
                f" V_traj={g.version}; the staleness manager reserved for {g.version} or newer"
            )
        g.running[member] = version
        g.launched += 1

    def finish(self, gid: GroupId, member: MemberId) -> GroupDone | None:
        """Member finished and was rewarded; returns the group once S members are done, else None."""
        g = self._group(gid)
        if member not in g.running:
            raise StalenessError(f"group {gid!r}: member {member!r} is not running")
        g.finished.append(g.running.pop(member))
        if len(g.finished) < self.group_size:
            return None
        del self._groups[gid]
        return GroupDone(gid, min(g.finished), list(g.running))

    def abort(self, gid: GroupId) -> list[MemberId]:
        """Forget a group (aborted or filtered); returns its running members to abort."""
        g = self._group(gid)
        del self._groups[gid]
        return list(g.running)

    def running(self, gid: GroupId) -> list[MemberId]:
        """Members of an open group still generating."""
        return list(self._group(gid).running)

    def _group(self, gid: GroupId) -> _Group:
        g = self._groups.get(gid)
        if g is None:
            raise StalenessError(f"group {gid!r} is not open (never opened, done, or aborted)")
        return g
