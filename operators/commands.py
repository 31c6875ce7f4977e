"""Rollout commands the coordinator issues (StaleFlow §5.1, Table 1); trajectories are opaque ids."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Route:
    """Assign trajectories from the trajectory server to instance `inst` for generation."""

    inst: int
    trajs: tuple


@dataclass(frozen=True)
class Interrupt:
    """Stop trajectories on `inst` and return them, partially generated, to the trajectory server."""

    inst: int
    trajs: tuple


@dataclass(frozen=True)
class Pull:
    """Instance `inst` fetches weights `version` (the parameter server's latest) from the PS."""

    inst: int
    version: int


@dataclass(frozen=True)
class Abort:
    """Discard trajectories on `inst` for good (issued by the staleness manager, §4.3); not returned to the TS."""

    inst: int
    trajs: tuple


Command = Route | Interrupt | Pull | Abort
