"""Groups and samples in flight, and the trajectory server that holds samples not yet routed.

A multi-turn sample (turns > 1) generates its `length` in equal turns; after each turn but the last it leaves
the engine for its environment and comes back as a continuation, so `finish` is the end of its current turn.
"""

from __future__ import annotations

from collections import deque

from rlflow.operators.routing import MLQ


class Group:
    """The S samples of one prompt; admitted with V_traj = `version`, occupied with the min member version."""

    __slots__ = ("gid", "lengths", "min_version", "remaining", "samples", "version")

    def __init__(self, gid: int, version: int, lengths: list[int], prompt: int, turns: int = 1):
        self.gid = gid
        self.version = version  # reserved V_traj (weights of the unit that admitted it); None until reserved (coordinated TS)
        self.lengths = lengths
        self.remaining = len(lengths)
        self.min_version: int | None = None
        self.samples = [Sample(self, i, n, prompt, turns) for i, n in enumerate(lengths)]


class Sample:
    """One trajectory: `length` response tokens after a `prompt`; `version` is set by its first token."""

    __slots__ = (
        "contrib",
        "finish",
        "generated",
        "group",
        "index",
        "join",
        "length",
        "prompt",
        "turn",
        "turns",
        "version",
        "where",
    )

    @property
    def v_traj(self) -> int | None:
        """Oldest version tolerated: its first token's, else its group's reservation, else None (initial)."""
        return self.version if self.version is not None else self.group.version

    @property
    def last_turn(self) -> bool:
        return self.turn >= self.turns - 1

    @property
    def turn_end(self) -> float:
        """Tokens generated when the current turn ends: (turn + 1) / turns of `length` (exactly `length` on the last)."""
        return self.length if self.last_turn else self.length * (self.turn + 1) / self.turns

    def end_turn(self) -> None:
        """The current turn (not the last) is generated; the next one starts after the environment step."""
        self.generated = self.turn_end
        self.turn += 1

    @property
    def gid(self) -> int:
        return self.group.gid

    @property
    def tokens(self) -> float:
        """KV tokens it holds or brings: prompt + generated so far."""
        inst = self.where
        running = inst is not None and getattr(inst, "running", {}).get(id(self)) is self
        return self.prompt + self.generated + (inst.progress - self.join if running else 0.0)

    def __init__(self, group: Group, index: int, length: int, prompt: int, turns: int = 1):
        self.group = group
        self.index = index
        self.length = length
        self.prompt = prompt
        self.generated = 0.0  # tokens generated before the current admission (preemption resumes from here)
        self.version: int | None = None  # weights version that generated the first token
        self.join = 0.0  # engine progress counter when admitted to running
        self.contrib = 0.0  # this sample's constant term in the engine's KV sum
        self.finish = 0.0  # engine progress counter at which it completes
        self.where = None  # the slot or instance generating it (an instance also between turns); None while unrouted or done
        self.turn = 0  # turns generated so far (0-based index of the current turn)
        self.turns = turns


class TrajectoryServer:
    """Samples of admitted groups waiting to be routed, by their group's reserved version."""

    def __init__(self):
        self._by_version: dict[int, deque[Sample]] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def put(self, group: Group) -> None:
        self._by_version.setdefault(group.version, deque()).extend(group.samples)
        self._size += len(group.samples)

    def has(self, max_version: int) -> bool:
        """Is there a sample that weights `max_version` may generate?"""
        return bool(self._size) and min(self._by_version) <= max_version

    def take(self, max_version: int) -> Sample | None:
        """Oldest-version sample that weights `max_version` may generate (V_traj <= weights version)."""
        if not self._size:
            return None
        for version in sorted(self._by_version):
            if version > max_version:
                return None
            queue = self._by_version[version]
            sample = queue.popleft()
            if not queue:
                del self._by_version[version]
            self._size -= 1
            return sample
        return None

    def discard(self, group: Group) -> int:
        """Drop a group's unrouted samples (its group was aborted); returns how many."""
        queue = self._by_version.get(group.version)
        if not queue:
            return 0
        kept = deque(s for s in queue if s.group is not group)
        removed = len(queue) - len(kept)
        if kept:
            self._by_version[group.version] = kept
        else:
            del self._by_version[group.version]
        self._size -= removed
        return removed


class CoordinatedTS:
    """The coordinator's trajectory server: returned / unstarted samples by identity, plus initial groups.

    Waiting samples are kept as StaleFlow's multi-level queue (§5.1): one level per V_traj, arrival order within a
    level, so handing routing the queue needs no sort (a sample's V_traj does not change while it waits here)."""

    def __init__(self):
        self._levels: dict[int, dict[int, Sample]] = {}  # V_traj -> samples of reserved groups not on an instance
        self._level_of: dict[int, int] = {}  # id(sample) -> its level
        self.initial: dict[int, Group] = {}  # groups not yet reserved (no V_traj), by gid

    def __len__(self) -> int:
        return len(self._level_of) + sum(len(g.samples) for g in self.initial.values())

    @property
    def waiting(self) -> list[Sample]:
        """Samples of reserved groups not on an instance, in queue order."""
        return [s for v in sorted(self._levels) for s in self._levels[v].values()]

    def trajs(self) -> MLQ:
        """Every sample waiting, as the multi-level queue routing reads (partial ones by V_traj, initial last)."""
        return MLQ(self.waiting, [s for g in self.initial.values() for s in g.samples])

    def reserved(self, group: Group) -> None:
        """The group's first member was routed: all its members now carry V_traj."""
        self.initial.pop(group.gid, None)
        for s in group.samples:
            self.put(s)

    def put(self, sample: Sample) -> None:
        if id(sample) not in self._level_of:
            v = self._level_of[id(sample)] = sample.v_traj
            self._levels.setdefault(v, {})[id(sample)] = sample

    def take(self, sample: Sample) -> bool:
        """Remove a waiting sample; whether it was here."""
        v = self._level_of.pop(id(sample), None)
        if v is None:
            return False
        level = self._levels[v]
        del level[id(sample)]
        if not level:
            del self._levels[v]
        return True

    def discard(self, group: Group) -> int:
        return sum(self.take(s) for s in group.samples)
