"""The closed-form model's rollout: C slots at s_R tokens/s, one sample per slot at a time."""

from __future__ import annotations

from rlflow.sim.trajectories import Group, Sample


class SlotPool:
    """C slots sharing the trainer's latest weights; a sync is instant and in flight (V_traj kept)."""

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
        for slot in range(slots):  # slot j comes up at j/C of stagger_s: engines never start in lockstep
            sim.schedule(stagger_s * slot / slots, self._on_up, slot)

    def wake(self) -> None:
        """Fill idle slots with routable work until the trajectory server and policy have none."""
        sim = self.sim
        while self._idle:
            sample = sim.next_sample(sim.weights)
            if sample is None:
                return
            self._start(self._idle.pop(), sample)

    def publish(self, version: int) -> None:
        """New weights: later samples start on them; running samples keep their V_traj."""

    def abort(self, group: Group) -> None:
        """Stop the group's running samples; their slots free up."""
        for sample in group.samples:
            if sample.where is not None:
                self._epoch[sample.where] += 1
                self._release(sample.where)

    def busy_time(self, now: float) -> float:
        """Busy slot-seconds since the start."""
        self._account(now)
        return self._busy_time

    def _start(self, slot: int, sample: Sample) -> None:
        sim = self.sim
        self._account(sim.now)
        sample.version = sim.weights
        sample.where = slot
        self._running[slot] = sample
        self._busy_slots += 1
        inst = slot % self.instances
        self._load[inst] += 1
        sim.timeline.record(inst, sim.now, self._load[inst])
        sim.schedule(sim.now + sample.length / self.speed, self._on_done, (slot, self._epoch[slot]))

    def _on_up(self, slot: int) -> None:
        self._idle.append(slot)

    def _on_done(self, arg) -> None:
        slot, epoch = arg
        if epoch != self._epoch[slot]:
            return
        sample = self._running[slot]
        self._release(slot)
        self.sim.sample_done(sample)

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
