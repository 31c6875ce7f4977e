"""Reading a compiled plan's control section: each rollout stage's coordination, and its cost-model profile.

Shared by `rlflow run` and the simulator, so both execute the same choices with the same defaults.
Light on purpose: no Ray, no torch, no simulator.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlflow.operators.coordinator import CoordinationConfig
from rlflow.operators.cost_profile import CostProfile, ProfileError
from rlflow.plan_model import Plan


def rollout_stages(plan: Plan | dict) -> list[str]:
    """The plan's rollout stages, in pipeline order."""
    return [n for n, s in Plan.of(plan).pipeline["stages"].items() if s["kind"] == "rollout"]


def rollout_order(plan: Plan | dict) -> list[str]:
    """The plan's rollout stages in graph order: the order `rlflow run` creates and serves their fleets, and the
    simulator its fleets (it may differ from rollout_stages' pipeline order)."""
    return Plan.of(plan).rollout_stages()


def stage_length_law(workload: dict, name: str, max_new_tokens: int) -> tuple[float, float, int, float]:
    """Rollout stage `name`'s (mean_length, tailness, length_cap, prompt_share): workload.stages.<name>'s where set,
    else the workload block's; the cap else the stage's max_new_tokens. The compiler's closed form and the simulator
    both read a stage's lengths here."""
    own = (workload.get("stages") or {}).get(name) or {}
    pick = lambda key: own[key] if own.get(key) is not None else workload.get(key)
    return pick("mean_length"), pick("tailness"), pick("length_cap") or max_new_tokens, pick("prompt_share") or 0.0


@dataclass(frozen=True)
class PlanCoordination:
    """A rollout stage's coordination choices (StaleFlow §5.3), read once for the simulator and `rlflow run`."""

    routing: str  # least_loaded | cost_model
    migration: str  # none | threshold | repack
    sync: str  # global | per_instance | throughput_aware (the weight_sync back edge; global when absent)
    partial_rollout: bool
    interval_s: float  # seconds between snapshots (§5.2)
    dispatch: dict  # the data -> rollout edge's dispatch policy ({"kind": "round_robin"} when absent)
    profile: str | None  # cost-model profile named by the plan, if any
    mu: float = 0.3  # waterfall threshold (§5.3); the defaults are §6.1's
    phi_wait: int = 3
    phi_throughput: float = 5.0
    tasks: tuple[str, ...] | None = None  # task types routed to this stage; None: every task
    allow_foreign_profile: bool = False  # the profile may have been measured on another engine or model

    @property
    def skew_aware(self) -> bool:
        return self.dispatch["kind"] == "skew_aware_dispatch"

    @property
    def vanilla(self) -> bool:
        """Least-loaded routing, global / per-instance sync, no migration: what needs no coordinator cycle
        (dispatch is read separately: `skew_aware`)."""
        return self.routing == "least_loaded" and self.migration == "none" and self.sync in ("global", "per_instance")

    def config(self) -> CoordinationConfig:
        """The coordinator's strategies (Algorithm 1) and their knobs."""
        return CoordinationConfig(routing=self.routing, sync=self.sync, migration=self.migration,
                                  partial_rollout=self.partial_rollout, mu=self.mu, phi_wait=self.phi_wait,
                                  phi_throughput=self.phi_throughput)


def stage_coordination(plan: Plan | dict, stage: str) -> PlanCoordination:
    """The coordination block of rollout stage `stage`, with the defaults the executors share."""
    plan = Plan.of(plan)
    blocks = plan.control.coordination
    if stage not in blocks:
        raise ValueError(f"plan has no rollout stage {stage!r}; its rollout stages: {', '.join(rollout_stages(plan))}")
    coord = blocks[stage]
    ws = coord["weight_sync"] or {"mode": "global", "partial_rollout": False}
    tasks = coord.get("tasks")
    return PlanCoordination(routing=coord.get("routing", "least_loaded"), migration=coord.get("migration", "none"),
                            sync=ws["mode"], partial_rollout=ws["partial_rollout"],
                            interval_s=coord.get("interval_s", 0.5),
                            dispatch=coord.get("dispatch") or {"kind": "round_robin"}, profile=coord["profile"],
                            tasks=tuple(tasks) if tasks is not None else None,
                            allow_foreign_profile=bool(coord.get("allow_foreign_profile", False)),
                            **{k: coord[k] for k in ("mu", "phi_wait", "phi_throughput") if k in coord})


def named_profile(path: str | Path | None) -> CostProfile:
    """The cost-model profile at `path` (or a name in configs/profiles/). No default: a plan that needs a
    profile and names none is an error here, not a silent substitute (`rlflow run`; the simulator, which may
    assume one, uses sim/from_plan.py's profile_or_default)."""
    if not path:
        raise ProfileError("no cost-model profile given: name one in the rollout stage's coordinator.profile")
    return CostProfile.load(path)
