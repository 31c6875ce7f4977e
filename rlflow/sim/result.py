"""What a simulated run reports: throughput, staleness, lengths, idle ratios, load timeline."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from rlflow.staleness_model import StalenessPrediction


class Timeline:
    """Running count per instance, recorded at every change; resampled on a uniform grid at the end."""

    def __init__(self, instances: int):
        self._t: list[list[float]] = [[0.0] for _ in range(instances)]
        self._n: list[list[int]] = [[0] for _ in range(instances)]

    def record(self, inst: int, t: float, running: int) -> None:
        while inst >= len(self._t):  # an instance that joined during the run (elastic): zero until then
            self._t.append([0.0])
            self._n.append([0])
        times, counts = self._t[inst], self._n[inst]
        if times[-1] == t:
            counts[-1] = running
        else:
            times.append(t)
            counts.append(running)

    def peak(self, start: float, end: float) -> int:
        """Most trajectories any instance ran at some instant in [start, end)."""
        best = 0
        for times, counts in zip(self._t, self._n):
            first = int(np.searchsorted(times, start, side="right")) - 1  # the value in effect at `start`
            last = int(np.searchsorted(times, end, side="left"))  # changes strictly before `end`
            best = max(best, max(counts[first:last], default=0))
        return best

    def resample(self, end: float, points: int) -> tuple[list[float], list[list[int]]]:
        """Value of each instance's step function at `points` instants in [0, end]."""
        grid = np.linspace(0.0, end, max(points, 2))
        rows = []
        for times, counts in zip(self._t, self._n):
            idx = np.searchsorted(np.asarray(times), grid, side="right") - 1
            rows.append(np.asarray(counts)[idx].tolist())
        return grid.tolist(), rows


@dataclass
class SimResult:
    """Steady-state statistics cover the steps after warm-up; counts cover the whole run."""

    policy: str
    mode: str
    steps: int
    warmup_steps: int
    sim_time_s: float  # virtual seconds until the last step ended
    window_s: float  # virtual seconds from the end of warm-up to the end of the last step
    trained_tokens_per_s: float  # prompt + response tokens trained, per second of window
    trained_trajectories_per_s: float
    generated_tokens_per_s: float  # response tokens of samples completed in the window
    staleness: list[int]  # one per consumed group after warm-up
    step_max_staleness: list[int]  # per step after warm-up
    trained_lengths: list[int]  # response lengths of trained samples after warm-up
    sampled_lengths: list[int]  # response lengths of all samples completed in the window
    expected_length: float  # E[L] of the length distribution (several rollout stages: weighted by their trained shares)
    trainer_idle_ratio: float
    rollout_idle_ratio: float  # unit-time (slots or instances) with nothing to do
    consumed: int
    dropped: int
    aborted: int
    filtered: int
    preemptions: int
    pulls: int
    events: int
    wall_s: float
    train_steps: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of every step
    timeline_t: list[float] = field(default_factory=list)
    timeline_running: list[list[int]] = field(default_factory=list)  # [instance][point]
    predicted: StalenessPrediction | None = None  # closed form, where its assumptions apply
    turns: int = 1  # generation turns per episode
    env_steps: int = 0  # environment steps taken between turns (whole run)
    mean_env_waiting: float = 0.0  # samples waiting on an environment, time-averaged over the window
    scale_events: list = field(default_factory=list)  # elastic: (sim seconds, steps ended, serving instances, why)
    step_events: list[int] = field(default_factory=list)  # events run by the end of each train step
    # per rollout stage, in order: instances, trained_samples, trained_tokens, trained_share (of trained samples),
    # mean_trained_length, max_trained_length, expected_length, rollout_idle_ratio (training counts after warm-up)
    stages: dict[str, dict] = field(default_factory=dict)

    @property
    def mean_staleness(self) -> float:
        return float(np.mean(self.staleness)) if self.staleness else float("nan")

    @property
    def max_staleness(self) -> int:
        return max(self.staleness, default=0)

    @property
    def staleness_histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.staleness).items()))

    @property
    def mean_trained_length(self) -> float:
        return float(np.mean(self.trained_lengths)) if self.trained_lengths else float("nan")

    @property
    def mean_sampled_length(self) -> float:
        return float(np.mean(self.sampled_lengths)) if self.sampled_lengths else float("nan")

    @property
    def length_bias(self) -> float:
        """Mean trained length / mean sampled length - 1 (negative: trains on shorter samples)."""
        return self.mean_trained_length / self.mean_sampled_length - 1

    def summary(self) -> dict:
        """Scalars only, for tables and tracking; with several rollout stages, also `stages` (scalars per stage)."""
        out = {
            "policy": self.policy,
            "mode": self.mode,
            "steps": self.steps,
            "sim_time_s": self.sim_time_s,
            "trained_tokens_per_s": self.trained_tokens_per_s,
            "trained_trajectories_per_s": self.trained_trajectories_per_s,
            "generated_tokens_per_s": self.generated_tokens_per_s,
            "mean_staleness": self.mean_staleness,
            "max_staleness": self.max_staleness,
            "mean_trained_length": self.mean_trained_length,
            "mean_sampled_length": self.mean_sampled_length,
            "trainer_idle_ratio": self.trainer_idle_ratio,
            "rollout_idle_ratio": self.rollout_idle_ratio,
            "consumed": self.consumed,
            "dropped": self.dropped,
            "aborted": self.aborted,
            "filtered": self.filtered,
            "preemptions": self.preemptions,
            "pulls": self.pulls,
            "events": self.events,
            "wall_s": self.wall_s,
        }
        if self.predicted is not None:
            out["predicted_mean_staleness"] = self.predicted.mean
        if self.turns > 1:
            out.update(turns=self.turns, env_steps=self.env_steps, mean_env_waiting=self.mean_env_waiting)
        if len(self.stages) > 1:
            out["stages"] = {name: dict(stats) for name, stats in self.stages.items()}
        return out
