"""Control costs (configs/control_costs/*.json): the seconds `rlflow run` spends between actors, per group and per step.

Written by `python benchmarks/bench_step_latency.py --modes sync --write-control-costs PATH` from a traced synchronous
run: reward_latency_s is a group's way from its last finished sample to the buffer (payload store put, the reward
stream's source pull, Score and output, the driver's queue); step_control_s is a train step's time outside trainer
compute (buffer -> train call, payload take, publish, result and refresh, weight dispatch, load and route). The file
keeps the per-segment seconds they are summed from. Pure Python: read by the simulator (sim/from_plan.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rlflow.operators.cost_profile import PROFILE_DIR

CONTROL_COSTS_DIR = PROFILE_DIR.parent / "control_costs"  # configs/control_costs, shipped as rlflow/configs/...
DEFAULT = "cpu-2core"

#: the bench's critical-path segments each cost is the sum of (benchmarks/bench_step_latency.py PATH)
REWARD_SEGMENTS = ("payload store: put", "reward stream: source pull", "reward stream: Score (reward + filter)",
                   "reward stream: output", "driver: stream host -> queue")
STEP_SEGMENTS = ("driver: buffer -> train step", "trainer: call + payload take", "trainer: publish",
                 "driver: result + refresh", "weights: dispatch to the instances", "weights: load into the engine",
                 "prompts: route to the engine")


@dataclass(frozen=True)
class ControlCosts:
    reward_latency_s: float
    step_control_s: float
    source: str  # how they were measured (the bench command and date)
    path: Path | None  # the file they were read from

    @classmethod
    def from_segments(cls, segments: dict[str, float], source: str) -> ControlCosts:
        """Sum a traced synchronous step's segments (seconds per step) into the two costs."""
        missing = [s for s in (*REWARD_SEGMENTS, *STEP_SEGMENTS) if s not in segments]
        if missing:
            raise ValueError(f"control costs: the trace has no segment {', '.join(map(repr, missing))}")
        return cls(sum(segments[s] for s in REWARD_SEGMENTS), sum(segments[s] for s in STEP_SEGMENTS), source, None)

    @classmethod
    def load(cls, name_or_path: str | Path | None = None) -> ControlCosts:
        """A control-costs JSON; None: the shipped DEFAULT; a bare name is looked up in configs/control_costs/."""
        path = Path(name_or_path or DEFAULT)
        if not path.suffix:
            path = CONTROL_COSTS_DIR / f"{path}.json"
        if not path.exists():
            shipped = sorted(p.stem for p in CONTROL_COSTS_DIR.glob("*.json"))
            raise ValueError(f"control costs: no file {path}; shipped: {shipped}, or 'none' to leave them out")
        raw = json.loads(path.read_text())
        bad = [k for k in ("reward_latency_s", "step_control_s") if not isinstance(raw.get(k), (int, float)) or raw[k] < 0]
        if bad:
            raise ValueError(f"control costs {path}: {', '.join(bad)} must be seconds >= 0 "
                             "(re-measure with benchmarks/bench_step_latency.py --write-control-costs)")
        return cls(float(raw["reward_latency_s"]), float(raw["step_control_s"]), raw.get("source", "not recorded"), path)

    def as_json(self, segments: dict[str, float]) -> dict:
        return {"source": self.source, "reward_latency_s": self.reward_latency_s, "step_control_s": self.step_control_s,
                "reward_latency_segments": list(REWARD_SEGMENTS), "step_control_segments": list(STEP_SEGMENTS),
                "segments": segments}
