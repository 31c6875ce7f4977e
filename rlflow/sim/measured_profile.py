"""The sections `rlflow profile PIPELINE` adds to a cost-model profile: what the simulator needs besides the engine's
decode cost, measured in a calibration run of the user's own pipeline on the user's own machine (issue 47).

    "measured_in_run": {"pipeline", "data_source", "max_new_tokens", "steps", "source",
                        "trainer_ranks", "rollout_instances"}  the calibration run: its workload and its layout
    "trainer": {"base_s", "s_per_token", "s_per_micro_batch"}  seconds per train step = base_s + s_per_token * tokens
                                                               + s_per_micro_batch * micro-batches per rank
    "control_costs": {"reward_latency_s", "step_control_s",   the hops between actors (sim/control_costs.py's two)
                      "route_s"}                              and an idle engine's wait for routed work
    "filter_drop_rate": {"value"}                             share of scored groups the group filter dropped
    "workload": {"mean_length", "tailness", "prompt_share"}   the response lengths the run trained on

Each is {"value": ..., "from": ...} or a dict of such; the engine's own costs (k1..k4, hop_s, pull_s) stay where
CostProfile reads them. A profile without "measured_in_run" (configs/profiles/'s published ones) has none of these,
and the simulator states its assumptions instead. Pure Python.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rlflow.operators.cost_profile import ProfileError, profile_path


def _value(section: dict, key: str) -> float:
    v = section[key]
    return float(v["value"] if isinstance(v, dict) else v)


@dataclass(frozen=True)
class MeasuredProfile:
    path: Path
    pipeline: str
    data_source: str | None
    max_new_tokens: int | None
    source: str
    base_s: float
    s_per_token: float
    s_per_micro_batch: float
    reward_latency_s: float
    step_control_s: float
    route_s: float
    filter_drop_rate: float
    workload: dict  # mean_length, tailness, prompt_share (floats)
    trainer_ranks: int | None = None  # the calibration run's layout (None: not recorded)
    rollout_instances: int | None = None

    @classmethod
    def load(cls, name_or_path: str | Path) -> MeasuredProfile | None:
        """The measured sections of a profile file (None: it has none)."""
        path = profile_path(name_or_path)
        if not path.exists():
            return None
        raw = json.loads(path.read_text())
        meta = raw.get("measured_in_run")
        if not meta:
            return None
        try:
            trainer, control, workload = raw["trainer"], raw["control_costs"], raw["workload"]
            return cls(path=path, pipeline=meta.get("pipeline", "?"), data_source=meta.get("data_source"),
                       max_new_tokens=meta.get("max_new_tokens"), source=meta.get("source", "not recorded"),
                       base_s=_value(trainer, "base_s"), s_per_token=_value(trainer, "s_per_token"),
                       s_per_micro_batch=_value(trainer, "s_per_micro_batch") if "s_per_micro_batch" in trainer else 0.0,
                       reward_latency_s=_value(control, "reward_latency_s"),
                       step_control_s=_value(control, "step_control_s"),
                       route_s=_value(control, "route_s") if "route_s" in control else 0.0,
                       filter_drop_rate=_value(raw, "filter_drop_rate"),
                       workload={k: _value(workload, k) for k in ("mean_length", "tailness", "prompt_share")},
                       trainer_ranks=meta.get("trainer_ranks"), rollout_instances=meta.get("rollout_instances"))
        except (KeyError, TypeError, ValueError) as e:
            raise ProfileError(f"profile {path}: its measured_in_run sections are incomplete ({type(e).__name__}: {e}); "
                               "measure it again with rlflow profile PIPELINE") from None

    def same_workload(self, data_source: str | None, max_new_tokens: int) -> bool:
        """Were the lengths measured on this data source at this cap (else they describe another task)?"""
        return self.data_source == data_source and self.max_new_tokens == max_new_tokens
