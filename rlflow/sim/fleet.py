"""Cost-model rollout instances together: least-loaded routing and weight sync (global or per instance).

Sync rules (one line each, as the simulator applies them):
- global, partial_rollout=True: on a new version every instance pulls at once; running work keeps
  its V_traj and re-prefills its KV cache after the pull.
- global, partial_rollout=False: on a new version no instance takes new work; when every instance
  has drained (finished its work on the old weights), all pull at once (a global barrier).
- per_instance (Laminar-style): an instance behind the latest version takes no new work, finishes
  what it holds on its own weights, then pulls; no instance waits for another.
An episode between turns stays with its instance (not routed, not migrated) and comes back to it as a
continuation; "drained" and "finishes what it holds" include those episodes, as in the runtime.
Several rollout stages: one Fleet per stage (Fleets), each taking only its own stage's work; the rules above
hold per fleet.
"""

from __future__ import annotations

import heapq
import random

from rlflow.operators.commands import Interrupt, Pull, Route
from rlflow.operators.coordinator import CoordinationConfig, Coordinator
from rlflow.operators.cost_profile import CostProfile
from rlflow.operators.elastic_rule import ElasticMonitor, ElasticRule
from rlflow.operators.routing import CostModel
from rlflow.operators.skew_dispatch import percentile, skew_aware_dispatch
from rlflow.operators.snapshot import InstanceSnapshot, Snapshot
from rlflow.sim.engine import Instance
from rlflow.sim.trajectories import Group


class Fleet:
    """The rollout side of cost_model mode; the event loop calls wake() after every event.

    stage: the index of the rollout stage it serves (its samples come from that stage's TS); first: the idx of its
    first instance (instance idx is unique over all fleets: the load timeline and tie-breaks use it)."""

    def __init__(self, sim, n: int, profile: CostProfile, prompt_tokens: int, weight_sync: str, partial_rollout: bool,
                 stage: int = 0, first: int = 0):
        self.sim = sim
        self.stage = stage
        self.instances = [Instance(first + i, self, profile, prompt_tokens) for i in range(n)]
        self.weight_sync = weight_sync
        self.partial_rollout = partial_rollout
        self._dirty: dict[int, Instance] = {i.idx: i for i in self.instances}
        self._blocked: dict[int, dict[int, Instance]] = {}  # weights version -> instances with room but no routable work
        self._blocked_epoch = -1
        self.pulls = 0
        # an idle instance's work reaches it route_s after it could have (SimConfig.route_s, measured in a run: the
        # driver's round trip before a stepped engine that reported idle decodes again): idx -> when it arrives
        self.route_s = sim.cfg.route_s
        self._route_at: dict[int, float] = {}

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
        ready = [(inst.load, inst.idx, inst) for inst in candidates.values() if inst.has_capacity() and self._reached(inst)]
        heapq.heapify(ready)
        stage = self.stage
        while ready:
            load, idx, inst = heapq.heappop(ready)
            sample = sim.next_sample(inst.version, stage)
            self._route_at.pop(idx, None)  # its wait for routed work is over, with work or blocked
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

    def _reached(self, inst: Instance) -> bool:
        """May routing hand `inst` work now? An idle one only route_s after work for it appeared (scheduled here)."""
        if not self.route_s or not inst.empty():
            return True
        at = self._route_at.get(inst.idx)
        if at is not None:
            return at <= self.sim.now
        if not self.sim.can_route(inst.version, self.stage):
            return True  # nothing to route: routing finds none and marks it blocked until the policy's state changes
        self._route_at[inst.idx] = self.sim.now + self.route_s
        self.sim.schedule(self.sim.now + self.route_s, self._route_arrives, inst)
        return False

    def _route_arrives(self, inst: Instance) -> None:
        self.touch(inst)

    def _unblock(self, candidates: dict[int, Instance]) -> None:
        """Blocked instances whose weights version now has routable work become candidates again."""
        for version in list(self._blocked):
            insts = {i: inst for i, inst in self._blocked[version].items() if inst.version == version}
            if insts and not self.sim.can_route(version, self.stage):
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
        elif all(i.empty() for i in self.instances):  # global barrier, over this fleet (a stage's coordinator syncs its own)
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
                inst.fleet.touch(inst)

    def busy_time(self, now: float) -> float:
        """Busy instance-seconds since the start (running, prefilling or pulling)."""
        return sum(inst.busy_time(now) for inst in self.instances)

    def unit_time(self, now: float) -> float:
        """Instance-seconds served since the start (elastic instances count while they are in the fleet)."""
        return sum((now if inst.left_at is None else inst.left_at) - inst.joined_at for inst in self.instances)

    @property
    def preemptions(self) -> int:
        return sum(inst.preemptions for inst in self.instances)


class Fleets:
    """Several rollout stages' fleets as one rollout side (uncoordinated cost_model mode). Every call goes to each fleet
    in the plan's rollout stage order, the order `rlflow run` serves its RolloutFleets: after an event the first
    stage's instances take the work admission allows, then the next stage's."""

    def __init__(self, fleets: list[Fleet]):
        self.fleets = fleets

    @property
    def instances(self) -> list[Instance]:
        return [inst for fleet in self.fleets for inst in fleet.instances]

    def wake(self) -> None:
        for fleet in self.fleets:
            fleet.wake()

    def publish(self, version: int) -> None:
        for fleet in self.fleets:
            fleet.publish(version)

    def abort(self, group: Group) -> None:
        self.fleets[group.stage].abort(group)

    def busy_time(self, now: float) -> float:
        return sum(fleet.busy_time(now) for fleet in self.fleets)

    def unit_time(self, now: float) -> float:
        return sum(fleet.unit_time(now) for fleet in self.fleets)

    @property
    def preemptions(self) -> int:
        return sum(fleet.preemptions for fleet in self.fleets)

    @property
    def pulls(self) -> int:
        return sum(fleet.pulls for fleet in self.fleets)


class CoordinatedFleet(Fleet):
    """Cost-model instances driven by the rollout coordinator (rlflow.operators.coordinator, Algorithm 1).

    Every coordinator_interval_s the fleet takes a snapshot, runs one cycle, and executes the commands at
    once (so every snapshot validates; a rejected one is counted in `rejected`). Initial groups wait in
    the TS unreserved; the first member routed reserves the group at its instance's version.
    """

    def __init__(self, sim, n: int, profile: CostProfile, prompt_tokens: int, cfg):
        super().__init__(sim, n, profile, prompt_tokens, cfg.weight_sync, cfg.partial_rollout)
        sync = {"global": "global", "per_instance": "per_instance", "greedy": "greedy",
                "throughput_aware": "throughput_aware"}[cfg.weight_sync]
        self.coord = Coordinator(n, CoordinationConfig(routing=cfg.routing, sync=sync, migration=cfg.migration,
                                                       partial_rollout=cfg.partial_rollout, mu=cfg.mu,
                                                       phi_wait=cfg.phi_wait, phi_throughput=cfg.phi_throughput),
                                 cost=CostModel.from_profile(profile))
        self.cfg = cfg
        self.ts = sim.ts
        self.interrupts = 0
        self.starting = 0  # elastic: instances asked for that have not joined yet
        self.monitor = None
        if cfg.elastic:
            rule = ElasticRule(cfg.elastic_min, cfg.elastic_max, cfg.elastic_window)
            self.monitor = ElasticMonitor(rule, cfg.batch_samples)
        self._long: set[int] = set()  # ids of samples dispatched as long-tail
        long = self._long
        self._lane_members = (lambda t: id(t) in long, lambda t: id(t) not in long)  # long-tail lane, regular lane
        if cfg.dispatch == "skew_aware":
            self.ts.partition(self._lane_members)
        self._n_long = 0
        self._recent: list[int] = []  # recent completed lengths (dispatch's distribution D)
        self._rng = random.Random(cfg.seed)
        self._snaps: dict[int, InstanceSnapshot] = {}  # the last snapshot of each instance, reused while unchanged
        self._changed: set[int] = set()  # instances touched since their last snapshot
        # when a cycle is due besides the period: the runtime's rule (rollout_coordinator.RolloutCoordinator.due)
        self._idle_after_cycle: set[int] = set()  # instances the last cycle left without work
        self._cycle_epoch = -1  # sim.state_epoch after the last cycle: a later one means the policy may admit more
        self._poke_seen = -1  # the state_epoch whose idle instances were last checked
        self._room_wait = False  # the last cycle left work in the TS for want of room: a cycle when room frees
        self._early = False  # a cycle is scheduled now, ahead of the period
        self._period = 0  # the periodic cycle's generation: a cycle (early or not) restarts the period
        sim.schedule(0.0, self._on_cycle, 0)

    def touch(self, inst: Instance) -> None:
        self._dirty[inst.idx] = inst
        self._changed.add(inst.idx)

    def wake(self) -> None:
        """Between cycles instances only replan (completions, preemptions); routing waits for the next cycle, which is
        at once when the runtime's coordinator would run one (_due)."""
        touched = self._replan()
        if not self._early and self._due(touched):
            self._early = True
            self.sim.schedule(self.sim.now + self._barrier(), self._on_cycle, None)

    def _replan(self) -> list[Instance]:
        """Replan every instance touched since the last call; returns them."""
        touched = list(self._dirty.values())
        for inst in touched:
            inst.plan()
        self._dirty.clear()
        return touched

    def _barrier(self) -> float:
        """Seconds until an early cycle runs: the runtime's cycle waits for every instance to return from the engine
        step it is in (rollout_fleet.coordinate holds until all have), about one decode step of the slowest, and its
        commands reach the instances a round trip later (route_s). Without the wait, a simulated fleet of 512
        instances ran a cycle at almost every completion: 3.6x the simulator's time (benchmarks/sim_speed.py)."""
        step = max((inst._a for inst in self.instances if inst.running), default=0.0)
        return self.route_s + step

    def _due(self, touched: list[Instance]) -> bool:
        """A cycle is due before its period, as `rlflow run`'s coordinator decides it (rollout_coordinator.due): an
        instance that had work has run out of it; the policy's state changed while an instance is idle (a step
        trained, a group was scored or filtered); the last cycle left work for want of room and an instance has some.
        Without these rules an instance that drains waits out the period: with short responses the simulated engines
        idled most of the time while the run's did not (tune_validation's laminar and streamrl points, issue 47)."""
        touched = [inst for inst in touched if not inst.retired]
        if any(inst.empty() and inst.idx not in self._idle_after_cycle for inst in touched):
            return True
        if self._room_wait and any(inst.has_capacity() for inst in touched):
            return True
        epoch = self.sim.state_epoch
        if epoch != self._cycle_epoch and epoch != self._poke_seen:
            self._poke_seen = epoch  # an instance drained since the last cycle was caught above when it was touched
            instances = self.instances
            return any(not instances[i].retired and instances[i].empty() for i in self._idle_after_cycle)
        return False

    def publish(self, version: int) -> None:
        """The PS has a new version; the next cycle's synchronization strategy decides who pulls."""

    def _on_cycle(self, period) -> None:
        """period: the periodic cycle's generation (a stale one, overtaken by an early cycle, does nothing); None: an
        early cycle (_due)."""
        sim = self.sim
        if sim._stop or (period is not None and period != self._period):
            return
        self._early = False
        self._top_up()
        serving = self.serving
        roomy = any(inst.has_capacity() for inst in serving)  # before routing fills them
        snap = Snapshot([self._inst_snapshot(inst) for inst in serving], self.ts.trajs(), sim.weights)
        self._changed.clear()
        lanes = self._lanes() if self.cfg.dispatch == "skew_aware" else None
        cmds = self.coord.cycle(snap, sim._verify, self._reserve, lanes, owned=True)
        for cmd in cmds or []:
            self._execute(cmd)
        self._replan()
        self._idle_after_cycle = {inst.idx for inst in serving if inst.empty()}
        self._cycle_epoch = sim.state_epoch
        routed = any(isinstance(cmd, Route) for cmd in cmds or [])
        self._room_wait = len(self.ts) > 0 and (routed or not roomy)
        self._period += 1
        sim.schedule(sim.now + self.cfg.coordinator_interval_s, self._on_cycle, self._period)

    def _inst_snapshot(self, inst: Instance) -> InstanceSnapshot:
        """The instance as the coordinator sees it now; kv_prev becomes this snapshot's kv for the next one.

        Only the KV cache changes between events, so an instance not touched since its last snapshot keeps it with the
        KV brought up to date (at 512 instances, copying every running set each cycle was a sixth of the simulator's
        time). That snapshot is as it was taken: the coordinator updates a snapshot in place only where it issues a
        command (a Route, Interrupt or Pull), and executing the command touches the instance."""
        kv = inst.p.k5 * inst.kv_tokens()
        snap = self._snaps.get(inst.idx)
        if snap is None or inst.idx in self._changed:
            snap = self._snaps[inst.idx] = InstanceSnapshot(
                inst.idx, kv, list(inst.running.values()), list(inst.waiting), inst.completed, inst.version,
                inst.kv_prev, list(inst.env.values()) if inst.env else [])
        else:
            snap.kv_cache, snap.kv_prev = kv, inst.kv_prev
        inst.kv_prev = kv
        return snap

    def _top_up(self) -> None:
        """Keep one batch of initial groups (B x S trajectories) in the TS (§5.1: the TS samples ahead)."""
        sim = self.sim
        new = []
        while len(self.ts.initial) < sim.cfg.batch_groups:
            gid = next(sim._gids)
            group = sim.new_group(gid, None)
            self.ts.add_initial(group)
            new.append(group)
        if new and self.cfg.dispatch == "skew_aware":
            self._predict(new)
            self._dispatch(list(self.ts.initial.values()))

    def _predict(self, groups: list[Group]) -> None:
        """The length ranker's prediction, once per prompt as it arrives (a ranker answers a prompt the same way each
        time it is asked). A ranker sees the prompt, not its samples (StreamRL §5.2; rlflow run's ranker learns
        (prompt, mean completion length)), so it predicts the group's mean length: exactly for the oracle, times one
        lognormal error for the noisy ranker. Every member carries the group's prediction."""
        noise = self.cfg.ranker_noise if self.cfg.ranker == "noisy" else 0.0
        for group in groups:
            mean = sum(group.lengths) / len(group.lengths)
            predicted = mean * self._rng.lognormvariate(0, noise) if noise else mean
            for s in group.samples:
                s.predicted = predicted

    def _dispatch(self, groups: list[Group]) -> None:
        """StreamRL Algorithm 2 over the prompts waiting, as `rlflow run` does it (rlflow/runtime/dispatch_lanes.py):
        the whole pool is planned again whenever new prompts arrive; a prompt (its S samples) is marked long-tail or
        regular as a whole, and Eq. 2's batch size counts prompts of S trajectories each; the waiting prompts are then
        routed longest predicted first within each lane (LPT, §5.3)."""
        predicted = [g.samples[0].predicted for g in groups]
        recent = sorted(self._recent[-4096:] or [n for g in groups for n in g.lengths])  # sorted once for every percentile
        p = self.instances[0].p
        size = self.sim.cfg.group_size
        prompt = self.sim.cfg.prompt_tokens
        kv_per_sample = p.k5 * (prompt + 0.5 * percentile(recent, 50, presorted=True))
        ptl = lambda bs: p.step_latency(kv_per_sample * bs * size, bs * size)  # bs prompts of `size` trajectories
        plan = skew_aware_dispatch(groups, predicted, len(self.serving), recent, ptl,
                                   alpha=self.cfg.long_tail_fraction,
                                   max_batch=lambda n: max(1, min(p.max_running, int(p.kv_tokens / (prompt + n))) // size))
        self._n_long = plan.n_long
        for group in groups:
            self._long.difference_update(map(id, group.samples))
        for group in plan.long_tail:
            self._long.update(map(id, group.samples))
        self.ts.order_initial(plan.long_tail + plan.regular)

    def _lanes(self):
        idx = [inst.idx for inst in self.serving]
        if not self._n_long:  # no split (a pool too small to have a long tail): both lanes use every instance, so
            everyone = frozenset(idx)  # trajectories marked long-tail earlier still run (as the runtime's lanes())
            in_long, in_rest = self._lane_members
            return [(in_long, everyone), (in_rest, everyone)]
        long_insts, rest = frozenset(idx[:self._n_long]), frozenset(idx[self._n_long:])
        in_long, in_rest = self._lane_members
        return [(in_long, long_insts), (in_rest, rest)]

    def _reserve(self, gid: int, version: int) -> None:
        sim = self.sim
        group = self.ts.initial[gid]
        sim.policy.reserve(gid, version)
        group.version = version
        sim.groups[gid] = group
        sim.state_epoch += 1
        self.ts.reserved(group)

    def _execute(self, cmd) -> None:
        inst = self.instances[cmd.inst]
        if isinstance(cmd, Interrupt):
            for s in cmd.trajs:
                inst.interrupt(s)
                self.ts.put(s)
            self.interrupts += len(cmd.trajs)
        elif isinstance(cmd, Pull):
            inst.pull(cmd.version)
            self.pulls += 1
        elif isinstance(cmd, Route):
            for s in cmd.trajs:
                self.ts.take(s)
                inst.enqueue(s)
        self.touch(inst)

    # -- elastic rollout (operators/elastic_rule.py) ------------------------------------------------------
    @property
    def serving(self) -> list[Instance]:
        return [inst for inst in self.instances if not inst.retired]

    def resize(self, n: int, why: str) -> None:
        """Start or retire instances until n serve: an added one joins instance_start_s later and loads the
        latest weights before taking work; a retired one hands its work back to the TS at once (partial
        rollouts, V_traj kept) and its episodes on an environment when their step ends."""
        sim = self.sim
        serving = self.serving
        have = len(serving) + self.starting
        for _ in range(n - have):
            self.starting += 1
            sim.schedule(sim.now + self.cfg.instance_start_s, self._join, None)
        cancel = min(self.starting, max(0, have - n))
        self.starting -= cancel
        for inst in serving[::-1][:max(0, have - n - cancel)]:
            self._retire(inst)
        sim.scale_events.append((sim.now, sim._steps_done, len(self.serving) + self.starting, why))
        if self.monitor is not None:
            self.monitor.restart()

    def _join(self, _) -> None:
        if not self.starting:
            return  # scaled back down before it started
        self.starting -= 1
        sim = self.sim
        inst = Instance(len(self.instances), self, self.instances[0].p, sim.cfg.prompt_tokens)
        self.coord.P.add(sim.weights)
        self.instances.append(inst)
        inst.pull(sim.weights)  # weights first: the pull's time is the join's cost
        self.pulls += 1
        self.touch(inst)

    def _retire(self, inst: Instance) -> None:
        inst.advance(self.sim.now)
        for s in list(inst.running.values()) + list(inst.waiting):
            inst.interrupt(s)
            self.ts.put(s)
            self.interrupts += 1
        inst.retired, inst.left_at = True, self.sim.now
        inst.plan()  # nothing left to run: no more events of its own

    def stepped(self, train_s: float) -> None:
        """A train step ended: the automatic rule measures the serving instances."""
        if self.monitor is None or self.starting:
            return
        now = self.sim.now
        counters = {i.idx: (i.busy_time(now), i.finished_total) for i in self.serving}
        m = self.monitor.observe(counters, train_s)
        if m is not None and m.target != m.instances:
            self.resize(m.target, m.describe())

    def sample_done(self, sample) -> None:
        self._long.discard(id(sample))
        self._recent.append(sample.length)
        if len(self._recent) > 8192:
            del self._recent[:4096]

    def abort(self, group: Group) -> None:
        """Staleness-manager Abort: the samples vanish from their instances and from P (Table 1)."""
        for sample in group.samples:
            inst = sample.where
            if inst is not None:
                inst.abort(sample)
                self.coord.note_abort(inst.idx, [sample])
                self.touch(inst)
            self._long.discard(id(sample))

