"""Discrete-event simulator: the same staleness policies, simulated engines, any scale, on a laptop."""

from rlflow.sim.config import LengthSpec, SimConfig, SimConfigError, TrainerModel
from rlflow.sim.loop import Simulation, SimulationStalled, simulate
from rlflow.sim.result import SimResult

__all__ = [
    "LengthSpec",
    "SimConfig",
    "SimConfigError",
    "SimResult",
    "Simulation",
    "SimulationStalled",
    "TrainerModel",
    "simulate",
]
