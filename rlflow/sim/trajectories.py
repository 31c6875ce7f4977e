"""Groups and samples in flight, and the trajectory server that holds samples not yet routed.

A multi-turn sample (turns > 1) generates its `length` in equal turns; after each turn but the last it leaves
the engine for its environment and comes back as a continuation, so `finish` is the end of its current turn.
"""

from __future__ import annotations

from collections import deque
from itertools import chain

from rlflow.operators.routing import MLQ


class Group:
    """The S samples of one prompt; admitted with V_traj = `version`, occupied with the min member version."""

    __slots__ = ("gid", "lengths", "min_version", "remaining", "samples", "stage", "version")

    def __init__(self, gid: int, version: int, lengths: list[int], prompt: int, turns: int = 1, stage: int = 0):
        self.gid = gid
        self.stage = stage  # index of the rollout stage that generates it (0: the first); its samples run on that fleet
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
        "predicted",
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
        self.predicted = float(length)  # the length ranker's prediction (skew-aware dispatch); set by the fleet


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
        self.initial: dict[int, Group] = {}  # groups not yet reserved (no V_traj), by gid; add with add_initial
        self._queue: MLQ | None = None  # trajs() as last built; None once anything here changed
        self._lanes: dict = {}  # member -> its own levels (V_traj -> samples), see partition

    def partition(self, members) -> None:
        """Queue the samples each of `members` keeps apart as well (skew-aware dispatch's lanes), so routing a lane
        does not pass over the other lane's samples; trajs() hands them over as its `parts`. A member must not change
        its answer for a sample while the sample waits here (dispatch marks only unreserved prompts)."""
        self._lanes = {m: {} for m in members}
        for s in self.waiting:
            self._put_lanes(s, self._level_of[id(s)])
        self._queue = None

    def __len__(self) -> int:
        return len(self._level_of) + sum(len(g.samples) for g in self.initial.values())

    @property
    def waiting(self) -> list[Sample]:
        """Samples of reserved groups not on an instance, in queue order."""
        return _flat(self._levels)

    def trajs(self) -> MLQ:
        """Every sample waiting, as the multi-level queue routing reads (partial ones by V_traj, initial last).

        Built again only after a change: in most coordinator cycles nothing arrived or left (streamrl.yaml at 64 GPUs:
        two cycles in three), and the queue can hold 10^4 samples. Routing and sync only read it."""
        if self._queue is None:
            initial = [s for g in self.initial.values() for s in g.samples]
            parts = {m: _flat(levels) for m, levels in self._lanes.items()}
            self._queue = MLQ(self.waiting, initial, parts)
        return self._queue

    def add_initial(self, group: Group) -> None:
        self.initial[group.gid] = group
        self._queue = None

    def order_initial(self, groups: list[Group]) -> None:
        """Queue the initial groups in this order (skew-aware dispatch's LPT order: `groups` are all of them)."""
        self.initial = {g.gid: g for g in groups}
        self._queue = None

    def reserved(self, group: Group) -> None:
        """The group's first member was routed: all its members now carry V_traj."""
        self.initial.pop(group.gid, None)
        self._queue = None
        for s in group.samples:
            self.put(s)

    def put(self, sample: Sample) -> None:
        if id(sample) not in self._level_of:
            v = self._level_of[id(sample)] = sample.v_traj
            self._levels.setdefault(v, {})[id(sample)] = sample
            self._put_lanes(sample, v)
            self._queue = None

    def _put_lanes(self, sample: Sample, v: int) -> None:
        for member, levels in self._lanes.items():
            if member(sample):
                levels.setdefault(v, {})[id(sample)] = sample

    def take(self, sample: Sample) -> bool:
        """Remove a waiting sample; whether it was here."""
        v = self._level_of.pop(id(sample), None)
        if v is None:
            return False
        self._queue = None
        for levels in (self._levels, *self._lanes.values()):
            level = levels.get(v)
            if level is not None and level.pop(id(sample), None) is not None and not level:
                del levels[v]
        return True

    def discard(self, group: Group) -> int:
        return sum(self.take(s) for s in group.samples)


def _flat(levels: dict[int, dict[int, Sample]]) -> list[Sample]:
    """A multi-level queue's samples in queue order: ascending level, arrival order within one."""
    return list(chain.from_iterable(levels[v].values() for v in sorted(levels)))
