"""Where a run's time goes: the start-up timeline, the driver loop's own work, and the driver's CPU.

Start-up: `mark(name)` notes when a phase ended, in seconds since `rlflow run` began launching (before Ray
starts); the phases, in the order they usually end: `ray` (the cluster is up), `model` (the model directory
is prepared), `actors_created`, `tracker` (the MLflow run is open; this overlaps the actors' start),
`rollout`, `trainer`, `evaluator` (each role's last actor is ready: engines loaded, DeepSpeed initialised),
`publish` (the initial weights are in the parameter server), `first_scored` (the reward streams delivered
their first group) and `first_step`. The summary and MLflow (`startup/<phase>_s`) get the timeline.

Steady state, from the end of the first step to the last: `control_share` is the share of wall time the
driver's loop spent working (routing, dispatch, bookkeeping, logging; everything except waiting for an event),
StaleFlow's "coordination overhead"; `driver_cpu_share` is the driver process's CPU time over wall time, in
cores: it also counts the threads Ray and Ray Data run in the driver (the reward streams' executors).
"""

from __future__ import annotations

import time


class RunClock:
    def __init__(self, t0: float | None = None):
        self.t0 = time.monotonic() if t0 is None else t0
        self.marks: dict[str, float] = {}
        self.loop_busy_s = 0.0  # the driver loop's working time since the first step
        self._steady: tuple[float, float] | None = None  # (monotonic, process CPU) at the end of the first step

    def mark(self, name: str) -> None:
        """Note that phase `name` ended now (the first time only)."""
        self.marks.setdefault(name, round(time.monotonic() - self.t0, 2))

    def busy(self, seconds: float) -> None:
        """The driver loop worked `seconds` (counted once the first step is done)."""
        if self._steady is not None:
            self.loop_busy_s += seconds

    def first_step_done(self) -> None:
        self.mark("first_step")
        if self._steady is None:
            self._steady = (time.monotonic(), time.process_time())

    def steady(self) -> dict:
        """control_share and driver_cpu_share over the steady state (empty before it is long enough to say)."""
        if self._steady is None:
            return {}
        wall = time.monotonic() - self._steady[0]
        if wall < 1.0:
            return {}
        return {"control_share": self.loop_busy_s / wall,
                "driver_cpu_share": (time.process_time() - self._steady[1]) / wall, "steady_s": wall}

    def describe(self) -> str:
        """One line: the start-up timeline."""
        names = {"ray": "Ray", "model": "model", "tracker": "MLflow", "rollout": "rollout engines", "trainer": "trainer",
                 "evaluator": "evaluator", "publish": "initial weights", "first_scored": "first scored group",
                 "first_step": "first step"}
        return "start-up: " + ", ".join(f"{label} {self.marks[k]:.1f} s" for k, label in names.items() if k in self.marks)
