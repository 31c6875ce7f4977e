"""One rollout stage of the plan: its instances, the coordinator that routes to them, its task types.

Prompts of the stage's tasks are drawn from the prompt source into the coordinator's trajectory server
(one batch of groups ahead, StaleFlow §5.1). Every routing and weight-sync decision is a coordinator
cycle (operators/coordinator.py, Algorithm 1) — vanilla least-loaded routing with global or per-instance
sync included, so there is one routing path. The commands travel in each instance's next step call
(rollout_worker.py). When every member of a group has finished, the group goes to its task's reward
stage through the payload store, and the buffer learns its V_traj.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import ray

from rlflow.errors import RunFailed
from rlflow.operators.groups import GroupAssembler
from rlflow.plan_model import Plan, RolloutActor
from rlflow.plan_read import stage_coordination
from rlflow.runtime.dispatch_lanes import DispatchLanes
from rlflow.runtime.messages import Joined, Prompt, Started, StepDone, StepReport
from rlflow.runtime.model_shipping import ship_model
from rlflow.runtime.parameter_server import verify_loaded
from rlflow.runtime.rollout_coordinator import RolloutCoordinator
from rlflow.runtime.rollout_worker import RolloutWorker
from rlflow.runtime.trajectory_server import traj_id
from rlflow.stages.engine import EngineSnapshot
from rlflow.stages.trajectory import Trajectory, member_id


@dataclass
class RolloutInstance:
    """The driver's view of one rollout instance (a RolloutWorker actor)."""

    index: int
    handle: object
    version: int = 0
    alive: bool = True
    ref: object = None  # the outstanding step call
    routes: list = field(default_factory=list)  # commands for the next step
    aborts: list = field(default_factory=list)
    interrupts: list = field(default_factory=list)  # traj ids to hand back (coordinator Interrupt)
    pull: object = None  # (version, parameter_server.Published) to load at the next step
    pulling: object = None  # the Published the outstanding step loads (its report is checked against it)
    sleep: int = 0  # a level to sleep at after the next step, if idle (colocated with the trainer: sleep_idle)
    asleep: int = 0  # the level its engine sleeps at, as of its last report
    snapshot: EngineSnapshot | None = None  # the engine's, at the end of its last step
    running: dict = field(default_factory=dict)  # traj_id -> routed Trajectory (kept to re-route on failure)
    idle: bool = True  # the engine had nothing left at its last report
    reported_t: float = 0.0  # when its last report arrived (time.monotonic(); 0: none yet)
    busy_s: float = 0.0  # seconds generating or loading weights
    step_s: float = 0.0  # seconds in engine.step alone (decoding; no weight loads)
    finished_tokens: int = 0  # completion tokens of the trajectories it finished (eos included)
    finished: int = 0  # trajectories it finished (the elastic monitor's rate)
    # elastic rollout (runtime/scaling.py): an added instance is `starting` until its actor is ready; a removed one
    # is `retiring` while its trajectories go back to the TS, then ends (alive False)
    starting: bool = False
    retiring: bool = False
    deadline: float = 0.0  # a starting instance is given up after this (time.monotonic())
    joined_t: float | None = None  # when it started serving, and when it stopped (instance-seconds for idle ratios)
    left_t: float | None = None

    @property
    def serving(self) -> bool:
        """Takes part in coordinator cycles: alive, and not leaving."""
        return self.alive and not self.retiring

    def has_work(self) -> bool:
        return bool(self.routes or self.aborts or self.interrupts or self.pull or self.sleep or not self.idle)


class RolloutFleet:
    """A rollout stage's instances, group assembly and coordinator."""

    def __init__(self, plan: dict | Plan, stage: str, *, model_dir: str, store, buffer, prompts, ledger, counts: dict,
                 log=print):
        self.stage, self.store, self.buffer, self.prompts, self.counts, self.log = stage, store, buffer, prompts, counts, log
        self.ledger = ledger
        self.measured = None  # sim_inputs.SimInputs: the run's own measurements for `rlflow profile` (run_setup sets it)
        plan = Plan.of(plan)
        actors = plan.rollouts(stage)
        self.spec = actors[0]
        self.tasks = list(self.spec.tasks)
        self.reward_stage = {t: plan.tasks[t].reward for t in self.tasks}
        self.group_size = self.spec.group_size
        self.members = self.group_size + self.spec.group_redundancy  # trajectories launched per group
        self.batch_groups = plan.staleness.batch_size
        self.model = ship_model(model_dir)  # the model via the object store, for every instance (added ones too)
        self.elastic = self.spec.elastic  # None: always the plan's instances
        self.t0 = time.monotonic()
        self.gateway, self.episode = None, self.spec.episode
        if self.episode and self.episode.get("agent"):  # agents roll out through an endpoint (agent_gateway.py)
            from rlflow.runtime.agent_gateway import start_gateway

            self.gateway, name, url = start_gateway(self.episode, stage, plan.model["path"])
            self.episode = {**self.episode, "gateway": name}
            log(f"rollout stage {stage}: agents' OpenAI endpoint at {url}/episodes/<episode id>/v1")
        self.instances = [RolloutInstance(a.index, self._spawn(a), joined_t=self.t0) for a in actors]
        self.assembler = GroupAssembler(self.group_size, self.spec.group_redundancy)
        pc = stage_coordination(plan, stage)
        rollout = self.spec.engine_kwargs | {"group_size": self.group_size, "group_redundancy": self.spec.group_redundancy}
        self.coordination = RolloutCoordinator.for_stage(pc, rollout, self.instances, counts, log=log)
        self.dispatch = DispatchLanes.for_stage(pc, rollout, batch_groups=self.batch_groups,
                                                  max_model_len=self.spec.engine_kwargs["max_model_len"],
                                                  counts=counts, log=log)
        self.replay: list[Prompt] = []  # prompts drawn but not trained before a resumed checkpoint: drawn first
        self.lengths: dict[str, int] = {}  # completion tokens per finished trajectory, until trained
        self.timeline: list[tuple] = []  # (seconds, instance, running) for the load plot
        self.pull_s = 0.0
        self.verified: list[tuple[int, int]] = []  # (instance, version) of every pull whose load was verified
        self.sleeps: list[dict] = []  # every time an instance went to sleep: instance, level, bytes freed, held before
        self.ps = (0, None)  # the PS's (version, ref) at the last cycle: what an instance that joins loads first
        for k in ("rerouted", "aborted_trajectories") + (("engine_sleeps", "engine_sleep_freed_mb") if self.spec.sleep_level else ()):
            counts.setdefault(k, 0)
        self.episodic = "episode" in self.spec  # multi-turn (runtime/episodes.py): count turns and environment waits
        if self.episodic:
            for k in ("episodes", "episode_turns", "env_tokens", "env_wait_s"):
                counts.setdefault(k, 0)

    def _spawn(self, a: RolloutActor):
        opts = dict(num_cpus=a.num_cpus, num_gpus=a.num_gpus, resources=a.resources)
        return RolloutWorker.options(**opts).remote(a.engine, self.model, a.index, a.engine_kwargs, self.store, self.episode,
                                                    threads=(a.threads, a.threads_share))

    def ready_refs(self) -> list:
        return [i.handle.ready.remote() for i in self.instances]

    def start_at(self, version: int, ref) -> None:
        """A resumed run: every instance loads the restored version first."""
        self.ps = (version, ref)
        for inst in self.instances:
            inst.pull, inst.version = (version, ref), version
            self.coordination.coord.P.inst_version[inst.index] = version

    # ------------------------------------------------------------------ prompts -> the TS
    def _draw(self) -> tuple[str, list[Trajectory]]:
        """A prompt's group for the TS: one Trajectory per member, nothing generated yet."""
        p = self.replay.pop(0) if self.replay else self.prompts.next(self.tasks)
        gid = p.group_id
        self.ledger.drawn(gid, p)
        return gid, [Trajectory(group_id=gid, index=m, prompt=p.prompt, answer=p.answer, prompt_ids=p.prompt_ids,
                                task=p.task, row=p.row) for m in range(self.members)]

    def _top_up(self) -> None:
        """Keep one batch of groups drawn ahead but not routed (§5.1: the TS samples prompts ahead).
        Skew-aware dispatch (Algorithm 2) re-plans over them when new ones arrive or the ranker learned."""
        ts, drawn = self.coordination.queue, False
        while ts.initial_groups < self.batch_groups:
            ts.add_group(*self._draw())
            drawn = True
        if self.dispatch is not None and (drawn or self.dispatch.dirty):
            prompts = {r.group_id: r.prompt for r in ts.initial_rows()}
            self.dispatch.plan(prompts, self.serving_count())

    # ------------------------------------------------------------------ the coordinator cycle
    def next_cycle_in(self, now: float) -> float:
        """Seconds until a cycle is due (0: now)."""
        c = self.coordination
        return 0.0 if c.holding or c.due(now, self.instances) else max(0.0, c.next_cycle - now)

    def coordinate(self, ps_version: int, ps_ref) -> None:
        """One cycle (StaleFlow §5.2) on an exact snapshot, when one is due: instances that return are
        held until every alive one has, then sync, migration and routing commands are queued for them."""
        c, now = self.coordination, time.monotonic()
        self.ps = (ps_version, ps_ref)
        if self.elastic:
            self._tend(now)
        if not c.holding and not c.due(now, self.instances):
            return
        c.holding = True
        if any(i.ref is not None for i in self.instances if i.serving):
            return  # wait for every instance to finish its step
        self._top_up()
        c.cycle(self.instances, ps_version, ps_ref, self.buffer.verify, self._reserve, self._launch, dispatch=self.dispatch)
        c.holding = False
        c.next_cycle = now + c.interval_s

    def _reserve(self, gid: str, version: int) -> None:
        """Routing reserves a group with the staleness policy when it routes its first member (Algorithm 2)."""
        self.buffer.reserve(gid, version)
        self.ledger.state(gid, "routed", version)
        self.assembler.open(gid, version)
        if self.dispatch is not None:
            self.dispatch.routed(gid)

    def _launch(self, row: Trajectory) -> None:
        gid, tid = row.group_id, traj_id(row)
        if tid not in self.assembler.running(gid):
            self.assembler.launch(gid, tid, self.coordination.queue.reserved[gid])

    def send(self) -> list[Started]:
        """Issue a step call to every alive instance that has work or commands (none while a cycle holds); returns
        the calls, for the driver to wait on."""
        started: list[Started] = []
        if self.coordination.holding:
            return started
        for inst in self.instances:
            if inst.alive and inst.ref is None and inst.has_work():
                if inst.asleep and inst.routes and inst.pull is None and self.ps[1] is not None:
                    inst.pull = self.ps  # an engine woken to generate loads the current version first
                self.coordination.sent(inst)
                if inst.routes and inst.idle and inst.reported_t and self.measured is not None:
                    # an idle engine gets work: seconds since it could have (its report, or the policy's change)
                    self.measured.routed_idle(time.monotonic() - max(inst.reported_t, self.coordination.cycle_poke_t))
                inst.ref = inst.handle.step.remote(inst.routes, inst.aborts, inst.interrupts, inst.pull, inst.sleep)
                inst.pulling = inst.pull[1] if inst.pull else None
                inst.routes, inst.aborts, inst.interrupts, inst.pull, inst.sleep = [], [], [], None, 0
                started.append(Started(inst.ref, StepDone(self, inst)))
        return started

    def sleep_idle(self) -> list[Started]:
        """A train step starts on a device this stage shares with the trainer (the plan's sleep_level): every idle
        instance is told to sleep, in its next step call, if it is still idle then. It wakes at its next pull.
        Returns the step calls sent (`send`)."""
        level = self.spec.sleep_level
        if not level:
            return []
        for inst in self.instances:
            if inst.serving and inst.idle and not inst.asleep and not inst.routes:
                inst.sleep = level
        return self.send()

    def outstanding(self) -> list[str]:
        return [f"{self.stage} instance {i.index} step" for i in self.instances if i.ref is not None]

    # ------------------------------------------------------------------ results
    def on_step(self, inst: RolloutInstance, report: StepReport) -> None:
        inst.ref, inst.reported_t = None, time.monotonic()
        if inst.pulling is not None:  # verified delivery: the engine holds exactly the version it was sent
            verify_loaded(self.stage, inst.index, inst.pulling, report.loaded)
            self.verified.append((inst.index, inst.pulling.version))
            inst.pulling = None
        inst.busy_s += report.busy_s + report.pull_s
        inst.step_s += report.busy_s
        inst.finished_tokens += sum(meta.tokens for meta in report.finished)
        inst.finished += len(report.finished)
        inst.idle = report.idle
        if report.asleep and not inst.asleep:
            self.sleeps.append({"instance": inst.index, "level": report.asleep, "freed": report.slept_freed,
                                "held": report.held})
            self.counts["engine_sleeps"] += 1
            self.counts["engine_sleep_freed_mb"] += report.slept_freed / 2**20
        inst.asleep = report.asleep
        snap = report.snapshot
        if self.measured is not None:
            self.measured.engine_step(self.stage, inst.index, snap, report.busy_s, report.pull_s, report.idle)
        inst.version, inst.snapshot = snap.version, snap
        self.timeline.append((time.monotonic() - self.t0, inst.index, len(snap.run_trajs)))
        self.pull_s += report.pull_s
        if self.episodic:
            self._count_episodes(report)
        completed: dict[str, list[list[str]]] = {}  # reward stage -> members of each group this report completed
        for meta in report.finished:
            tid = member_id(meta.group_id, meta.index)
            self.lengths[tid] = meta.tokens
            self.ledger.finished(tid, meta.group_id, meta.version, meta.tokens)
            self.coordination.finished(inst, tid)
            if inst.running.pop(tid, None) is None:
                continue  # finished after we aborted it: the store's copy is discarded with the abort
            gid = meta.group_id
            if gid not in self.assembler:
                self.store.discard.remote([tid])
                continue
            done = self.assembler.finish(gid, tid)
            if done is not None:
                stage, members = self._group_done(gid, done)
                completed.setdefault(stage, []).append(members)
        for stage, groups in completed.items():  # one bundle down each reward stream (payload_store.enqueue_groups)
            self.store.enqueue_groups.remote(stage, groups)
        # partial rollouts back to the TS, or to the instance a Route waits with
        self.counts["rerouted"] += self.coordination.returned(inst, report.interrupted, self.instances)

    def _count_episodes(self, report: StepReport) -> None:
        """Turns, environment tokens and environment time of the episodes that ended; trajectories now waiting on
        an environment (the snapshot's env_trajs) per instance."""
        for meta in report.finished:
            self.counts["episodes"] += 1
            self.counts["episode_turns"] += meta.turns
            self.counts["env_tokens"] += meta.env_tokens
            self.counts["env_wait_s"] += meta.env_s
        self.counts[f"env_waiting_{self.stage}_{report.instance}"] = len(report.snapshot.env_trajs)

    def _group_done(self, gid: str, done) -> tuple[str, list[str]]:
        """A group's last member finished: (its reward stage, the members to score); the caller enqueues them."""
        self._abort_members(done.surplus)
        unrouted = self.coordination.queue.forget_group(gid)  # members never routed leave the TS (no payload)
        ids = (member_id(gid, m) for m in range(self.members))
        members = [t for t in ids if t not in done.surplus and t not in unrouted]
        self.buffer.completed(gid, done.version)
        if self.measured is not None:
            self.measured.group_completed(gid)
        self.ledger.state(gid, "generated", done.version)
        task = gid.rsplit("-", 1)[0]
        if self.dispatch is not None:  # the ranker learns the prompt's completion length
            self.dispatch.completed(gid, [self.lengths[t] for t in members if t in self.lengths])
        return self.reward_stage[task], members

    def abort_group(self, gid: str) -> bool:
        """The buffer evicted a group still generating (e.g. batch-redundancy surplus); False if not ours."""
        if gid not in self.assembler:
            return False
        if self.dispatch is not None:
            self.dispatch.forget(gid)
        self._abort_members(self.assembler.abort(gid))
        self.coordination.queue.forget_group(gid)
        self.ledger.state(gid, "aborted")
        return True

    def _abort_members(self, traj_ids) -> None:
        traj_ids = list(traj_ids)
        for tid in traj_ids:
            for inst in self.instances:
                if inst.running.pop(tid, None) is not None and self.coordination.abort(inst, tid):
                    inst.aborts.append(tid)
            self.coordination.queue.drop(tid)  # a partial one waiting in the TS
            self.counts["aborted_trajectories"] += 1
        self.ledger.trajectories(traj_ids, "aborted")
        self.store.discard.remote(list(traj_ids))

    def on_death(self, inst: RolloutInstance, err: Exception) -> None:
        """A dead instance's trajectories go back to the TS; the next cycle routes them to the others."""
        inst.alive, inst.ref, inst.left_t = False, None, time.monotonic()
        self.log(f"rollout instance {self.stage}-{inst.index} died ({type(err).__name__}); "
                 f"re-routing its {len(inst.running)} trajectories")
        if not any(i.alive for i in self.instances):  # a lost node, most often: a named stop, not a bug in rlflow
            raise RunFailed(f"every instance of rollout stage '{self.stage}' has died (the last: {type(err).__name__}; "
                            "a lost node, or an engine that crashed: see the Ray logs above), so nothing can generate "
                            "its tasks; rlflow run --resume continues from the checkpoint the run saves now, once the "
                            "cluster can place the stage again")
        orphans, inst.running = list(inst.running.values()), {}
        self.coordination.orphaned(inst, orphans)
        inst.routes, inst.aborts, inst.interrupts, inst.pull = [], [], [], None
        self.counts["rerouted"] += len(orphans)

    # ------------------------------------------------------------------ elastic rollout (runtime/scaling.py)
    def serving_count(self) -> int:
        return sum(i.serving for i in self.instances)

    def scale_to(self, n: int, submit) -> str:
        """Start or retire instances until n serve; returns what it did. Instances still starting count as
        serving-to-be; retiring picks those still starting first, then the newest serving ones. `submit` (the
        driver's Run._submit) takes each new instance's ready() call as a Started with a Joined event."""
        starting = [i for i in self.instances if i.starting]
        serving = [i for i in self.instances if i.serving]
        now = len(serving) + len(starting)
        if n > now:
            added = [self._add(submit) for _ in range(n - now)]
            return f"starting instance(s) {', '.join(str(i.index) for i in added)}"
        if self.dispatch is not None:
            self.dispatch.dirty = True  # skew-aware dispatch re-plans its lanes over the instances that will serve
        leaving = (starting[::-1] + serving[::-1])[:now - n]
        for inst in leaving:
            if inst.starting:
                inst.starting = False
                ray.kill(inst.handle)
            else:
                inst.retiring = True
        return f"retiring instance(s) {', '.join(str(i.index) for i in leaving)}" if leaving else "nothing to do"

    def _add(self, submit) -> RolloutInstance:
        index = self.coordination.add_instance()
        a = self.spec.model_copy(update={"index": index, "name": f"{self.stage}-{index}"})
        inst = RolloutInstance(index, self._spawn(a), alive=False, starting=True,
                               deadline=time.monotonic() + self.elastic["start_timeout_s"])
        self.instances.append(inst)
        submit(Started(inst.handle.ready.remote(), Joined(self, inst)))
        return inst

    def on_joined(self, inst: RolloutInstance, error: Exception | None) -> None:
        """An added instance's actor is ready (or failed to start): it loads the PS's version, then takes work."""
        if not inst.starting:
            return  # given up (timed out, or scaled back down) before it was ready
        inst.starting = False
        if error is not None:
            self.log(f"rollout instance {self.stage}-{inst.index} failed to start ({type(error).__name__}: {error}); "
                     "not added")
            return
        inst.alive, inst.joined_t = True, time.monotonic()
        if self.dispatch is not None:
            self.dispatch.dirty = True
        inst.pull, inst.version = self.ps, self.ps[0]
        self.coordination.joined(inst)
        self.log(f"rollout instance {self.stage}-{inst.index} joined; loading weights version {self.ps[0]}; "
                 f"{self.serving_count()} serving")

    def _tend(self, now: float) -> None:
        """Give up instances that did not start in time; retiring ones hand their work back, then end."""
        for inst in self.instances:
            if inst.starting and now > inst.deadline:
                inst.starting = False
                ray.kill(inst.handle)
                a = self.spec
                self.log(f"rollout instance {self.stage}-{inst.index} did not start within "
                         f"{self.elastic['start_timeout_s']:g} s: Ray could not place an actor needing {a['num_cpus']:g} "
                         f"CPU, {a['num_gpus']:g} GPU{', ' + str(a['resources']) if a.get('resources') else ''} "
                         "(a cluster autoscaler adds nodes for such requests; without one, add a node with "
                         "`ray start --address`); not added")
            elif inst.retiring and inst.alive and inst.ref is None:
                if self.coordination.release(inst):
                    continue  # its next step returns them
                if not inst.running and not inst.interrupts and not inst.routes and not inst.aborts:
                    inst.alive, inst.retiring, inst.left_t = False, False, now
                    ray.kill(inst.handle)
                    self.log(f"rollout instance {self.stage}-{inst.index} left; {self.serving_count()} serving")

    def instance_s(self) -> float:
        """Instance-seconds served so far (rollout idle ratios divide busy seconds by this)."""
        now = time.monotonic()
        return sum((i.left_t or now) - i.joined_t for i in self.instances if i.joined_t is not None)

    def counters(self) -> dict[int, tuple[float, int]]:
        """Serving instances' (busy seconds, trajectories finished): the elastic monitor's input."""
        return {i.index: (i.busy_s, i.finished) for i in self.instances if i.serving}

    def busy_s(self) -> float:
        return sum(i.busy_s for i in self.instances)

    def decode_rate(self) -> tuple[int, float]:
        """(completion tokens finished, seconds in engine.step) over the instances: their ratio is the engines'
        tokens/s while decoding, comparable with benchmarks/bench_engines.py's bare loop (the same count: finished
        completions, eos included; tokens of aborted or interrupted trajectories are not counted)."""
        return sum(i.finished_tokens for i in self.instances), sum(i.step_s for i in self.instances)
