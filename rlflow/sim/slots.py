"""Slots mode, the closed-form model in its own terms: C slots at s_R tokens/s, one sample per slot at a time.

The rollout (SlotPool), a run given by the model's parameters (closed_form_config: rho, q, tailness, C/B),
and the model's prediction for a run (closed_form_prediction; the formulas are rlflow/staleness_model.py).
"""

from __future__ import annotations

from rlflow.sim.config import LengthSpec, SimConfig, TrainerModel
from rlflow.sim.lengths import expected_length, group_tail_multiplier
from rlflow.sim.trajectories import Group, Sample
from rlflow.staleness_model import StalenessPrediction, predict_mean_staleness


class SlotPool:
    """C slots sharing the trainer's latest weights; a sync is instant and in flight (V_traj kept).

    A multi-turn sample frees its slot between turns; when its environment step ends it takes the next free
    slot before any new work (the slots mode has no prefill, so a continuation costs no extra time).
    """

    def __init__(self, sim, slots: int, speed: float, instances: int, stagger_s: float = 0.0):
        self.sim = sim
        self.speed = speed
        self.instances = instances
        self.units = slots
        self._running: list[Sample | None] = [None] * slots
        self._idle: list[int] = []
        self._epoch = [0] * slots  # bumped when a slot's sample is aborted, to skip its completion
        self._load = [0] * instances  # busy slots per instance (slot j belongs to instance j % N)
        self._busy_slots = 0
        self._busy_time = 0.0
        self._acct_t = 0.0
        self._env: dict[int, Sample] = {}  # samples between turns, on their environment
        self._resume: dict[int, Sample] = {}  # continuations waiting for a slot, oldest first
        for slot in range(slots):  # slot j comes up at j/C of stagger_s: engines never start in lockstep
            sim.schedule(stagger_s * slot / slots, self._on_up, slot)

    def wake(self) -> None:
        """Fill idle slots with routable work until the trajectory server and policy have none."""
        sim = self.sim
        while self._idle:
            if self._resume:
                sample = self._resume.pop(next(iter(self._resume)))
            else:
                sample = sim.next_sample(sim.weights)
                if sample is None:
                    return
            self._start(self._idle.pop(), sample)

    def publish(self, version: int) -> None:
        """New weights: later samples start on them; running samples keep their V_traj."""

    def abort(self, group: Group) -> None:
        """Stop the group's running samples (their slots free up) and forget those between turns."""
        for sample in group.samples:
            if sample.where is not None:
                self._epoch[sample.where] += 1
                self._release(sample.where)
            elif self._env.pop(id(sample), None) is not None:
                self.sim.env_left()
            else:
                self._resume.pop(id(sample), None)

    def unit_time(self, now: float) -> float:
        """Slot-seconds since the start (the slots never change)."""
        return self.units * now

    def busy_time(self, now: float) -> float:
        """Busy slot-seconds since the start."""
        self._account(now)
        return self._busy_time

    def _start(self, slot: int, sample: Sample) -> None:
        sim = self.sim
        self._account(sim.now)
        if sample.version is None:  # a continuation keeps its first turn's version
            sample.version = sim.weights
        sample.where = slot
        self._running[slot] = sample
        self._busy_slots += 1
        inst = slot % self.instances
        self._load[inst] += 1
        sim.timeline.record(inst, sim.now, self._load[inst])
        sim.schedule(sim.now + (sample.turn_end - sample.generated) / self.speed, self._on_done, (slot, self._epoch[slot]))

    def _on_up(self, slot: int) -> None:
        self._idle.append(slot)

    def _on_done(self, arg) -> None:
        slot, epoch = arg
        if epoch != self._epoch[slot]:
            return
        sample = self._running[slot]
        self._release(slot)
        if sample.last_turn:
            self.sim.sample_done(sample)
        else:
            sample.end_turn()
            self._env[id(sample)] = sample
            self.sim.env_step(sample, self._on_env_done)

    def _on_env_done(self, sample: Sample) -> None:
        if self._env.pop(id(sample), None) is not None:  # else aborted meanwhile
            self.sim.env_left()
            self._resume[id(sample)] = sample

    def _release(self, slot: int) -> None:
        self._account(self.sim.now)
        self._running[slot].where = None
        self._running[slot] = None
        self._idle.append(slot)
        self._busy_slots -= 1
        inst = slot % self.instances
        self._load[inst] -= 1
        self.sim.timeline.record(inst, self.sim.now, self._load[inst])

    def _account(self, now: float) -> None:
        self._busy_time += self._busy_slots * (now - self._acct_t)
        self._acct_t = now


def utilization(config: SimConfig) -> float:
    """rho = v_R / v_T with v_R = C * s_R and v_T = B * E[L] / t_step (slots mode)."""
    mean = expected_length(config.lengths)
    batch_tokens = config.batch_samples * (mean + config.prompt_tokens)
    v_t = config.batch_samples * mean / config.trainer.step_time(batch_tokens)
    return config.slots * config.speed / v_t


def closed_form_prediction(config: SimConfig) -> StalenessPrediction | None:
    """Predicted mean staleness where the closed form applies: slots mode, queue_drop with q = Q/B >= 1, no
    environment waits (the closed form's samples hold their slot from first token to last)."""
    if config.mode != "slots" or config.policy != "queue_drop" or config.capacity is None:
        return None
    if config.turns > 1 and config.env_latency_s > 0:
        return None
    q = config.capacity / config.batch_groups
    if q < 1:
        return None
    return predict_mean_staleness(
        rho=utilization(config),
        concurrency=config.slots,
        batch=config.batch_samples,
        tail=group_tail_multiplier(config.lengths, config.group_size),
        queue_factor=q,
    )


def closed_form_config(
    *,
    rho: float,
    q: float | None,
    tailness: float,
    c_over_b: float,
    batch_groups: int = 16,
    group_size: int = 8,
    mean_length: float = 1000.0,
    cap_factor: float = 8.0,
    speed: float = 100.0,
    steps: int = 300,
    warmup_steps: int = 50,
    seed: int = 0,
    policy: str = "queue_drop",
    eta: int | None = None,
) -> SimConfig:
    """A slots-mode run at utilization `rho`, queue factor `q` (None: no capacity), `tailness`, C = c_over_b * B.

    t_step is chosen so that v_R / v_T = rho; lengths are lognormal, capped at cap_factor * E[L].
    """
    batch = batch_groups * group_size
    slots = max(1, round(c_over_b * batch))
    lengths = LengthSpec(
        kind="lognormal" if tailness > 0 else "fixed",
        mean=mean_length,
        tailness=tailness,
        cap=int(cap_factor * mean_length),
    )
    mean = expected_length(lengths)
    t_step = rho * batch * mean / (slots * speed)  # v_T = B E[L] / t_step = v_R / rho
    return SimConfig(
        mode="slots",
        slots=slots,
        speed=speed,
        lengths=lengths,
        group_size=group_size,
        batch_groups=batch_groups,
        policy=policy,
        eta=eta,
        capacity=None if q is None else round(q * batch_groups),
        trainer=TrainerModel(t_step=t_step),
        steps=steps,
        warmup_steps=warmup_steps,
        seed=seed,
    )
