"""Discrete-event simulator: the same staleness policies, simulated engines, any scale, on a laptop."""

from rlflow.sim.config import CostProfile, LengthSpec, SimConfig, SimConfigError, TrainerModel
from rlflow.sim.loop import Simulation, SimulationStalled, simulate
from rlflow.sim.result import SimResult

__all__ = [
    "CostProfile",
    "LengthSpec",
    "SimConfig",
    "SimConfigError",
    "SimResult",
    "Simulation",
    "SimulationStalled",
    "TrainerModel",
    "simulate",
]
