"""What the simulator needs, measured inside this run: `<run dir>/sim_inputs.json`, read by `rlflow profile`.

A prediction is only as good as its inputs, and the inputs that matter are the ones a run has and a standalone
benchmark does not (issue 47): the engine decoding beside the trainer, the reward stream and the driver on the same
cores, at the batch the coordinator forms; the seconds a group spends between its last token and the buffer; the
seconds a train step holds the trainer beyond its compute; the group filter's drop rate. This module records them,
bounded in memory, as the run goes:

- engine steps: one sample per `engine.step` call that decoded (rollout_fleet.on_step): the KV tokens held, the
  running trajectories (tokens decoded / decode iterations), seconds per decode iteration inside the step, and the
  seconds per iteration the instance spent outside it while it held work (the round trip to the driver, the payload
  store put, the coordinator): StaleFlow's cost model (Appendix B, Eq. 11) times the first; the second is the hop
  cost the paper's setting does not have (its engines decode continuously; ours are stepped by the driver).
- groups: completion (last member finished, the driver hears it) to scored (the reward stream hands it back).
- steps: batch consumed to the step's bookkeeping done, less the trainer's own step_time_s (the control cost);
  tokens, step_time_s and micro-batches per step (the trainer's cost as a function of tokens).
- pulls: seconds an instance spent loading each weights version.
- routes to an idle engine: seconds from when it could have had the work (its idle report arrived, or the policy
  admitted more since) to the step call that carries it: the driver's round trip before an idle engine decodes
  again, which the simulator's routing otherwise does at once.
"""

from __future__ import annotations

import json
import time
from collections import deque
from pathlib import Path

FILE = "sim_inputs.json"
KEEP = 4096  # the most recent samples of each kind (bounded memory on a long run)


class SimInputs:
    def __init__(self, warmup_steps: int = 2):
        # the first steps pay one-off costs (engine warm-up, first weights load, lazy imports): not a cost per step
        self.warmup_steps = warmup_steps
        self.step = 0
        self.engine: deque[tuple[float, float, float, float, int]] = deque(maxlen=KEEP)
        self._last_report: dict[tuple[str, int], tuple[float, object, bool]] = {}
        self.reward_latency: deque[float] = deque(maxlen=KEEP)
        self._completed: dict[str, float] = {}
        self.steps: deque[dict] = deque(maxlen=KEEP)
        self._consumed_t: float | None = None
        self.pulls: deque[float] = deque(maxlen=KEEP)
        self.route_delay: deque[float] = deque(maxlen=KEEP)
        self.groups_scored = 0

    @property
    def _steady(self) -> bool:
        return self.step >= self.warmup_steps

    # -- the rollout side (rollout_fleet.on_step) --------------------------------------------------------------------
    def engine_step(self, stage: str, instance: int, snapshot, busy_s: float, pull_s: float, idle: bool) -> None:
        """An instance's step report: a sample if its engine counts decode iterations and some ran."""
        now = time.monotonic()
        key = (stage, instance)
        last = self._last_report.get(key)
        self._last_report[key] = (now, snapshot, idle)
        if pull_s > 0 and self._steady:
            self.pulls.append(pull_s)
        if last is None or not self._steady:
            return
        t_last, before, was_idle = last
        iters = snapshot.decode_steps - before.decode_steps
        tokens = snapshot.decoded_tokens - before.decoded_tokens
        if iters <= 0 or busy_s <= 0:
            return
        # outside the step while holding work: only when the last report left it work (else it waited for some)
        hop = max(0.0, now - t_last - busy_s - pull_s) if not was_idle else 0.0
        self.engine.append((before.kv_cache + tokens / 2, tokens / iters, busy_s / iters, hop / iters, iters))

    def routed_idle(self, seconds: float) -> None:
        if self._steady:
            self.route_delay.append(seconds)

    def group_completed(self, gid: str) -> None:
        self._completed[gid] = time.monotonic()

    # -- the driver ---------------------------------------------------------------------------------------------------
    def group_scored(self, gid: str) -> None:
        t = self._completed.pop(gid, None)
        self.groups_scored += 1
        if t is not None and self._steady:
            self.reward_latency.append(time.monotonic() - t)

    def consumed(self) -> None:
        self._consumed_t = time.monotonic()

    def step_done(self, metrics: dict) -> None:
        """The step's bookkeeping is over: the driver could hand the trainer its next batch now."""
        self.step += 1
        if self._consumed_t is None:
            return
        held = time.monotonic() - self._consumed_t
        compute = float(metrics.get("step_time_s", 0.0))
        if self.step > self.warmup_steps:
            self.steps.append({"tokens": int(metrics.get("tokens", 0)), "step_time_s": compute,
                               "micro_batches": int(metrics.get("micro_batches", 1) or 1),
                               "control_s": max(0.0, held - compute)})
        self._consumed_t = None

    def as_json(self, filtered_groups: int) -> dict:
        return {
            "warmup_steps": self.warmup_steps,
            "engine_steps": {"columns": ["kv_tokens", "running", "s_per_iteration", "hop_s_per_iteration", "iterations"],
                             "rows": [list(r) for r in self.engine]},
            "reward_latency_s": list(self.reward_latency),
            "steps": list(self.steps),
            "pull_s": list(self.pulls),
            "route_delay_s": list(self.route_delay),
            "groups_scored": self.groups_scored,
            "groups_filtered": filtered_groups,
        }

    def write(self, run_dir: Path, filtered_groups: int) -> Path:
        path = Path(run_dir) / FILE
        path.write_text(json.dumps(self.as_json(filtered_groups)) + "\n")
        return path
