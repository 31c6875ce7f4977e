"""The rollout coordinator inside `rlflow run`: driver state -> Snapshot -> Algorithm 1 -> step commands.

StaleFlow runs a snapshot -> command cycle (staleflow.txt §5.2, Algorithm 1) over a trajectory server
(TS), a parameter server and the rollout instances; operators/coordinator.py is that cycle as pure
Python, and the simulator drives it (rlflow/sim/fleet.py CoordinatedFleet). This module drives the same
Coordinator from the Ray driver:

- The TS is kept here, in the driver: initial groups drawn from the prompts (no V_traj; the routing
  strategy reserves a group with the staleness policy when it routes its first member, Algorithm 2 and
  §5.1), members of reserved groups not routed yet, and partial trajectories returned by an Interrupt.
  Like the simulator, it holds one batch of initial groups (B groups) at a time.
- Snapshots are exact. A RolloutWorker changes only inside its `step` call, so a cycle runs at a step
  barrier: when a cycle is due, instances that return a step are held until every alive one has
  returned; the snapshot is then their last step's report plus the commands still queued for them
  (routes not delivered yet, aborts not delivered yet), and every command the cycle issues is applied
  at the start of the next step, before any token is generated (the worker applies pull, abort,
  interrupt, route in that order). A barrier costs at most one step of idle time per instance.
- A cycle is due every `interval_s` (the plan's snapshot period), and as soon as an instance that had
  work has run out of it, so a drained instance does not idle until the next period.
- Commands become step arguments: Route -> Instance.routes, Interrupt -> Instance.interrupts, Pull ->
  Instance.pull. An interrupted trajectory comes back with the step's result; a Route issued for it in
  the same cycle waits for it ("keeping data pending", §5.2) and is queued for its instance then.
- The speculative state P (Table 1, Eq. 1) validates every snapshot. Aborts issued by the staleness
  side (group redundancy surplus, policy evictions) lower P when issued; one that loses the race with
  the trajectory finishing is undone when the finish is reported. The engines count completions since
  start, not since the last pull, so complete_trajs is taken relative to the count when a Pull was
  delivered. With exact snapshots every cycle should validate; if several in a row do not (vLLM keeps
  generating between steps, so its snapshots are only nearly current), P is re-read from the snapshot
  and the event logged and counted, so coordination never stalls.

Partial trajectories keep their oldest V_traj: the engine stamps the first token's version and keeps
the minimum when a trajectory resumes (stages/engine.py begin_segment); a partial trajectory is only
routed to an instance on that version or newer (Algorithm 2), and a group's members are launched with
the group's reserved V_traj, so staleness is measured as in the least-loaded path.
"""

from __future__ import annotations

from dataclasses import replace

from rlflow.operators.commands import Interrupt, Pull, Route
from rlflow.operators.coordinator import Coordinator
from rlflow.operators.policy import InvariantViolation
from rlflow.operators.routing import CostModel
from rlflow.operators.snapshot import InstanceSnapshot, Snapshot, TrajView
from rlflow.sim.from_plan import PlanCoordination, load_profile, plan_coordination
from rlflow.stages.trajectory import member_id

COUNTS = ("coord_cycles", "coord_rejected", "coord_resyncs", "coord_routed", "coord_interrupted", "coord_pulls")
RESYNC_AFTER = 3  # consecutive rejected snapshots before P is re-read from the snapshot


def traj_id(row: dict) -> str:
    """The id of a routed row (a trajectory's payload as the driver holds it)."""
    return member_id(row["group_id"], row["index"])


class RuntimeCoordinator:
    """Algorithm 1 over the driver's Instances; the driver calls the hooks below at each event."""

    def __init__(self, pc: PlanCoordination, cost: CostModel, instances, counts: dict, log=print):
        self.pc, self.log = pc, log
        self.interval_s = pc.interval_s
        self.cost = cost
        self.coord = Coordinator(len(instances), pc.config(), cost=cost)
        for inst in instances:  # a resumed run starts by pulling the restored version
            self.coord.P.inst_version[inst.index] = inst.pull[0] if inst.pull else inst.version
        self.ts: dict[str, tuple[TrajView, dict]] = {}  # tid -> (what the coordinator sees, the row to route)
        self.initial: dict[str, list[str]] = {}  # unreserved groups in the TS: gid -> member tids
        self.reserved: dict[str, int] = {}  # open group -> reserved V_traj
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
        self._rejected_in_row = 0
        self.counts = counts
        for k in COUNTS:
            counts.setdefault(k, 0)

    @classmethod
    def from_plan(cls, plan: dict, instances, counts: dict, log=print) -> tuple[RuntimeCoordinator | None, list[str]]:
        """The coordinator the plan selects (None when the least-loaded path covers it), and notes to print.

        The cost model is the plan's profile (the simulator's default one, said in a note, when the plan
        names none); its engine cap is the rollout stage's max_running when that is lower.
        """
        pc = plan_coordination(plan)
        notes: list[str] = []
        if pc.vanilla:  # least-loaded routing, global / per-instance sync, no migration: the driver's own path
            return None, notes
        rollout = next(s for s in plan["pipeline"]["stages"].values() if s["kind"] == "rollout")
        prof = load_profile(pc.profile, notes, hint="set the rollout stage's coordinator.profile to change")
        cost = CostModel.from_profile(prof)
        cost = replace(cost, max_running=min(cost.max_running or rollout["max_running"], rollout["max_running"]))
        return cls(pc, cost, instances, counts, log), notes

    def describe(self) -> str:
        pc = self.pc
        sync = pc.sync + (" with partial rollout" if pc.partial_rollout and pc.sync == "global" else "")
        return (f"rollout coordinator (staleflow §5.2): routing={pc.routing} sync={sync} migration={pc.migration}; "
                f"a cycle every {pc.interval_s:g}s, or as soon as an instance runs out of work")

    # ------------------------------------------------------------------ the trajectory server
    @property
    def initial_groups(self) -> int:
        return len(self.initial)

    def initial_prompts(self) -> dict[str, str]:
        """Unreserved groups in the TS: gid -> prompt text (what skew-aware dispatch ranks)."""
        return {gid: self.ts[tids[0]][1]["prompt"] for gid, tids in self.initial.items()}

    def add_group(self, gid: str, rows: list[dict]) -> None:
        """An initial group drawn from the prompts: no V_traj until routing reserves it (§5.1)."""
        self.initial[gid] = [traj_id(r) for r in rows]
        for row in rows:
            self.ts[traj_id(row)] = (TrajView(traj_id(row), gid, None, _tokens(row)), row)

    def _queue(self, row: dict) -> None:
        """A reserved group's member back in the TS; a partial one keeps its oldest V_traj."""
        gid = row["group_id"]
        v_traj = row["version"] if row["completion_ids"] else self.reserved[gid]
        self.ts[traj_id(row)] = (TrajView(traj_id(row), gid, v_traj, _tokens(row)), row)

    def _reserve(self, reserve):
        def on_reserve(gid, version: int) -> None:
            reserve(gid, version)  # the staleness policy and the group assembler (driver)
            self.reserved[gid] = version
            for tid in self.initial.pop(gid):
                view, row = self.ts[tid]
                view.v_traj = row["version"] = version
        return on_reserve

    def forget_group(self, gid: str) -> set[str]:
        """The group is done or evicted: its members still in the TS are not needed any more; returns them."""
        self.reserved.pop(gid, None)
        gone = {t for t, (view, _) in self.ts.items() if view.gid == gid}
        for tid in gone:
            del self.ts[tid]
        return gone

    # ------------------------------------------------------------------ the cycle
    def due(self, now: float, instances) -> bool:
        """A cycle is due every interval_s, and as soon as an instance that had work has run out of it
        (a drained instance asks for work at once instead of idling until the next period)."""
        return now >= self.next_cycle or any(
            i.alive and i.ref is None and _idle(i) and i.index not in self.idle_after_cycle for i in instances)

    def cycle(self, instances, ps_version: int, ps_ref, verify, reserve, launch, dispatch=None) -> list | None:
        """Algorithm 1 on an exact snapshot (every alive instance between two steps); commands go to the Instances.

        verify / reserve: the staleness policy (Algorithm 2); launch(row): a member leaves the TS for the first time.
        dispatch (skew-aware, rlflow/runtime/dispatch.py): routing runs once per lane, the TS in LPT order,
        and every Route is checked against its trajectories' lanes before it is carried out.
        """
        alive = [i for i in instances if i.alive]
        views = [view for view, _ in self.ts.values()]
        lanes = split = None
        if dispatch is not None:
            views.sort(key=lambda v: dispatch.rank.get(v.gid, len(dispatch.rank)))
            split = dispatch.lanes([i.index for i in alive])
            lanes = [((lambda v, lane=lane: dispatch.lane(v.gid) == lane), insts) for lane, insts, _ in split]
        snap = Snapshot([self._snapshot(i) for i in alive], views, ps_version)
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
        return cmds

    def held_for(self, idx: int) -> int:
        """Routes to instance `idx` waiting for their interrupted trajectories to come back."""
        return sum(1 for target in self.held.values() if target == idx)

    def _snapshot(self, inst) -> InstanceSnapshot:
        """The instance as its next step will find it: last report, minus queued aborts, plus queued routes."""
        i = inst.index
        snap = inst.snapshot or {"version": inst.version, "kv_cache": 0, "run_trajs": [], "wait_trajs": [],
                                 "complete_trajs": 0}
        aborted = set(inst.aborts)
        per = snap["kv_cache"] / len(snap["run_trajs"]) if snap["run_trajs"] else 0.0  # KV tokens of each running one

        def view(tid: str, tokens: float | None = None) -> TrajView:
            row = inst.running.get(tid)
            if row is None:
                raise InvariantViolation(f"instance {i} reports trajectory {tid}, which the driver did not route there")
            return TrajView(tid, row["group_id"], row["version"], _tokens(row) if tokens is None else tokens)

        run = [view(t, per) for t in snap["run_trajs"] if t not in aborted]
        wait = [view(t) for t in snap["wait_trajs"] if t not in aborted]
        kv = per * len(run)
        for row in inst.routes:  # queued routes: admitted at the next step if the engine has room
            v = TrajView(traj_id(row), row["group_id"], row["version"], _tokens(row))
            if len(run) < self.cost.max_running:
                run.append(v)
                kv += v.tokens
            else:
                wait.append(v)
        version = inst.pull[0] if inst.pull else snap["version"]
        complete = 0 if inst.pull else snap["complete_trajs"] - self.complete_base[i]
        return InstanceSnapshot(i, self.cost.k5 * kv, run, wait, complete, version, self.kv_prev[i])

    def _interrupt(self, inst, tids: list[str]) -> None:
        queued = {traj_id(r): r for r in inst.routes}
        for tid in tids:
            self.counts["coord_interrupted"] += 1
            if tid in queued:  # never delivered: straight back to the TS
                inst.routes.remove(queued[tid])
                self._queue(inst.running.pop(tid))
            else:
                inst.interrupts.append(tid)
                self.in_transit[inst.index].add(tid)

    def _route(self, inst, tids: list[str], launch) -> None:
        version = self.coord.P.inst_version[inst.index]  # what the instance will run when the route arrives
        for tid in tids:
            self.counts["coord_routed"] += 1
            if tid not in self.ts:
                if not any(tid in s for s in self.in_transit):
                    raise InvariantViolation(f"the coordinator routed {tid}, which is neither in the TS nor interrupted")
                self.held[tid] = inst.index  # queued when the worker returns it
                continue
            _, row = self.ts.pop(tid)
            if not row["completion_ids"]:
                row["version"] = version  # a fresh trajectory's V_traj is its first token's (stamped by the engine)
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
            self.complete_base[i] = inst.snapshot["complete_trajs"] if inst.snapshot else 0
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

    def drop(self, tid: str) -> None:
        """An aborted trajectory waiting in the TS."""
        self.ts.pop(tid, None)

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

    def returned(self, inst, rows: list[dict], instances) -> int:
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
            if target is not None and instances[target].alive:
                instances[target].routes.append(row)
                instances[target].running[tid] = row
            else:
                self._queue(row)
        self.noted[i] -= set(self.sent_aborts[i])  # delivered: they took effect or were undone in finished()
        lost = [t for t in self.sent_interrupts[i] if t in self.in_transit[i]]
        for tid in lost:  # neither returned nor reported finished: restart it from its prompt
            self.in_transit[i].discard(tid)
            row = inst.running.pop(tid, None)
            if row is not None:
                self.restart(row)
        return len(lost)

    def restart(self, row: dict) -> None:
        """A trajectory whose instance lost it goes back to the TS from its prompt, with its group's V_traj."""
        target = self.held.pop(traj_id(row), None)
        if target is not None:
            self.coord.note_abort(target, [traj_id(row)])
        self._queue({**row, "completion_ids": [], "behaviour_logprobs": [], "versions_seen": [],
                     "version": self.reserved[row["group_id"]]})

    def orphaned(self, inst, rows: list[dict]) -> None:
        """A dead instance's trajectories: routes it never received go back to the TS as they are; the
        rest (generating, or interrupted and not returned) restart from their prompts."""
        queued = {traj_id(r) for r in inst.routes}
        self.in_transit[inst.index].clear()
        self.noted[inst.index].clear()
        for row in rows:
            if traj_id(row) in queued:
                self._queue(row)
            else:
                self.restart(row)


def _idle(inst) -> bool:
    """Nothing generating or waiting on the instance at its last report, and nothing queued for it."""
    snap = inst.snapshot
    return not inst.routes and not inst.interrupts and not inst.pull and (
        snap is None or not (snap["run_trajs"] or snap["wait_trajs"]))


def _tokens(row: dict) -> float:
    """KV tokens a trajectory brings: prompt + generated so far."""
    return float(len(row["prompt_ids"]) + len(row["completion_ids"]))
