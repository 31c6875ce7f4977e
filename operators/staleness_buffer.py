"""StaleFlow's staleness manager: virtual staleness buffers with Reserve / Occupy / Consume (StaleFlow §4.2-4.3).

Buffer V_buf trains when the model goes from V_buf to V_buf + 1; an entry (a group id and its V_traj) may
sit in it only if V_traj + eta >= V_buf. Live buffers are V_buf = version .. version + eta: consumed ones
are gone, and no admissible V_traj (<= version) reaches further. Each buffer keeps its occupied entries and
its reserved ones bucketed by V_traj (at most eta + 1 keys): verify and reserve stop at the first buffer with
space, at most one past the buffers that exist (never more than the groups in flight, however large eta is);
a move walks the existing buffers, O(eta^2) at most, and entries only move one way (reserved later, occupied
earlier), so occupy, abort and filter are amortized O(eta^3); consume is O(B), it hands over the batch.
"""

from __future__ import annotations

import math

from .policy import Batch, Entry, GroupId, InvariantViolation, StalenessError, StalenessPolicy, staleness


def auto_redundancy(batch_size: int, drop_rate: float) -> int:
    """batch_redundancy auto for a group filter dropping `drop_rate` of scored groups: B p / (1 - p) extra groups, so
    a barrier's batch fills in about one round of generation; at most 2 B (from p = 2/3 on). The runtime's buffer
    applies it to the rate it observes (rlflow/runtime/buffer.py), the simulator to a measured one (sim/from_plan.py)."""
    if drop_rate >= 2 / 3:
        return 2 * batch_size
    return math.ceil(batch_size * drop_rate / (1.0 - drop_rate) - 1e-9)

WAITING, READY, STUCK = "waiting", "ready", "stuck"


class _Buffer:
    """One virtual staleness buffer: occupied entries in arrival order, reserved ids by V_traj."""

    __slots__ = ("version", "occupied", "reserved", "n_reserved")

    def __init__(self, version: int):
        self.version = version
        self.occupied: dict[GroupId, Entry] = {}
        self.reserved: dict[int, dict[GroupId, None]] = {}
        self.n_reserved = 0

    def add_reserved(self, gid: GroupId, v: int) -> None:
        self.reserved.setdefault(v, {})[gid] = None
        self.n_reserved += 1

    def remove_reserved(self, gid: GroupId, v: int) -> None:
        bucket = self.reserved[v]
        del bucket[gid]
        if not bucket:
            del self.reserved[v]
        self.n_reserved -= 1

    def movable(self, min_version: int) -> tuple[GroupId, int] | None:
        """The reserved entry to move out: the oldest V_traj >= min_version.

        §4.2 does not say which entry of a buffer moves; the oldest eligible one leaves newer, more
        movable entries early, where a later deletion can still push them out.
        """
        v = min((v for v in self.reserved if v >= min_version), default=None)
        return None if v is None else (next(iter(self.reserved[v])), v)


class StaleFlowManager(StalenessPolicy):
    """Worst-case Reserve, greedy Occupy, entry movement, redundancy and filtering under bound eta."""

    name = "staleflow"

    def __init__(self, batch_size: int, eta: int, batch_redundancy: int = 0):
        if eta is None:
            raise StalenessError("staleflow needs a staleness bound eta (0 is on-policy)")
        if batch_redundancy < 0:
            raise StalenessError(f"batch_redundancy must be >= 0, got {batch_redundancy}")
        super().__init__(batch_size, eta)
        self.batch_redundancy = batch_redundancy
        self.capacity = batch_size + batch_redundancy  # entries per buffer (Figure 8b: batch-level redundancy)
        self._buffers: dict[int, _Buffer] = {}
        self._where: dict[GroupId, tuple[int, int, bool]] = {}  # gid -> (V_buf, V_traj, occupied)

    def set_batch_redundancy(self, batch_redundancy: int) -> None:
        """Batch redundancy from now on (the runtime's `auto`, rlflow/runtime/buffer.py): B + r entries per buffer.
        Never below the entries a live buffer holds: a reserved group must find its place when it occupies; the
        capacity comes down to B + r as those entries are trained, filtered or aborted (the next call)."""
        if batch_redundancy < 0:
            raise StalenessError(f"batch_redundancy must be >= 0, got {batch_redundancy}")
        held = max((len(b.occupied) + b.n_reserved for b in self._buffers.values()), default=0)
        self.batch_redundancy = batch_redundancy
        self.capacity = max(self.batch_size + batch_redundancy, held)

    # -- buffers -------------------------------------------------------------------------------
    def _buffer(self, v_buf: int) -> _Buffer:
        buf = self._buffers.get(v_buf)
        if buf is None:
            buf = self._buffers[v_buf] = _Buffer(v_buf)
        return buf

    def _live(self, lo: int, hi: int) -> list[int]:
        """The versions of the buffers that exist in lo..hi, in order: scans walk these, never the range itself,
        whose length is eta (a bound of 10^26 would spin the driver)."""
        return sorted(v for v in self._buffers if lo <= v <= hi)

    def _has_space(self, v_buf: int) -> bool:
        """An empty entry that Reserve or Occupy may take.

        With batch redundancy a buffer is Ready at B occupied (its surplus aborted, §4.3) and takes nothing more.
        """
        buf = self._buffers.get(v_buf)
        if buf is None:
            return True
        n_occ = len(buf.occupied)
        return n_occ < self.batch_size and n_occ + buf.n_reserved < self.capacity

    def state(self, v_buf: int) -> str:
        """Buffer state (§4.2): ready (B occupied), stuck (full with a reserved entry) or waiting."""
        buf = self._buffers.get(v_buf)
        if buf is not None and len(buf.occupied) >= self.batch_size:
            return READY
        if buf is not None and buf.n_reserved and len(buf.occupied) + buf.n_reserved >= self.capacity:
            return STUCK
        return WAITING

    def position(self, gid: GroupId) -> tuple[int, bool]:
        """(V_buf, occupied) of a tracked group."""
        if gid not in self._where:
            raise StalenessError(f"{self.name}: group {gid!r} is not tracked (never reserved, or already gone)")
        v_buf, _, occupied = self._where[gid]
        return v_buf, occupied

    def layout(self) -> dict[int, tuple[list[GroupId], list[GroupId]]]:
        """V_buf -> (occupied ids, reserved ids) for every non-empty live buffer (for tests and logs)."""
        return {
            v: (list(b.occupied), [g for bucket in b.reserved.values() for g in bucket])
            for v, b in sorted(self._buffers.items())
            if b.occupied or b.n_reserved
        }

    def _window(self, v_traj: int) -> range:
        """Buffers a group with this V_traj may sit in, latest first: V_traj + eta down to max(V_traj, version)."""
        return range(v_traj + self.eta, max(v_traj, self.version) - 1, -1)

    # -- discriminator -------------------------------------------------------------------------
    def verify(self, version: int) -> bool:
        if not 0 <= version <= self.version:
            return False
        return any(self._has_space(b) for b in self._window(version))

    # -- tracker -------------------------------------------------------------------------------
    def reserve(self, gid: GroupId, version: int) -> None:
        if gid in self._where:
            raise StalenessError(f"{self.name}: reserve({gid!r}): group is already tracked; ids are reserved once")
        _check_version(self, gid, version)
        if version + self.eta < self.version:
            raise StalenessError(
                f"{self.name}: reserve({gid!r}, V_traj={version}): V_traj + eta = {version + self.eta} < trainer"
                f" version {self.version}; it could never be trained within eta={self.eta}"
            )
        for b in self._window(version):  # worst-case Reserve: backward scan, latest empty entry (Figure 7 T1)
            if self._has_space(b):
                self._buffer(b).add_reserved(gid, version)
                self._where[gid] = (b, version, False)
                self.counters.admitted += 1
                self.counters.in_flight += 1
                return
        raise StalenessError(
            f"{self.name}: reserve({gid!r}, V_traj={version}): buffers {max(version, self.version)}.."
            f"{version + self.eta} are full or stuck, so the bound V_traj + eta >= V_buf (eta={self.eta}) leaves"
            f" no entry; verify() first, or use a newer V_traj"
        )

    def occupy(self, gid: GroupId, version: int | None = None) -> list[Entry]:
        v_buf, v_res = self._reserved(gid, "occupy")
        v_traj = v_res if version is None else version
        if v_traj < v_res:
            raise StalenessError(
                f"{self.name}: occupy({gid!r}, V_traj={v_traj}): older than its reserved V_traj={v_res};"
                f" a member may not start on weights older than the group's reservation"
            )
        _check_version(self, gid, v_traj)
        self._delete_reserved(gid, v_buf, v_res)
        hole = self._move_reserved_later(v_buf)
        target = next(b for b in range(self.version, hole + 1) if self._has_space(b))  # greedy Occupy: forward
        return self._place_occupied(Entry(gid, v_traj), target)

    def abort(self, gid: GroupId) -> list[Entry]:
        v_buf, v_res = self._reserved(gid, "abort")
        self._delete_reserved(gid, v_buf, v_res)
        self.counters.aborted += 1
        return self._refill(v_buf)

    def filter(self, gid: GroupId) -> list[Entry]:
        if gid not in self._where:
            raise StalenessError(f"{self.name}: filter({gid!r}): unknown group (never reserved, or already gone)")
        v_buf, v_traj, occupied = self._where.pop(gid)
        buf = self._buffers[v_buf]
        if occupied:
            del buf.occupied[gid]
            self.counters.pending -= 1
        else:
            buf.remove_reserved(gid, v_traj)
            self.counters.in_flight -= 1
        self.counters.filtered += 1
        return self._refill(v_buf)

    def ready(self) -> bool:
        return self.state(self.version) == READY

    def consume(self) -> Batch:
        if not self.ready():
            buf = self._buffers.get(self.version)
            n_occ, n_res = (len(buf.occupied), buf.n_reserved) if buf else (0, 0)
            raise StalenessError(
                f"{self.name}: consume(): buffer V_buf={self.version} is {self.state(self.version)}"
                f" ({n_occ}/{self.batch_size} occupied, {n_res} reserved); only a Ready buffer is consumed"
            )
        entries = list(self._buffers.pop(self.version).occupied.values())
        versions = [e.version for e in entries]
        if not 0 <= staleness(self.version, max(versions)) <= staleness(self.version, min(versions)) <= self.eta:
            raise InvariantViolation(f"{self.name}: buffer {self.version} holds V_traj {min(versions)}..{max(versions)}")
        where = self._where
        for e in entries:
            del where[e.gid]
        self.counters.pending -= len(entries)
        self.counters.consumed += len(entries)
        self.version += 1
        return Batch(self.version - 1, entries)

    def check_invariants(self) -> None:
        super().check_invariants()
        for v, buf in self._buffers.items():
            if not self.version <= v <= self.version + self.eta or len(buf.occupied) + buf.n_reserved > self.capacity:
                raise InvariantViolation(
                    f"{self.name}: buffer {v} holds {len(buf.occupied)} occupied + {buf.n_reserved} reserved"
                    f" (capacity {self.capacity}, live buffers {self.version}..{self.version + self.eta})"
                )

    # -- entry deletion and movement -----------------------------------------------------------
    def _reserved(self, gid: GroupId, op: str) -> tuple[int, int]:
        where = self._where.get(gid)
        if where is None:
            raise StalenessError(f"{self.name}: {op}({gid!r}): unknown group (never reserved, or already gone)")
        if where[2]:
            raise StalenessError(f"{self.name}: {op}({gid!r}): group is already occupied (use filter() to drop it)")
        return where[0], where[1]

    def _delete_reserved(self, gid: GroupId, v_buf: int, v_traj: int) -> None:
        self._buffers[v_buf].remove_reserved(gid, v_traj)
        del self._where[gid]
        self.counters.in_flight -= 1

    def _move_reserved_later(self, hole: int) -> int:
        """Figure 7 (right) steps 2-3: move the earliest movable reserved entry into the hole, repeat; returns the last hole."""
        while True:
            for b in self._live(self.version, hole - 1):
                buf = self._buffers[b]
                found = buf.movable(hole - self.eta) if buf.n_reserved else None
                if found is not None:
                    break
            else:
                return hole
            gid, v_traj = found
            buf.remove_reserved(gid, v_traj)
            self._buffers[hole].add_reserved(gid, v_traj)
            self._where[gid] = (hole, v_traj, False)
            hole = b

    def _refill(self, hole: int) -> list[Entry]:
        """After abort/filter: pull occupied entries from later buffers into the hole (Figure 8c).

        Extension of §4.3: the hole first gets Figure 7 (right)'s movement, and the pull repeats on the hole
        the donor leaves, until no occupied entry sits behind a hole.
        """
        surplus: list[Entry] = []
        while True:
            hole = self._move_reserved_later(hole)  # the final hole always has space: it lost an entry
            later = (self._buffers[b] for b in reversed(self._live(hole + 1, self.version + self.eta)))
            donor_buf = next((buf for buf in later if buf.occupied), None)
            if donor_buf is None:
                return surplus
            entry = donor_buf.occupied.pop(next(iter(donor_buf.occupied)))  # moving earlier never breaks the bound
            self.counters.pending -= 1
            surplus += self._place_occupied(entry, hole)
            hole = donor_buf.version

    def _place_occupied(self, entry: Entry, v_buf: int) -> list[Entry]:
        """Occupy an empty entry of buffer v_buf; when it turns Ready, abort its surplus reservations (Figure 8b)."""
        buf = self._buffer(v_buf)
        buf.occupied[entry.gid] = entry
        self._where[entry.gid] = (v_buf, entry.version, True)
        self.counters.pending += 1
        if len(buf.occupied) < self.batch_size or not buf.n_reserved:
            return []
        surplus = [Entry(g, v) for v, bucket in buf.reserved.items() for g in bucket]
        for e in surplus:
            self._delete_reserved(e.gid, v_buf, e.version)
            self.counters.aborted += 1
        return surplus


class Synchronous(StaleFlowManager):
    """Barrier training: eta = 0, so only groups started at the current trainer version are admitted."""

    name = "synchronous"

    def __init__(self, batch_size: int, batch_redundancy: int = 0):
        super().__init__(batch_size, eta=0, batch_redundancy=batch_redundancy)


def _check_version(policy: StalenessPolicy, gid: GroupId, version: int) -> None:
    """V_traj names weights that exist: 0 <= V_traj <= trainer version."""
    if not 0 <= version <= policy.version:
        raise StalenessError(
            f"{policy.name}: group {gid!r}: V_traj={version} is not a published version"
            f" (trainer version is {policy.version}; weights 0..{policy.version} exist)"
        )
