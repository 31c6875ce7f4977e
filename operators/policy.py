"""The one interface every staleness-control policy implements (docs/internals/architecture.md, "Control plane").

A policy decides which *group* (the S samples of one prompt; S = 1 for plain trajectories) may
start generating with which policy version, and which completed groups a training step consumes.
The Ray runtime and the simulator both drive policies only through this interface, so a pipeline
switches policy by name (`make_policy` in operators/policy_kinds.py).

Lifecycle of one group id, as every executor calls it:

    verify(v)  -> may a new group start with weights version v?   (discriminator, no side effects)
    reserve(gid, v)                                             (rollout started; v = V_traj)
    occupy(gid, v_min)   after all members finished and were rewarded (v_min = min member V_traj)
      or abort(gid)      in-flight work thrown away (redundancy surplus, dead instance, shutdown)
      or filter(gid)     reserved or occupied group removed on purpose (e.g. uniform rewards)
    consume()            a training step takes a batch; trainer version advances by one

Staleness (the one definition, docs/internals/architecture.md, "Invariants"; StaleFlow's V_buf - V_traj):
    staleness = trainer version when the step that trains the group starts
                - version of the weights that generated the group's first token.
eta = 0 is on-policy. A step that starts from version v produces version v + 1.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass, field

GroupId = Hashable


class StalenessError(RuntimeError):
    """Misuse of a staleness policy (unknown id, consuming a batch that is not ready, ...).

    Raised instead of silently corrupting the control plane's state.
    """


class InvariantViolation(StalenessError):
    """A control-plane invariant failed (conservation, staleness bound, double consume)."""


def staleness(trainer_version: int, traj_version: int) -> int:
    """Trainer version at consume minus the version that generated the first token."""
    return trainer_version - traj_version


@dataclass
class Counters:
    """Lifetime counts of group ids, by where they ended up.

    Conservation: admitted == consumed + aborted + filtered + dropped + in_flight + pending.
    """

    admitted: int = 0  # reserve() calls that succeeded
    consumed: int = 0  # trained by a step
    aborted: int = 0  # abort(): in-flight work discarded
    filtered: int = 0  # filter(): removed on purpose
    dropped: int = 0  # evicted by the policy itself (queue overflow, too stale)
    in_flight: int = 0  # reserved, not yet occupied
    pending: int = 0  # occupied, waiting to be consumed

    def conserved(self) -> bool:
        return self.admitted == (
            self.consumed + self.aborted + self.filtered + self.dropped + self.in_flight + self.pending
        )


@dataclass(frozen=True)
class Entry:
    """A completed group as a training step sees it."""

    gid: GroupId
    version: int  # V_traj: oldest weights version tolerated while generating the group


@dataclass
class Batch:
    """What one consume() hands to the trainer."""

    version: int  # trainer version the step starts from (V_buf)
    entries: list[Entry]
    dropped: list[Entry] = field(default_factory=list)  # evicted at consume time (e.g. beyond eta)

    def staleness(self) -> list[int]:
        return [staleness(self.version, e.version) for e in self.entries]


class StalenessPolicy(ABC):
    """Admission and consumption of groups under a staleness rule."""

    #: registry name, as written in a pipeline's edge policy
    name: str = ""

    def __init__(self, batch_size: int, eta: int | None):
        if batch_size < 1:
            raise StalenessError(f"batch_size must be >= 1, got {batch_size}")
        if eta is not None and eta < 0:
            raise StalenessError(f"eta must be >= 0 (0 is on-policy), got {eta}")
        self.batch_size = batch_size  # groups per training step (B)
        self.eta = eta  # None: no bound (staleness is whatever the pipeline produces)
        self.version = 0  # trainer version: number of batches consumed so far
        self.counters = Counters()

    # -- discriminator -------------------------------------------------------------------------
    @abstractmethod
    def verify(self, version: int) -> bool:
        """True if a group generated starting from weights `version` may be admitted now."""

    # -- tracker -------------------------------------------------------------------------------
    @abstractmethod
    def reserve(self, gid: GroupId, version: int) -> None:
        """Record that group `gid` started with V_traj = `version`. Raises if verify() is False."""

    @abstractmethod
    def occupy(self, gid: GroupId, version: int | None = None) -> list[Entry]:
        """Group `gid` finished and was rewarded; it becomes consumable.

        `version` is the group's V_traj (min over members); it may not be older than the reserved
        one. Returns entries the policy removed as a result, already counted: completed groups
        evicted (queue overflow, beyond eta: dropped) and in-flight groups made surplus by batch
        redundancy (aborted). The caller aborts the work of any returned group still running.
        """

    @abstractmethod
    def abort(self, gid: GroupId) -> list[Entry]:
        """Discard an in-flight (reserved) group; returns surplus aborted as a result, as occupy()."""

    @abstractmethod
    def filter(self, gid: GroupId) -> list[Entry]:
        """Remove a reserved or occupied group on purpose; returns surplus aborted, as occupy()."""

    @abstractmethod
    def ready(self) -> bool:
        """True if consume() would return a batch now."""

    @abstractmethod
    def consume(self) -> Batch:
        """Hand the next batch to the trainer and advance the trainer version by one.

        Raises StalenessError if not ready().
        """

    # -- run-time checks -----------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise InvariantViolation if conservation does not hold. Cheap; call every step."""
        c = self.counters
        if not c.conserved():
            raise InvariantViolation(
                f"{self.name}: conservation broken: admitted={c.admitted} != consumed={c.consumed}"
                f" + aborted={c.aborted} + filtered={c.filtered} + dropped={c.dropped}"
                f" + in_flight={c.in_flight} + pending={c.pending}"
            )
