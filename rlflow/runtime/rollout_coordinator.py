"""The rollout coordinator inside `rlflow run`: fleet state -> Snapshot -> Algorithm 1 -> step commands.

operators/coordinator.py is StaleFlow's snapshot -> command cycle (StaleFlow §5.2, Algorithm 1) as
pure Python; the simulator drives it (rlflow/sim/fleet.py), and this module drives it for one rollout
fleet (rollout_fleet.py), every strategy included, vanilla least-loaded routing too.

- The TS (trajectory server) lives here: initial groups drawn from the prompts (no V_traj until routing
  reserves the group with the staleness policy, Algorithm 2), reserved members not routed yet, and
  partial trajectories returned by an Interrupt. It holds one batch of initial groups at a time.
- Snapshots are exact: a worker changes only inside its `step` call, so a due cycle holds returning
  instances until every alive one has returned; the snapshot is their last report plus commands still
  queued for them, and the commands (Route -> routes, Interrupt -> interrupts, Pull -> pull) apply at
  the start of the next step. A Route for a trajectory being interrupted waits for it (§5.2).
- A cycle is due every `interval_s`, and as soon as an instance that had work has run out of it, or an idle
  instance could get work: the driver pokes the coordinator when the staleness policy's state changed (a step
  trained, a version was published, scored groups were filtered out), so an idle instance is not left waiting
  out the interval. StaleFlow §5.2 takes snapshots periodically; a synchronous step (eta = 0) would otherwise
  pay up to interval_s twice per round of generation (benchmarks/results/step_latency.md).
- Also as soon as an instance has room again while the TS holds work the last cycle could not place for want of
  room (routing fills an instance up to max_running and no further): without it an instance's batch drained
  between two cycles, down to its last trajectory, before it was refilled, where an engine alone refills each
  slot as it frees. Measured (benchmarks/bench_engines.py --in-run, tiny model, max_running 32): the engine ran
  7.8 trajectories per decode step on average in the run against 11.2 alone (hf), and vLLM's in-run tokens/s
  doubled with this trigger. A cycle that finds room and routes nothing (the rest is held back by the staleness
  policy) ends the wait, so it costs at most one empty cycle per round.
- The speculative state P (Table 1, Eq. 1) validates every snapshot; aborts from the staleness side lower
  P when issued and are undone if the trajectory finished first; complete_trajs counts from the last
  delivered Pull. If several snapshots in a row disagree (vLLM keeps generating between steps), P is
  re-read from the snapshot, logged and counted, so coordination never stalls.

Partial trajectories keep their oldest V_traj (stages/engine.py begin_segment) and are only routed to an
instance on that version or newer (Algorithm 2); a group's members launch with its reserved V_traj.
"""

from __future__ import annotations

import time
from dataclasses import replace

from rlflow.operators.commands import Interrupt, Pull, Route
from rlflow.operators.coordinator import Coordinator
from rlflow.operators.policy import InvariantViolation
from rlflow.operators.routing import CostModel
from rlflow.operators.snapshot import InstanceSnapshot, Snapshot, TrajView
from rlflow.plan_read import PlanCoordination, named_profile
from rlflow.runtime.trajectory_server import TrajectoryServer, row_tokens, traj_id
from rlflow.stages.engine import EngineSnapshot
from rlflow.stages.trajectory import Trajectory

COUNTS = ("coord_cycles", "coord_rejected", "coord_resyncs", "coord_routed", "coord_interrupted", "coord_pulls")
RESYNC_AFTER = 3  # consecutive rejected snapshots before P is re-read from the snapshot


class RolloutCoordinator:
    """One fleet's rollout coordinator: its TS, exact snapshots of its instances, and the commands that
    operators/coordinator.py's Coordinator (Algorithm 1, shared with the simulator) returns for them; the driver
    calls the hooks below at each event."""

    def __init__(self, pc: PlanCoordination, cost: CostModel, instances, counts: dict, log=print):
        self.pc, self.log = pc, log
        self.interval_s = pc.interval_s
        self.cost = cost
        self.coord = Coordinator(len(instances), pc.config(), cost=cost)
        for inst in instances:  # a resumed run starts by pulling the restored version
            self.coord.P.inst_version[inst.index] = inst.pull[0] if inst.pull else inst.version
        self.queue = TrajectoryServer()  # the TS: what waits to be routed
        self.held: dict[str, int] = {}  # tid -> instance whose Route waits for the interrupted trajectory
        n = len(instances)
        self.in_transit: list[set] = [set() for _ in range(n)]  # interrupted, not yet returned by the worker
        self.noted: list[set] = [set() for _ in range(n)]  # aborts counted in P that may find the work finished
        self.sent_aborts: list[list] = [[] for _ in range(n)]
        self.sent_interrupts: list[list] = [[] for _ in range(n)]
        self.complete_base = [0] * n  # engine completion count when the last Pull was delivered
        self.kv_prev: list[float | None] = [None] * n
        self.next_cycle = 0.0
        self.holding = False  # a cycle is due: instances that return are held until all have
        self.idle_after_cycle: set[int] = set()  # instances the last cycle left without work
        self.poked = False  # the policy's state changed since the last cycle: an idle instance may get work now
        self.poke_t = 0.0  # when it first changed since the last cycle (time.monotonic())
        self.cycle_poke_t = 0.0  # the poke the last cycle answered (0: none): when its routes' work became admissible
        self.room_wait = False  # the last cycle left work in the TS for want of room: refill when room frees
        self._rejected_in_row = 0
        self.counts = counts
        for k in COUNTS:
            counts.setdefault(k, 0)

    @classmethod
    def for_stage(cls, pc: PlanCoordination, rollout: dict, instances, counts: dict, log=print) -> RolloutCoordinator:
        """The coordinator of one rollout stage. Strategies that weigh latencies (cost-model routing, threshold
        and repack migration) use the plan's profile (the compiler checked it matches the engine); vanilla
        least-loaded routing only needs room, which is the stage's max_running (StaleFlow's gamma without M)."""
        if pc.profile:
            cost = CostModel.from_profile(named_profile(pc.profile))
            cost = replace(cost, max_running=min(cost.max_running or rollout["max_running"], rollout["max_running"]))
        else:
            cost = CostModel(k1=0.0, k2=0.0, k3=0.0, k4=0.0, max_running=rollout["max_running"])
        return cls(pc, cost, instances, counts, log)

    def describe(self) -> str:
        pc = self.pc
        sync = pc.sync + (" with partial rollout" if pc.partial_rollout and pc.sync == "global" else "")
        return (f"rollout coordinator (staleflow §5.2): routing={pc.routing} sync={sync} migration={pc.migration}; "
                f"a cycle every {pc.interval_s:g}s, or as soon as an instance runs out of work")

    def add_instance(self) -> int:
        """Elastic rollout: room for one more instance (its index); it joins P when it has started (joined())."""
        for per_instance in (self.in_transit, self.noted):
            per_instance.append(set())
        for per_instance in (self.sent_aborts, self.sent_interrupts):
            per_instance.append([])
        self.complete_base.append(0)
        self.kv_prev.append(None)
        return self.coord.P.add(0)

    def joined(self, inst) -> None:
        """A started instance will load the PS version it was sent (inst.pull) before any work: P expects that."""
        P = self.coord.P
        P.inst_version[inst.index], P.accum_traj_num[inst.index] = inst.pull[0], 0

    def release(self, inst) -> int:
        """Elastic rollout, an instance leaving: everything routed to it goes back to the TS, generated tokens
        kept (a partial rollout, resumed elsewhere with its V_traj, as after a migration). It is out of the
        snapshots already, so P is not touched. Returns how many it had."""
        tids = [t for t in inst.running if t not in self.in_transit[inst.index] and t not in inst.interrupts]
        self._interrupt(inst, tids)
        inst.pull = None  # no weights to load for work it will not do
        return len(tids)

    def _reserve(self, reserve):
        def on_reserve(gid, version: int) -> None:
            reserve(gid, version)  # the staleness policy and the group assembler (fleet)
            self.queue.reserve(gid, version)
        return on_reserve

    # ------------------------------------------------------------------ the cycle
    def due(self, now: float, instances) -> bool:
        """A cycle is due every interval_s, and as soon as an instance that had work has run out of it
        (a drained instance asks for work at once instead of idling until the next period)."""
        return now >= self.next_cycle or any(
            i.serving and i.ref is None and (_idle(i) and (self.poked or i.index not in self.idle_after_cycle)
                                             or self.room_wait and self._has_room(i))
            for i in instances)

    def _has_room(self, inst) -> bool:
        """The instance could take a trajectory at the next cycle: fewer than max_running routed to it and not
        finished, and nothing waiting in its engine at its last report (the cost model's room, without the snapshot)."""
        snap = inst.snapshot
        full = self.cost.max_running is not None and len(inst.running) >= self.cost.max_running
        return not full and not (snap is not None and snap.wait_trajs)

    def poke(self) -> None:
        """The staleness policy's state changed (driver.py): a cycle is due if an instance is idle."""
        if not self.poked:
            self.poke_t = time.monotonic()
        self.poked = True

    def cycle(self, instances, ps_version: int, ps_ref, verify, reserve, launch, dispatch=None) -> list | None:
        """Algorithm 1 on an exact snapshot (every alive instance between two steps); commands go to the Instances.

        verify / reserve: the staleness policy (Algorithm 2); launch(row): a member leaves the TS for the first time.
        dispatch (skew-aware, rlflow/runtime/dispatch_lanes.py): routing runs once per lane, the TS in LPT order,
        and every Route is checked against its trajectories' lanes before it is carried out.
        """
        self.cycle_poke_t = self.poke_t if self.poked else 0.0
        self.poked = False
        alive = [i for i in instances if i.serving]
        views = self.queue.views()
        lanes = split = None
        if dispatch is not None:
            views.sort(key=lambda v: dispatch.rank.get(v.gid, len(dispatch.rank)))
            split = dispatch.lanes([i.index for i in alive])
            lanes = [((lambda v, lane=lane: dispatch.lane(v.gid) == lane), insts) for lane, insts, _ in split]
        snap = Snapshot([self._snapshot(i) for i in alive], views, ps_version)
        roomy = any(self.cost.room(s) for s in snap.instances)  # before the cycle: routing updates them in place
        cmds = self.coord.cycle(snap, verify, self._reserve(reserve), lanes)
        for s in snap.instances:
            self.kv_prev[s.idx] = s.kv_cache
        if cmds is None:
            self.counts["coord_rejected"] += 1
            self._rejected_in_row += 1
            if self._rejected_in_row >= RESYNC_AFTER:
                self._resync(snap)
            return None
        self._rejected_in_row = 0
        self.counts["coord_cycles"] += 1
        if dispatch is not None:
            for cmd in cmds:
                if isinstance(cmd, Route):
                    for v in cmd.trajs:
                        dispatch.check_lane(v.gid, cmd.inst, split)
        for cmd in cmds:
            inst = instances[cmd.inst]
            if isinstance(cmd, Interrupt):
                self._interrupt(inst, [v.tid for v in cmd.trajs])
            elif isinstance(cmd, Pull):
                inst.pull = (ps_version, ps_ref)
                self.counts["coord_pulls"] += 1
            elif isinstance(cmd, Route):
                self._route(inst, [v.tid for v in cmd.trajs], launch)
        self.idle_after_cycle = {i.index for i in alive if _idle(i) and not self.held_for(i.index)}
        # work left in the TS: placed at the next instance's room if this cycle routed or found no room; a cycle that
        # had room and routed nothing found nothing admissible (the staleness policy holds the rest back)
        routed = any(isinstance(cmd, Route) for cmd in cmds)
        self.room_wait = bool(self.queue.ts) and (routed or not roomy)
        return cmds

    def held_for(self, idx: int) -> int:
        """Routes to instance `idx` waiting for their interrupted trajectories to come back."""
        return sum(1 for target in self.held.values() if target == idx)

    def _snapshot(self, inst) -> InstanceSnapshot:
        """The instance as its next step will find it: last report, minus queued aborts, plus queued routes."""
        i = inst.index
        snap = inst.snapshot or EngineSnapshot(instance=i, version=inst.version, kv_cache=0, run_trajs=[], wait_trajs=[],
                                               complete_trajs=0, max_running=0)
        aborted = set(inst.aborts)
        per = snap.kv_cache / len(snap.run_trajs) if snap.run_trajs else 0.0  # KV tokens of each running one

        def view(tid: str, tokens: float | None = None) -> TrajView:
            row = inst.running.get(tid)
            if row is None:
                raise InvariantViolation(f"instance {i} reports trajectory {tid}, which the driver did not route there")
            return TrajView(tid, row.group_id, row.version, row_tokens(row) if tokens is None else tokens)

        run = [view(t, per) for t in snap.run_trajs if t not in aborted]
        wait = [view(t) for t in snap.wait_trajs if t not in aborted]
        env = [view(t) for t in snap.env_trajs if t not in aborted]  # multi-turn: between turns
        kv = per * len(run)
        for row in inst.routes:  # queued routes: admitted at the next step if the engine has room
            v = TrajView(traj_id(row), row.group_id, row.version, row_tokens(row))
            if len(run) < self.cost.max_running:
                run.append(v)
                kv += v.tokens
            else:
                wait.append(v)
        version = inst.pull[0] if inst.pull else snap.version
        complete = 0 if inst.pull else snap.complete_trajs - self.complete_base[i]
        return InstanceSnapshot(i, self.cost.k5 * kv, run, wait, complete, version, self.kv_prev[i], env)

    def _interrupt(self, inst, tids: list[str]) -> None:
        queued = {traj_id(r): r for r in inst.routes}
        for tid in tids:
            self.counts["coord_interrupted"] += 1
            if tid in queued:  # never delivered: straight back to the TS
                inst.routes.remove(queued[tid])
                self.queue.queue(inst.running.pop(tid))
            else:
                inst.interrupts.append(tid)
                self.in_transit[inst.index].add(tid)

    def _route(self, inst, tids: list[str], launch) -> None:
        version = self.coord.P.inst_version[inst.index]  # what the instance will run when the route arrives
        for tid in tids:
            self.counts["coord_routed"] += 1
            if tid not in self.queue:
                if not any(tid in s for s in self.in_transit):
                    raise InvariantViolation(f"the coordinator routed {tid}, which is neither in the TS nor interrupted")
                self.held[tid] = inst.index  # queued when the worker returns it
                continue
            row = self.queue.pop(tid)
            if not row.completion_ids:
                row.version = version  # a fresh trajectory's V_traj is its first token's (stamped by the engine)
            launch(row)
            inst.routes.append(row)
            inst.running[tid] = row

    def _resync(self, snap: Snapshot) -> None:
        P = self.coord.P
        off = [f"instance {s.idx}: P=({P.inst_version[s.idx]}, {P.accum_traj_num[s.idx]}) "
               f"snapshot=({s.inst_version}, {s.accum_traj_num})" for s in snap.instances
               if (P.inst_version[s.idx], P.accum_traj_num[s.idx]) != (s.inst_version, s.accum_traj_num)]
        self.log(f"rollout coordinator: {self._rejected_in_row} snapshots in a row disagree with the speculative state "
                 f"({'; '.join(off)}); re-reading it from the snapshot")
        for s in snap.instances:
            P.inst_version[s.idx], P.accum_traj_num[s.idx] = s.inst_version, s.accum_traj_num
        self.counts["coord_resyncs"] += 1
        self._rejected_in_row = 0

    # ------------------------------------------------------------------ hooks from the driver
    def sent(self, inst) -> None:
        """The driver issues the instance's next step with its queued commands."""
        i = inst.index
        if inst.pull is not None:
            self.complete_base[i] = inst.snapshot.complete_trajs if inst.snapshot else 0
        self.sent_aborts[i] = list(inst.aborts)
        self.sent_interrupts[i] = list(inst.interrupts)

    def abort(self, inst, tid: str) -> bool:
        """The driver aborts `tid`, which it last placed on `inst` (Table 1: Abort lowers P).

        Returns True if the worker must be told; False if the trajectory never reached it (queued route)
        or already left it (interrupted, its return is dropped when it arrives).
        """
        i = inst.index
        target = self.held.pop(tid, None)
        if target is not None:
            self.coord.note_abort(target, [tid])  # its Route will not be delivered
        if tid in self.in_transit[i]:
            return False
        queued = next((r for r in inst.routes if traj_id(r) == tid), None)
        self.coord.note_abort(i, [tid])
        if queued is not None:
            inst.routes.remove(queued)
            return False
        self.noted[i].add(tid)
        return True

    def finished(self, inst, tid: str) -> None:
        """A finished trajectory is reported (before the driver looks it up)."""
        i = inst.index
        if tid in self.noted[i]:  # it finished before our abort arrived: the abort will find nothing
            self.noted[i].discard(tid)
            self.coord.P.accum_traj_num[i] += 1
        if tid in self.in_transit[i]:  # finished before our interrupt arrived (not expected with exact snapshots)
            self.in_transit[i].discard(tid)
            target = self.held.pop(tid, None)
            if target is not None:
                self.coord.note_abort(target, [tid])

    def returned(self, inst, rows: list[Trajectory], instances) -> int:
        """The step's interrupted trajectories: to the instance a Route waits with, else to the TS.

        Returns how many trajectories were restarted because an interrupt found nothing to return.
        """
        i = inst.index
        for row in rows:
            tid = traj_id(row)
            self.in_transit[i].discard(tid)
            if inst.running.pop(tid, None) is None:
                continue  # aborted while it was coming back
            target = self.held.pop(tid, None)
            if target is not None and instances[target].serving:
                instances[target].routes.append(row)
                instances[target].running[tid] = row
            else:
                self.queue.queue(row)
        self.noted[i] -= set(self.sent_aborts[i])  # delivered: they took effect or were undone in finished()
        lost = [t for t in self.sent_interrupts[i] if t in self.in_transit[i]]
        for tid in lost:  # neither returned nor reported finished: restart it from its prompt
            self.in_transit[i].discard(tid)
            row = inst.running.pop(tid, None)
            if row is not None:
                self.restart(row)
        return len(lost)

    def restart(self, row: Trajectory) -> None:
        """A trajectory whose instance lost it goes back to the TS from its prompt, with its group's V_traj."""
        target = self.held.pop(traj_id(row), None)
        if target is not None:
            self.coord.note_abort(target, [traj_id(row)])
        self.queue.queue(replace(row, completion_ids=[], behaviour_logprobs=[], versions_seen=[],
                                 version=self.queue.reserved[row.group_id]))

    def orphaned(self, inst, rows: list[Trajectory]) -> None:
        """A dead instance's trajectories: routes it never received go back to the TS as they are; the
        rest (generating, or interrupted and not returned) restart from their prompts."""
        queued = {traj_id(r) for r in inst.routes}
        self.in_transit[inst.index].clear()
        self.noted[inst.index].clear()
        for row in rows:
            if traj_id(row) in queued:
                self.queue.queue(row)
            else:
                self.restart(row)


def _idle(inst) -> bool:
    """Nothing generating or waiting on the instance at its last report, and nothing queued for it."""
    snap = inst.snapshot
    return not inst.routes and not inst.interrupts and not inst.pull and (
        snap is None or not (snap.run_trajs or snap.wait_trajs or snap.env_trajs))
