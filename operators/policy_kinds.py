"""Staleness policies by kind (`POLICIES`, `make_policy`), as a pipeline's edge policy or the simulator asks for them."""

from __future__ import annotations

from .policy import StalenessPolicy
from .queues import InFlightLimit, OneStep, QueueDrop, QueueMax, Unbounded
from .staleness_buffer import StaleFlowManager, Synchronous

POLICIES: dict[str, type[StalenessPolicy]] = {
    "staleflow": StaleFlowManager,
    "synchronous": Synchronous,
    "one_step": OneStep,
    "in_flight_limit": InFlightLimit,
    "queue_drop": QueueDrop,
    "queue_max": QueueMax,
    "unbounded": Unbounded,
}

# kind -> (required, optional) parameters besides batch_size
_PARAMS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "staleflow": (frozenset({"eta"}), frozenset({"batch_redundancy"})),
    "synchronous": (frozenset(), frozenset({"batch_redundancy"})),
    "one_step": (frozenset(), frozenset()),
    "in_flight_limit": (frozenset({"eta"}), frozenset()),
    "queue_drop": (frozenset({"capacity"}), frozenset({"eta"})),
    "queue_max": (frozenset({"eta"}), frozenset({"capacity"})),
    "unbounded": (frozenset(), frozenset()),
}

# policies whose eta is part of their definition: passing that same eta is allowed, any other is an error
_FIXED_ETA = {"synchronous": 0, "one_step": 1}


def make_policy(
    kind: str,
    *,
    batch_size: int,
    eta: int | None = None,
    capacity: int | None = None,
    batch_redundancy: int | str = 0,
) -> StalenessPolicy:
    """Build the staleness policy registered as `kind`; raises ValueError naming what is wrong. batch_redundancy
    "auto" builds it with none: the runtime's buffer sets it from the group filter's drops as the run goes
    (rlflow/runtime/buffer.py, StaleFlowManager.set_batch_redundancy)."""
    if kind not in POLICIES:
        raise ValueError(f"unknown staleness policy {kind!r}; valid: {', '.join(sorted(POLICIES))}")
    auto = batch_redundancy == "auto"
    if isinstance(batch_redundancy, str) and not auto:
        raise ValueError(f"batch_redundancy must be a whole number >= 0 or 'auto', got {batch_redundancy!r}")
    _check_range(batch_size=batch_size, eta=eta, capacity=capacity, batch_redundancy=0 if auto else batch_redundancy)
    if kind in _FIXED_ETA and eta is not None:
        if eta != _FIXED_ETA[kind]:
            raise ValueError(
                f"{kind} has eta = {_FIXED_ETA[kind]} by definition, got eta={eta}; use staleflow for another bound"
            )
        eta = None
    given = {"eta": eta, "capacity": capacity, "batch_redundancy": batch_redundancy or None}
    given = {k: v for k, v in given.items() if v is not None}
    required, optional = _PARAMS[kind]
    if missing := sorted(required - given.keys()):
        raise ValueError(f"{kind} needs {', '.join(missing)}")
    if extra := sorted(given.keys() - required - optional):
        takes = ", ".join(sorted(required | optional)) or "only batch_size"
        hint = "; batch redundancy needs staleflow or synchronous" if "batch_redundancy" in extra else ""
        raise ValueError(f"{kind} does not take {', '.join(extra)} (it takes {takes}){hint}")
    return POLICIES[kind](batch_size=batch_size, **({**given, "batch_redundancy": 0} if auto else given))


def _check_range(*, batch_size: int, eta: int | None, capacity: int | None, batch_redundancy: int) -> None:
    """Values every policy needs: B >= 1, eta >= 0, capacity >= B, redundancy >= 0."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if eta is not None and eta < 0:
        raise ValueError(f"eta must be >= 0 (0 is on-policy), got {eta}")
    if capacity is not None and capacity < batch_size:
        raise ValueError(f"capacity {capacity} < batch_size {batch_size}: a full batch would never fit")
    if batch_redundancy < 0:
        raise ValueError(f"batch_redundancy must be >= 0, got {batch_redundancy}")
