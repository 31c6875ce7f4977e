"""Cost-model rollout instances together: least-loaded routing and weight sync (global or per instance).

Sync rules (one line each, as the simulator applies them):
- global, partial_rollout=True: on a new version every instance pulls at once; running work keeps
  its V_traj and re-prefills its KV cache after the pull.
- global, partial_rollout=False: on a new version no instance takes new work; when every instance
  has drained (finished its work on the old weights), all pull at once (a global barrier).
- per_instance (Laminar-style): an instance behind the latest version takes no new work, finishes
  what it holds on its own weights, then pulls; no instance waits for another.
"""

from __future__ import annotations

import heapq

from rlflow.sim.config import CostProfile
from rlflow.sim.engine import Instance
from rlflow.sim.trajectories import Group


class Fleet:
    """The rollout side of cost_model mode; the event loop calls wake() after every event."""

    def __init__(self, sim, n: int, profile: CostProfile, prompt_tokens: int, weight_sync: str, partial_rollout: bool):
        self.sim = sim
        self.units = n
        self.instances = [Instance(i, self, profile, prompt_tokens) for i in range(n)]
        self.weight_sync = weight_sync
        self.partial_rollout = partial_rollout
        self._dirty: dict[int, Instance] = {i.idx: i for i in self.instances}
        self._blocked: dict[int, dict[int, Instance]] = {}  # weights version -> instances with room but no routable work
        self._blocked_epoch = -1
        self.pulls = 0

    def touch(self, inst: Instance) -> None:
        self._dirty[inst.idx] = inst

    def wake(self) -> None:
        """Drained instances pull, instances with capacity get work (least loaded first), changed ones replan."""
        sim = self.sim
        dirty = self._dirty
        candidates = dict(dirty)
        if self._blocked and sim.state_epoch != self._blocked_epoch:
            self._unblock(candidates)
        if not candidates:
            return
        for inst in list(candidates.values()):
            if not inst.accepting and inst.empty():
                self._drained(inst)  # may pull and touch other instances too
        candidates.update(dirty)
        ready = [(inst.load, inst.idx, inst) for inst in candidates.values() if inst.has_capacity()]
        heapq.heapify(ready)
        while ready:
            load, idx, inst = heapq.heappop(ready)
            sample = sim.next_sample(inst.version)
            if sample is None:
                self._blocked.setdefault(inst.version, {})[idx] = inst
                continue
            inst.admit(sample)
            dirty[idx] = inst
            if inst.has_capacity():
                heapq.heappush(ready, (load + 1, idx, inst))
        self._blocked_epoch = sim.state_epoch
        for inst in dirty.values():
            inst.plan()
        dirty.clear()

    def _unblock(self, candidates: dict[int, Instance]) -> None:
        """Blocked instances whose weights version now has routable work become candidates again."""
        for version in list(self._blocked):
            insts = {i: inst for i, inst in self._blocked[version].items() if inst.version == version}
            if insts and not self.sim.can_route(version):
                self._blocked[version] = insts
                continue
            del self._blocked[version]
            candidates.update(insts)

    def publish(self, version: int) -> None:
        """The trainer published weights `version`."""
        if self.weight_sync == "global" and self.partial_rollout:
            for inst in self.instances:
                self._pull(inst, version)
            return
        for inst in self.instances:
            inst.accepting = False
            self.touch(inst)

    def _drained(self, inst: Instance) -> None:
        if self.weight_sync == "per_instance":
            self._pull(inst, self.sim.weights)
        elif all(i.empty() for i in self.instances):  # global barrier
            for other in self.instances:
                self._pull(other, self.sim.weights)

    def _pull(self, inst: Instance, version: int) -> None:
        if inst.version == version:
            inst.accepting = True
            return
        inst.pull(version)
        inst.accepting = True
        self.pulls += 1
        self.touch(inst)

    def abort(self, group: Group) -> None:
        """Stop the group's samples wherever they run or wait."""
        for sample in group.samples:
            inst = sample.where
            if inst is not None:
                inst.abort(sample)
                self.touch(inst)

    def busy_time(self, now: float) -> float:
        """Busy instance-seconds since the start (running, prefilling or pulling)."""
        return sum(inst.busy_time(now) for inst in self.instances)

    @property
    def preemptions(self) -> int:
        return sum(inst.preemptions for inst in self.instances)
