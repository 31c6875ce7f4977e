"""The simpler staleness policies: a queue of completed groups between reward and train.

unbounded (Laminar), one_step (verl one-step-off-policy), in_flight_limit (AReaL / VeRL-async),
queue_drop and queue_max (docs/concepts/staleness.md). Where admission alone does not bound staleness
(out-of-order completion, older V_traj), groups that would exceed eta are evicted as dropped.
"""

from __future__ import annotations

from itertools import islice

from .policy import Batch, Entry, GroupId, InvariantViolation, StalenessError, StalenessPolicy, staleness


class FifoQueue:
    """Completed groups in arrival order; oldest = first to arrive (queue-drop evicts by position)."""

    def __init__(self):
        self._items: dict[GroupId, Entry] = {}

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, gid: GroupId) -> bool:
        return gid in self._items

    def add(self, e: Entry) -> None:
        self._items[e.gid] = e

    def remove(self, gid: GroupId) -> Entry | None:
        return self._items.pop(gid, None)

    def take(self, n: int) -> list[Entry]:
        return _take_first(self._items, n)

    def evict_older_than(self, version: int) -> list[Entry]:
        old = [e for e in self._items.values() if e.version < version]
        for e in old:
            del self._items[e.gid]
        return old


class VersionQueue:
    """Completed groups ordered by V_traj, then arrival; oldest = smallest V_traj (trains the stalest first)."""

    def __init__(self):
        self._buckets: dict[int, dict[GroupId, Entry]] = {}
        self._version_of: dict[GroupId, int] = {}

    def __len__(self) -> int:
        return len(self._version_of)

    def __contains__(self, gid: GroupId) -> bool:
        return gid in self._version_of

    def add(self, e: Entry) -> None:
        self._buckets.setdefault(e.version, {})[e.gid] = e
        self._version_of[e.gid] = e.version

    def remove(self, gid: GroupId) -> Entry | None:
        v = self._version_of.pop(gid, None)
        if v is None:
            return None
        bucket = self._buckets[v]
        e = bucket.pop(gid)
        if not bucket:
            del self._buckets[v]
        return e

    def take(self, n: int) -> list[Entry]:
        out: list[Entry] = []
        for v in sorted(self._buckets):
            bucket = self._buckets[v]
            if len(bucket) > n - len(out):
                out += _take_first(bucket, n - len(out))
                break
            out += self._buckets.pop(v).values()
        version_of = self._version_of
        for e in out:
            del version_of[e.gid]
        return out

    def evict_older_than(self, version: int) -> list[Entry]:
        old: list[Entry] = []
        for v in [v for v in self._buckets if v < version]:
            old += self._buckets.pop(v).values()
        for e in old:
            del self._version_of[e.gid]
        return old


def _take_first(items: dict[GroupId, Entry], n: int) -> list[Entry]:
    """Remove and return the n earliest-inserted entries of a dict."""
    pop = items.pop
    return [pop(gid) for gid in list(islice(items, n))]


class QueuePolicy(StalenessPolicy):
    """Shared tracker: reserved ids, a queue of completed groups, eviction beyond eta; subclasses set admission."""

    queue_type: type = VersionQueue

    def __init__(self, batch_size: int, eta: int | None, capacity: int | None = None):
        super().__init__(batch_size, eta)
        if capacity is not None and capacity < batch_size:
            raise StalenessError(f"{self.name}: capacity {capacity} < batch_size {batch_size}: no batch would ever fit")
        self.capacity = capacity  # completed groups the queue holds; the oldest is dropped beyond it
        self._reserved: dict[GroupId, int] = {}
        self._queue = self.queue_type()
        # The most completed groups ever queued at once, counted after an add and before the overflow drop. A run
        # whose peak_queued never exceeded its capacity would run identically with any capacity >= peak_queued:
        # capacity acts only through that drop (rlflow tune reuses such runs instead of simulating them again).
        self.peak_queued = 0

    def _admits(self) -> bool:
        """Room for one more group under the policy's admission rule (beyond the version checks)."""
        return True

    def _too_stale(self, v_traj: int) -> bool:
        """True if a group with this V_traj can no longer be trained within eta at the current version."""
        return self.eta is not None and staleness(self.version, v_traj) > self.eta

    def verify(self, version: int) -> bool:
        return 0 <= version <= self.version and not self._too_stale(version) and self._admits()

    def reserve(self, gid: GroupId, version: int) -> None:
        if gid in self._reserved or gid in self._queue:
            raise StalenessError(f"{self.name}: reserve({gid!r}): group is already tracked; ids are reserved once")
        if not 0 <= version <= self.version:
            raise StalenessError(
                f"{self.name}: reserve({gid!r}, V_traj={version}): not a published version (trainer is at {self.version})"
            )
        if self._too_stale(version):
            raise StalenessError(
                f"{self.name}: reserve({gid!r}, V_traj={version}): staleness {staleness(self.version, version)}"
                f" already exceeds eta={self.eta}"
            )
        if not self._admits():
            raise StalenessError(f"{self.name}: reserve({gid!r}): {self._full_reason()}; verify() first")
        self._reserved[gid] = version
        self.counters.admitted += 1
        self.counters.in_flight += 1

    def occupy(self, gid: GroupId, version: int | None = None) -> list[Entry]:
        v_res = self._reserved_version(gid, "occupy")
        v_traj = v_res if version is None else version
        if not v_res <= v_traj <= self.version:
            raise StalenessError(
                f"{self.name}: occupy({gid!r}, V_traj={v_traj}): must lie in reserved V_traj={v_res}"
                f" .. trainer version {self.version} (a member never starts on weights older than the reservation)"
            )
        del self._reserved[gid]
        self.counters.in_flight -= 1
        entry = Entry(gid, v_traj)
        if self._too_stale(v_traj):
            self.counters.dropped += 1
            return [entry]
        self._queue.add(entry)
        self.counters.pending += 1
        self.peak_queued = max(self.peak_queued, len(self._queue))
        overflow = 0 if self.capacity is None else max(0, len(self._queue) - self.capacity)
        evicted = self._queue.take(overflow)
        self._count_dropped(evicted)
        return evicted

    def abort(self, gid: GroupId) -> list[Entry]:
        self._reserved_version(gid, "abort")  # raises on an unknown or occupied id
        del self._reserved[gid]
        self.counters.in_flight -= 1
        self.counters.aborted += 1
        return []

    def filter(self, gid: GroupId) -> list[Entry]:
        if gid in self._reserved:
            del self._reserved[gid]
            self.counters.in_flight -= 1
        elif self._queue.remove(gid) is not None:
            self.counters.pending -= 1
        else:
            raise StalenessError(f"{self.name}: filter({gid!r}): unknown group (never reserved, or already gone)")
        self.counters.filtered += 1
        return []

    def ready(self) -> bool:
        return len(self._queue) >= self.batch_size

    def consume(self) -> Batch:
        if not self.ready():
            raise StalenessError(
                f"{self.name}: consume(): {len(self._queue)}/{self.batch_size} completed groups queued; not ready"
            )
        entries = self._queue.take(self.batch_size)
        versions = [e.version for e in entries]
        if staleness(self.version, max(versions)) < 0 or self._too_stale(min(versions)):
            raise InvariantViolation(f"{self.name}: V_traj {min(versions)}..{max(versions)} at version {self.version}")
        self.counters.pending -= len(entries)
        self.counters.consumed += len(entries)
        self.version += 1
        dropped = self._queue.evict_older_than(self.version - self.eta) if self.eta is not None else []
        self._count_dropped(dropped)
        return Batch(self.version - 1, entries, dropped)

    def _reserved_version(self, gid: GroupId, op: str) -> int:
        if gid in self._reserved:
            return self._reserved[gid]
        if gid in self._queue:
            raise StalenessError(f"{self.name}: {op}({gid!r}): already occupied (use filter() to drop it)")
        raise StalenessError(f"{self.name}: {op}({gid!r}): unknown group (never reserved, or already gone)")

    def _count_dropped(self, entries: list[Entry]) -> None:
        self.counters.pending -= len(entries)
        self.counters.dropped += len(entries)

    def _full_reason(self) -> str:
        return "admission closed"


class Unbounded(QueuePolicy):
    """Inherent staleness (Laminar): admit anything, train completed groups first come first served."""

    name = "unbounded"
    queue_type = FifoQueue

    def __init__(self, batch_size: int):
        super().__init__(batch_size, eta=None)


class InFlightLimit(QueuePolicy):
    """At most (eta + 1) * B groups admitted and not yet consumed (AReaL, VeRL-async); stalest trained first."""

    name = "in_flight_limit"

    def __init__(self, batch_size: int, eta: int):
        if eta is None:
            raise StalenessError(f"{self.name} needs eta: the limit is (eta + 1) * batch_size groups")
        super().__init__(batch_size, eta)
        self.limit = (eta + 1) * batch_size

    def _admits(self) -> bool:
        return self.counters.in_flight + self.counters.pending < self.limit

    def _full_reason(self) -> str:
        held = self.counters.in_flight + self.counters.pending
        return f"{held} groups in flight or queued = limit (eta+1)*B = {self.limit}"


class OneStep(InFlightLimit):
    """One-step off-policy (verl): the in-flight limit with eta = 1."""

    name = "one_step"

    def __init__(self, batch_size: int):
        super().__init__(batch_size, eta=1)


class QueueDrop(QueuePolicy):
    """Queue of Q completed groups; a new group to a full queue drops the oldest; train on the oldest (FIFO)."""

    name = "queue_drop"
    queue_type = FifoQueue

    def __init__(self, batch_size: int, capacity: int, eta: int | None = None):
        if capacity is None:
            raise StalenessError(f"{self.name} needs a capacity Q (completed groups held)")
        super().__init__(batch_size, eta, capacity)


class QueueMax(QueuePolicy):
    """Drop groups above max staleness eta; train the stalest first; optional capacity drops the stalest."""

    name = "queue_max"

    def __init__(self, batch_size: int, eta: int, capacity: int | None = None):
        if eta is None:
            raise StalenessError(f"{self.name} needs eta, the maximum staleness kept")
        super().__init__(batch_size, eta, capacity)
