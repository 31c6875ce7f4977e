"""`rlflow run`: the Ray executor of a plan. The control plane (staleness policy, group assembly,
routing and weight sync decisions) runs here, in the driver, as plain Python; the heavy work runs in
actors (ARCHITECTURE.md §4).

One loop iteration: apply finished rollout chunks -> apply rewarded groups from the Ray Data stream
-> start a training step if a batch is ready -> admit and route new groups -> issue the next step
command to every idle instance. Invariants are checked after every consume (ARCHITECTURE.md §5).

Routing and weight sync take one of two paths. Least-loaded routing with global or per-instance sync
and no migration (the vanilla strategies) is `_admit` + `_sync` below. Anything else the plan's
coordination selects (cost-model routing, throughput-aware sync, threshold / repack migration) runs
StaleFlow's rollout coordinator (staleflow.txt §5.2, Algorithm 1) through rlflow/runtime/coordination.py:
`_coordinate` replaces admission, routing and sync, and its Route / Interrupt / Pull commands travel in
the instances' step calls.
"""

from __future__ import annotations

import json
import math
import queue
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import ray

from rlflow.operators.groups import GroupAssembler
from rlflow.operators.policy import InvariantViolation
from rlflow.operators.registry import make_policy
from rlflow.runtime import stream
from rlflow.runtime.coordination import RuntimeCoordinator, traj_id
from rlflow.runtime.data import read_prompts, tokenize_prompts
from rlflow.runtime.dispatch import RuntimeDispatch
from rlflow.runtime.servers import ParameterServer, TrajectoryServer
from rlflow.runtime.workers import RolloutWorker, TrainerWorker
from rlflow.sim.from_plan import plan_coordination
from rlflow.stages.trajectory import member_id

STATE_FILE = "state.json"


@dataclass
class Instance:
    """The driver's view of one rollout instance."""

    index: int
    handle: object
    version: int = 0
    alive: bool = True
    ref: object = None  # the outstanding step call
    routes: list = field(default_factory=list)  # commands for the next step
    aborts: list = field(default_factory=list)
    interrupts: list = field(default_factory=list)  # traj ids to hand back (coordinator Interrupt)
    pull: object = None  # (version, [ref]) to load at the next step
    snapshot: dict | None = None  # the worker's report at the end of its last step
    draining: bool = False  # waits for its running work to finish before pulling (no partial rollout)
    running: dict = field(default_factory=dict)  # traj_id -> routed row (kept to re-route on failure)
    busy_s: float = 0.0

    @property
    def load(self) -> int:
        return len(self.running)


class Run:
    """Executes one plan; `run()` returns the per-step history."""

    def __init__(self, plan: dict, *, out_dir: Path, resume: bool = False, log=print):
        self.plan, self.out_dir, self.resume, self.log = plan, Path(out_dir), resume, log
        p = plan["pipeline"]
        self.rollout_name = next(n for n, s in p["stages"].items() if s["kind"] == "rollout")
        self.reward_name = next(n for n, s in p["stages"].items() if s["kind"] == "reward")
        self.train_name = next(n for n, s in p["stages"].items() if s["kind"] == "train")
        self.rollout, self.train = p["stages"][self.rollout_name], p["stages"][self.train_name]
        self.coord = plan["control"]["coordination"][self.rollout_name]
        self.control = dict(plan["control"]["staleness"])
        self.eta = self.control["eta"]
        self.group_size = self.rollout["group_size"]
        self.members = self.group_size + self.rollout["group_redundancy"]  # trajectories launched per group
        self.stop_requested = False
        self.history: list[dict] = []
        self.staleness_all: list[int] = []
        self.timeline: list[tuple] = []
        self.lengths: dict[str, int] = {}  # completion tokens per finished trajectory, until trained
        self.pull_s = 0.0
        self.recent_rewards: list[float] = []  # every scored trajectory since the last step, filtered or not
        self.counts = {"reward_failed": 0, "rerouted": 0, "filtered_groups": 0, "dropped_groups": 0, "aborted_trajectories": 0}
        self.coordination: RuntimeCoordinator | None = None  # set in _start when the plan selects the coordinator
        self.coordination_notes: list[str] = []
        self.dispatch: RuntimeDispatch | None = None  # set in _start when the plan selects skew-aware dispatch
        self.waiting: dict[str, list[dict]] = {}  # skew-aware dispatch without the coordinator: groups drawn ahead
        self.replay: deque = deque()  # prompt indices drawn but never routed before the checkpoint resumed from

    # ------------------------------------------------------------------ setup
    def _start(self) -> None:
        p = self.plan["pipeline"]
        from rlflow.runtime.model import prepare_model

        self.model_dir = prepare_model(self.plan, log=self.log)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.prompts = tokenize_prompts(read_prompts(self.plan), self.tokenizer, max_model_len=p["model"]["max_model_len"],
                                        max_new_tokens=self.rollout["max_new_tokens"], source=self.plan["source"])
        self.trajectory_server = TrajectoryServer.remote()
        self.parameter_server = ParameterServer.remote()
        engine_kwargs = {k: self.rollout[k] for k in ("max_running", "max_new_tokens", "temperature", "top_p")}
        engine_kwargs |= {"seed": p["seed"], "dtype": p["model"]["dtype"], "max_model_len": p["model"]["max_model_len"]}
        self.instances = [
            Instance(i, RolloutWorker.options(num_cpus=self.rollout["num_cpus"], num_gpus=self.rollout["num_gpus"]).remote(
                self.rollout["engine"], str(self.model_dir), i, engine_kwargs, self.trajectory_server))
            for i in range(self.rollout["replicas"])
        ]
        trainer_kwargs = {k: self.train[k] for k in ("lr", "clip_low", "clip_high", "loss_agg", "kl_coef", "max_importance_ratio")}
        trainer_kwargs |= {"temperature": self.rollout["temperature"], "seed": p["seed"]}
        self.trainer = TrainerWorker.options(num_cpus=self.train["num_cpus"], num_gpus=self.train["num_gpus"]).remote(
            str(self.model_dir), self.train["deepspeed"], trainer_kwargs, self.trajectory_server, self.parameter_server)
        self.policy = make_policy(**self.control)
        self.assembler = GroupAssembler(self.group_size, self.rollout["group_redundancy"])
        self.cursor = 0
        self.step = 0
        self.group_version: dict[str, int] = {}  # open group -> V_traj
        self.kept: dict[str, dict[str, float]] = {}  # occupied group -> {traj_id: reward}
        self.evicted: set[str] = set()  # groups evicted by the policy before their reward arrived
        self.tracker_run_id = None
        if self.resume:
            self._restore()
        ray.get([inst.handle.ready.remote() for inst in self.instances])
        ray.get(self.trainer.publish.remote(self.step))  # the initial (or restored) version on the server
        if self.step:
            version, ref = ray.get(self.parameter_server.latest.remote())
            for inst in self.instances:
                inst.pull, inst.version = (version, ref), version
        self.coordination, self.coordination_notes = RuntimeCoordinator.from_plan(self.plan, self.instances, self.counts,
                                                                                  log=self.log)
        self.dispatch = RuntimeDispatch.from_plan(self.plan, plan_coordination(self.plan), self.counts,
                                                  self.coordination_notes, log=self.log)
        max_ticks = self.train["steps"] * self._batch_groups() * 8 + 1000  # >= every non-empty pull + idle timeouts
        self.stream = stream.reward_stream(
            self.trajectory_server, reward_fn=p["stages"][self.reward_name]["fn"], filter_fn=self._filter_ref(),
            concurrency=p["stages"][self.reward_name]["concurrency"], num_cpus=p["stages"][self.reward_name]["num_cpus"],
            max_ticks=max_ticks)
        self.rewarded: queue.Queue = queue.Queue()
        self._done = False
        self.stream_thread = threading.Thread(target=self._pump_stream, daemon=True)
        self.stream_thread.start()

    def _batch_groups(self) -> int:
        return self.control["batch_size"]

    def _filter_ref(self) -> str | None:
        for e in self.plan["graph"]["edges"]:
            if e["from"] == self.reward_name and e["policy"]["kind"] == "streaming":
                return e["policy"].get("filter")
        return None

    def _pump_stream(self) -> None:
        """Background thread: Ray Data output batches -> the driver's queue."""
        try:
            for batch in self.stream.iter_batches(batch_size=None, prefetch_batches=0, batch_format="numpy"):
                if len(batch["traj_id"]):
                    self.rewarded.put({k: list(batch[k]) for k in stream.COLUMNS})
                if self._done:
                    break  # closing the iterator shuts the streaming executor down
        except Exception as e:  # surfaced by the main loop
            self.rewarded.put(e)

    # ------------------------------------------------------------------ control plane
    def _admit(self) -> None:
        """Admit new groups while some instance has room and the staleness policy allows its version.

        Least-loaded routing (StaleFlow's vanilla strategy, §5.3) among the instances whose weights
        version the staleness policy admits; a group's members all go to one instance. With skew-aware
        dispatch (rlflow/runtime/dispatch.py) the groups wait, one batch drawn ahead, and each lane
        routes its longest-predicted group to its own instances.
        """
        while True:
            if self.dispatch is None:
                inst = self._least_loaded(self.instances, self.rollout["max_running"])
                if inst is None:
                    return
                gid, rows = self._draw_group(self._next_version(inst))
            else:
                self._top_up()
                alive = [i.index for i in self.instances if i.alive]
                pick = None
                lanes = self.dispatch.lanes(alive)
                for lane, insts, cap in lanes:
                    gid = self.dispatch.head(self.waiting, lane)
                    inst = gid and self._least_loaded([self.instances[i] for i in sorted(insts)], cap)
                    if inst:
                        pick = inst, gid
                        break
                if pick is None:
                    return
                inst, gid = pick
                self.dispatch.check_lane(gid, inst.index, lanes)
                rows = self.waiting.pop(gid)
            version = self._next_version(inst)
            self._reserve_group(gid, version)
            for traj in rows:
                traj["version"] = version
                self.assembler.launch(gid, traj_id(traj), version)
                inst.routes.append(traj)
                inst.running[traj_id(traj)] = traj

    def _least_loaded(self, instances, cap: int) -> Instance | None:
        """The least-loaded instance with room whose next weights version the staleness policy admits."""
        candidates = sorted((i for i in instances if i.alive and not i.draining and i.load < cap),
                            key=lambda i: (i.load, i.index))
        return next((i for i in candidates if self.policy.verify(self._next_version(i))), None)

    @staticmethod
    def _next_version(inst: Instance) -> int:
        """Weights the instance generates its next routed work with (a queued pull loads first)."""
        return inst.pull[0] if inst.pull else inst.version

    def _coordinate(self) -> None:
        """One rollout-coordinator cycle (staleflow.txt §5.2, Algorithm 1) at a step barrier, when one is due
        (every interval_s, or as soon as an instance has run out of work).

        When a cycle is due, instances that return are held (no next step) until every alive one has
        returned, so the snapshot is exact; the cycle then syncs (Pull, interrupting what the instance
        holds), migrates (Interrupt) and routes (Route, reserving a group with the staleness policy when
        its first member is routed), and the commands go out with the next step calls.
        """
        c = self.coordination
        now = time.monotonic()
        if not c.holding and not c.due(now, self.instances):
            return
        c.holding = True
        if any(i.ref is not None for i in self.instances if i.alive):
            return  # wait for every instance to finish its step
        self._top_up()
        c.cycle(self.instances, self.latest_version, self.latest_ref, self.policy.verify, self._reserve_group, self._launch,
                dispatch=self.dispatch)
        c.holding = False
        c.next_cycle = now + c.interval_s

    def _top_up(self) -> None:
        """Keep one batch of groups drawn ahead but not routed (§5.1: the TS samples prompts ahead; as the
        simulator): the coordinator's TS initial groups, or the groups waiting for skew-aware dispatch.
        Algorithm 2 re-runs over them when new ones arrive or the ranker has learned since the last plan."""
        ts = self.coordination
        drawn = False
        while (ts.initial_groups if ts is not None else len(self.waiting)) < self._batch_groups():
            gid, rows = self._draw_group(0)  # version: set when the group is reserved
            if ts is not None:
                ts.add_group(gid, rows)
            else:
                self.waiting[gid] = rows
            drawn = True
        if self.dispatch is not None and (drawn or self.dispatch.dirty):
            prompts = ts.initial_prompts() if ts is not None else {g: rows[0]["prompt"] for g, rows in self.waiting.items()}
            self.dispatch.plan(prompts, sum(i.alive for i in self.instances))

    def _unrouted(self) -> list[str]:
        """Groups drawn ahead that no instance has seen yet (saved so --resume draws them first)."""
        return list(self.waiting) + (list(self.coordination.initial) if self.coordination is not None else [])

    def _draw_group(self, version: int) -> tuple[str, list[dict]]:
        """The next prompt as a group id and its member rows (fresh trajectories on `version`)."""
        if self.replay:  # drawn before a checkpoint but never routed: drawn again first after --resume
            index = self.replay.popleft()
        else:
            index, self.cursor = self.cursor, self.cursor + 1
        row = self.prompts[index % len(self.prompts)]
        gid = f"g{index}"
        return gid, [{"group_id": gid, "index": m, "prompt": row["prompt"], "answer": row["answer"],
                      "prompt_ids": row["prompt_ids"], "completion_ids": [], "behaviour_logprobs": [],
                      "version": version, "versions_seen": []} for m in range(self.members)]

    def _reserve_group(self, gid: str, version: int) -> None:
        """The coordinator routes a group's first member to an instance on `version` (Algorithm 2)."""
        self.policy.reserve(gid, version)
        self.assembler.open(gid, version)
        self.group_version[gid] = version
        if self.dispatch is not None:
            self.dispatch.routed(gid)

    def _launch(self, row: dict) -> None:
        """A member is routed; the first time, it joins its group with the group's reserved V_traj."""
        gid, tid = row["group_id"], traj_id(row)
        if tid not in self.assembler.running(gid):
            self.assembler.launch(gid, tid, self.group_version[gid])

    def _on_step_result(self, inst: Instance, result: dict) -> None:
        inst.busy_s += result["busy_s"]
        snap = result["snapshot"]
        inst.version = snap["version"]
        self.timeline.append((time.monotonic() - self.t0, inst.index, len(snap["run_trajs"])))
        self.pull_s += result["pull_s"]
        inst.snapshot = snap
        for meta in result["finished"]:
            tid = member_id(meta["group_id"], meta["index"])
            self.lengths[tid] = meta["tokens"]
            if self.coordination is not None:
                self.coordination.finished(inst, tid)
            if inst.running.pop(tid, None) is None:
                continue  # finished after we aborted it: the server's copy is discarded below
            gid = meta["group_id"]
            if gid not in self.assembler:
                self.trajectory_server.discard.remote([tid])
                continue
            done = self.assembler.finish(gid, tid)
            if done is not None:
                self._abort_members(done.surplus)
                # with the coordinator, members never routed leave the TS (they have no payload)
                unrouted = self.coordination.forget_group(gid) if self.coordination is not None else set()
                ids = (member_id(gid, m) for m in range(self.members))
                members = [t for t in ids if t not in done.surplus and t not in unrouted]
                self.group_version[gid] = done.version
                self.trajectory_server.enqueue_group.remote(members)
                if self.dispatch is not None:  # the ranker learns the prompt's completion length
                    self.dispatch.completed(gid, [self.lengths[t] for t in members if t in self.lengths])
        if self.coordination is not None:  # partial rollouts back to the TS, or to the instance a Route waits with
            self.counts["rerouted"] += self.coordination.returned(inst, result["interrupted"], self.instances)
            return
        for t in result["interrupted"]:
            self._reroute(t)
        self._sync(inst, snap)

    def _abort_members(self, traj_ids) -> None:
        for tid in traj_ids:
            for inst in self.instances:
                if inst.running.pop(tid, None) is not None:
                    if self.coordination is None or self.coordination.abort(inst, tid):
                        inst.aborts.append(tid)
            if self.coordination is not None:
                self.coordination.drop(tid)  # a partial one waiting in the TS
            self.counts["aborted_trajectories"] += 1
        self.trajectory_server.discard.remote(list(traj_ids))

    def _sync(self, inst: Instance, snap: dict) -> None:
        """Weight-sync policy for one instance after its step (global, per_instance; drain without partial rollout)."""
        ws = self.coord["weight_sync"] or {"mode": "global", "partial_rollout": False}
        latest = self.latest_version
        if inst.pull or inst.version >= latest:
            inst.draining = False
            return
        idle = not snap["run_trajs"] and not snap["wait_trajs"] and not inst.routes
        if ws["mode"] == "global" and ws["partial_rollout"]:
            inst.pull = (latest, self.latest_ref)
        elif idle:
            inst.pull, inst.draining = (latest, self.latest_ref), False
        elif ws["mode"] == "global":
            inst.draining = True  # finish current work on the old weights, then pull (no partial rollout)

    def _reroute(self, traj: dict) -> None:
        alive = [i for i in self.instances if i.alive]
        if not alive:
            raise RuntimeError("every rollout instance has died; nothing can generate (see the Ray logs above)")
        target = min(alive, key=lambda i: (i.load, i.index))
        target.routes.append(traj)
        target.running[traj_id(traj)] = traj
        self.counts["rerouted"] += 1

    def _on_instance_death(self, inst: Instance, err: Exception) -> None:
        inst.alive = False
        self.log(f"rollout instance {inst.index} died ({type(err).__name__}); re-routing its {len(inst.running)} trajectories")
        orphans, inst.running = list(inst.running.values()), {}
        if self.coordination is not None:  # back to the TS; the next cycle routes them to the others
            if not any(i.alive for i in self.instances):
                raise RuntimeError("every rollout instance has died; nothing can generate (see the Ray logs above)")
            self.coordination.orphaned(inst, orphans)
            inst.routes, inst.aborts, inst.interrupts, inst.pull = [], [], [], None
            self.counts["rerouted"] += len(orphans)
            return
        for traj in orphans:  # restart from the prompt; V_traj stays the reserved (oldest) version
            self._reroute({**traj, "completion_ids": [], "behaviour_logprobs": []})

    def _on_rewarded(self, batch: dict) -> None:
        groups: dict[str, list[tuple]] = {}
        for tid, gid, r, err, kept in zip(*(batch[k] for k in stream.COLUMNS)):
            groups.setdefault(str(gid), []).append((str(tid), float(r), str(err), bool(kept)))
        for gid, rows in groups.items():
            if gid in self.evicted:  # the policy gave up on it while it was being rewarded
                self.evicted.discard(gid)
                self.group_version.pop(gid, None)
                self.trajectory_server.discard.remote([tid for tid, *_ in rows])
                continue
            failed = [tid for tid, _, err, _ in rows if err]
            if failed:
                self.counts["reward_failed"] += len(failed)
                self.log(f"reward failed for {len(failed)} trajectory(ies) of group {gid}: {rows[0][2] or next(e for _, _, e, _ in rows if e)}")
            self.recent_rewards += [r for _, r, err, _ in rows if not err]
            good = {tid: r for tid, r, err, kept in rows if not err and kept}
            if not good:  # filtered (e.g. uniform rewards) or every reward failed
                self._discard_entries(self.policy.filter(gid))  # may abort batch-redundancy surplus
                self.counts["filtered_groups"] += 1
                self.trajectory_server.discard.remote([tid for tid, *_ in rows])
                continue
            self.trajectory_server.discard.remote(failed)
            self.kept[gid] = good
            dropped = self.policy.occupy(gid, self.group_version.pop(gid))
            self._discard_entries(dropped)

    def _discard_entries(self, entries) -> None:
        """Clean up after groups the policy evicted (it already counted them dropped or aborted).

        An evicted group may still be generating (batch-redundancy surplus: abort its members),
        waiting for its reward (forget it when the reward arrives), or occupied (drop its payload).
        """
        for e in entries:
            if self.dispatch is not None:
                self.dispatch.forget(e.gid)
            if e.gid in self.assembler:
                self._abort_members(self.assembler.abort(e.gid))
                self.group_version.pop(e.gid, None)
                if self.coordination is not None:
                    self.coordination.forget_group(e.gid)
            elif e.gid in self.kept:
                self.trajectory_server.discard.remote(list(self.kept.pop(e.gid)))
                self.counts["dropped_groups"] += 1
            else:
                self.evicted.add(e.gid)

    def _consume(self) -> None:
        batch = self.policy.consume()
        self._discard_entries(batch.dropped)
        staleness = batch.staleness()
        if self.eta is not None and staleness and max(staleness) > self.eta:
            raise InvariantViolation(f"a batch at version {batch.version} has staleness {max(staleness)} > eta {self.eta}")
        self.policy.check_invariants()
        rewards, group_max = {}, []
        for e in batch.entries:
            group = self.kept.pop(e.gid)
            if set(group) & set(rewards):
                raise InvariantViolation(f"group {e.gid} would be trained twice")
            rewards |= group
            group_max.append(max(self.lengths.get(t, 0) for t in group))
        lengths = [self.lengths.pop(t, 0) for t in rewards]
        self.batch_info = {"staleness": staleness, "rewards": list(rewards.values()), "version": batch.version,
                           "groups": len(batch.entries), "lengths": lengths, "group_max": group_max}
        self.staleness_all += staleness
        self.train_ref = self.trainer.train.remote(list(rewards), rewards, self.group_size, batch.version)

    # ------------------------------------------------------------------ loop
    def run(self) -> list[dict]:
        from rlflow.runtime.tracking import Tracker

        self.t0 = time.monotonic()
        self._start()
        self.tracker = Tracker(self.plan, run_id=self.tracker_run_id)
        self.latest_version, self.latest_ref = ray.get(self.parameter_server.latest.remote())
        self.train_ref = None
        last_step_t = time.monotonic()
        previous = signal.signal(signal.SIGINT, self._on_sigint)
        if self.coordination is not None:
            self.log(self.coordination.describe())
        if self.dispatch is not None:
            self.log(self.dispatch.describe())
        for note in self.coordination_notes:
            self.log(f"note: {note}")
        self.log(f"run '{self.plan['name']}': {self.train['steps']} steps of {self._batch_groups()} groups x {self.group_size}; "
                 f"MLflow run {self.tracker.run_id} at {self.tracker.uri}")
        status = "FAILED"
        try:
            while self.step < self.train["steps"] and not self.stop_requested:
                if self.coordination is None:
                    self._admit()
                else:
                    self._coordinate()
                for inst in self.instances:
                    if inst.alive and inst.ref is None and not (self.coordination and self.coordination.holding):
                        if self.coordination is not None:
                            self.coordination.sent(inst)
                        inst.ref = inst.handle.step.remote(inst.routes, inst.aborts, inst.interrupts, inst.pull)
                        inst.routes, inst.aborts, inst.interrupts, inst.pull = [], [], [], None
                refs = [i.ref for i in self.instances if i.ref is not None] + ([self.train_ref] if self.train_ref else [])
                ready, _ = ray.wait(refs, num_returns=1, timeout=0.05)
                for ref in ready:
                    if ref is self.train_ref:
                        self._finish_step(ray.get(ref), last_step_t)
                        last_step_t = time.monotonic()
                        continue
                    inst = next(i for i in self.instances if i.ref is ref)
                    inst.ref = None
                    try:
                        self._on_step_result(inst, ray.get(ref))
                    except ray.exceptions.RayActorError as err:
                        self._on_instance_death(inst, err)
                while not self.rewarded.empty():
                    item = self.rewarded.get_nowait()
                    if isinstance(item, Exception):
                        raise item
                    self._on_rewarded(item)
                if self.train_ref is None and self.step < self.train["steps"] and self.policy.ready():
                    self._consume()
            status = "FINISHED" if not self.stop_requested else "KILLED"
        finally:
            signal.signal(signal.SIGINT, previous)
            self._shutdown(status)
        return self.history

    def _finish_step(self, metrics: dict, last_step_t: float) -> None:
        self.train_ref = None
        self.step += 1
        self.latest_version, self.latest_ref = ray.get(self.parameter_server.latest.remote())
        now = time.monotonic()
        wall = max(now - last_step_t, 1e-9)
        info = self.batch_info
        st, rw = info["staleness"], info["rewards"]
        c = self.policy.counters
        busy = sum(i.busy_s for i in self.instances)
        lengths = info["lengths"]
        mean_len = sum(lengths) / len(lengths) if lengths else 0.0
        row = {
            "step": self.step, "version": self.latest_version, "reward_mean": sum(rw) / len(rw),
            # the policy's success rate on everything it generated (the trained batch is filter-biased)
            "reward_all_mean": sum(self.recent_rewards) / len(self.recent_rewards) if self.recent_rewards else 0.0,
            "reward_std": math.sqrt(sum((r - sum(rw) / len(rw)) ** 2 for r in rw) / len(rw)),
            "staleness_mean": sum(st) / len(st), "staleness_max": max(st),
            "length_mean": mean_len, "length_max": max(lengths, default=0),
            # measured group tailness multiplier M_tail = E[max over a group] / E[L] (staleness-model.md)
            "length_tailness": (sum(info["group_max"]) / len(info["group_max"]) / mean_len) if mean_len else 0.0,
            "weight_pull_s": self.pull_s,
            "trajectories_per_s": len(rw) / wall, "tokens_per_s": metrics.get("tokens", 0) / wall,
            "trainer_idle_ratio": max(0.0, 1 - metrics.get("step_time_s", 0) / wall),
            "rollout_idle_ratio": max(0.0, 1 - (busy - getattr(self, "_busy_prev", 0.0)) / (wall * len(self.instances))),
            "admitted": c.admitted, "consumed": c.consumed, "aborted": c.aborted, "filtered": c.filtered,
            "dropped": c.dropped, "in_flight": c.in_flight, "pending": c.pending, **self.counts,
            **{k: v for k, v in metrics.items() if isinstance(v, (int, float))},
        }
        self._busy_prev = busy
        self.recent_rewards = []
        for s in range(max(st) + 1):
            row[f"staleness_hist_{s}"] = st.count(s)
        pred = self.plan["prediction"]
        if pred.get("available"):
            row["staleness_predicted"] = pred["mean"]
        recall = self.dispatch.recall() if self.dispatch is not None else None
        if recall is not None:
            row["ranker_recall_top20"] = recall
        self.history.append(row)
        self.tracker.log_metrics(row, self.step)
        if self.plan["pipeline"]["tracking"]["progress"]:
            self.log(f"step {self.step:>3}/{self.train['steps']}  reward {row['reward_all_mean']:.3f} (trained {row['reward_mean']:.3f})  loss {row.get('loss', 0):+.4f}  "
                     f"staleness mean {row['staleness_mean']:.2f} max {row['staleness_max']}  "
                     f"{row['trajectories_per_s']:.1f} traj/s  elapsed {now - self.t0:.0f}s")
        ckpt = self.train["checkpoint_every"]
        if ckpt and self.step % ckpt == 0:
            self._checkpoint()

    def _on_sigint(self, *_):
        if self.stop_requested:
            raise KeyboardInterrupt
        self.log("\nstopping: finishing the current step and saving a checkpoint (Ctrl-C again to quit at once)")
        self.stop_requested = True

    # ------------------------------------------------------------------ checkpoint / resume
    def _checkpoint(self) -> None:
        ckpt = self.out_dir / "checkpoint"
        ckpt.mkdir(parents=True, exist_ok=True)
        state = {"step": self.step, "cursor": self.cursor, "mlflow_run_id": self.tracker.run_id,
                 "unrouted": [int(gid[1:]) for gid in self._unrouted()],
                 "history": self.history, "staleness_all": self.staleness_all, "counts": self.counts}
        ray.get(self.trainer.save.remote(str(ckpt), {"step": self.step}))
        (self.out_dir / STATE_FILE).write_text(json.dumps(state))
        self.log(f"checkpoint at step {self.step}: {ckpt}")

    def _restore(self) -> None:
        path = self.out_dir / STATE_FILE
        if not path.exists():
            from rlflow.errors import PipelineInvalid, Problem

            raise PipelineInvalid(str(path), [Problem((), "no checkpoint to resume from", "no-checkpoint",
                                                      "run without --resume first (Ctrl-C saves a checkpoint)")])
        state = json.loads(path.read_text())
        ray.get(self.trainer.load.remote(str(self.out_dir / "checkpoint")))
        self.step, self.cursor = state["step"], state["cursor"]
        self.replay = deque(state.get("unrouted", []))
        self.history, self.staleness_all, self.counts = state["history"], state["staleness_all"], state["counts"]
        self.tracker_run_id = state["mlflow_run_id"]
        self.policy.version = self.step  # the control plane resumes at the trainer's version, empty
        self.log(f"resuming at step {self.step} (MLflow run {self.tracker_run_id})")

    def _shutdown(self, status: str) -> None:
        self._done = True
        try:
            if self.train_ref is not None:  # let the step in flight finish so its checkpoint is consistent
                self._finish_step(ray.get(self.train_ref), time.monotonic())
            if status != "FAILED":
                self._checkpoint()
            if status == "FINISHED":
                pred = self.plan["prediction"]
                self.tracker.log_figures(self.history, self.staleness_all, self.timeline, self.eta,
                                         pred["mean"] if pred.get("available") else None)
                self.tracker.log_json("summary.json", self.summary())
        finally:
            self.tracker.end(status)
            ray.get(self.trajectory_server.close.remote())  # ticks return at once: the pump sees _done
            self.stream_thread.join(timeout=30)
            # end the actors this run started, by handle (a shared cluster outlives the run)
            for handle in [i.handle for i in self.instances] + [self.trainer, self.trajectory_server, self.parameter_server]:
                ray.kill(handle)

    def summary(self) -> dict:
        h = self.history
        k = max(1, min(10, len(h) // 3))  # mean over the first and last k steps
        first = sum(r["reward_all_mean"] for r in h[:k]) / k if h else 0.0
        last = sum(r["reward_all_mean"] for r in h[-k:]) / k if h else 0.0
        st = self.staleness_all
        return {"steps": len(h), "reward_first": first, "reward_last": last, "window": k,
                "staleness_mean": sum(st) / len(st) if st else 0.0, "staleness_max": max(st, default=0),
                "counters": vars(self.policy.counters), **self.counts,
                "elapsed_s": time.monotonic() - self.t0, "mlflow_run_id": self.tracker.run_id,
                **({"ranker_recall_top20": self.dispatch.recall()} if self.dispatch is not None else {})}
