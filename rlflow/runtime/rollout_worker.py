"""The rollout instance as a long-lived Ray actor: an engine behind the rollout-engine interface.

Each instance is driven by one outstanding `step` call at a time: the call carries the coordinator's
commands (pull, abort, interrupt, route) and returns what finished plus a snapshot, which is StaleFlow's
snapshot -> command cycle (§5.2) over plain actor calls. The driver sends a step only when the instance
has work or commands, so an idle instance costs nothing and its idle time is not counted as busy.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import replace

import ray

from rlflow import registry
from rlflow.runtime import hop_trace
from rlflow.runtime.actor_threads import use_threads
from rlflow.runtime.messages import FinishedMeta, StepReport
from rlflow.runtime.model_shipping import local_model_dir
from rlflow.runtime.parameter_server import pull_into
from rlflow.stages.engine import EngineDied
from rlflow.stages.trajectory import Trajectory

#: longest a step call waits for an environment when the engine has nothing to generate (no busy loop)
ENV_WAIT_S = 0.5


@ray.remote
class RolloutWorker:
    """One rollout instance of one rollout stage."""

    def __init__(self, engine: str, model_dir, instance_id: int, engine_kwargs: dict, store, episode: dict | None = None,
                 threads: tuple[int | str, int] = (1, 1)):
        """episode: for a stage with an environment, {"env", "env_kwargs", "max_turns"} (plan.py): multi-turn.
        threads: (threads, share) as the plan gives them (runtime/actor_threads.py), the engine's CPU threads."""
        self.threads = use_threads(*threads)
        model_dir = local_model_dir(model_dir)  # a ShippedModel (model_shipping.py) becomes a directory on this node
        self.instance_id = instance_id
        cls = registry.resolve("engine", engine)
        if "cpu_threads" in inspect.signature(cls.__init__).parameters:  # vLLM: its CPU worker's OpenMP threads
            engine_kwargs = {**engine_kwargs, "cpu_threads": self.threads}
        self.engine = cls(model_dir, instance_id=instance_id, **engine_kwargs)
        self.store = store
        from rlflow.runtime.episodes import episodes_for

        self.episodes = episodes_for(episode, model_dir, engine_kwargs)  # multi-turn: environments between turns
        self.turns_not_complete = 0  # engine completions that were turns handed to an environment, not episodes

    def ready(self) -> int:
        return self.instance_id

    def step(self, route: list[Trajectory], abort: list[str], interrupt: list[str], pull, sleep: int = 0) -> StepReport:
        """Apply commands, generate one chunk if there is work, report finished work and a snapshot.

        pull: None, or (version, parameter_server.Published) to load before generating (an engine asleep wakes
        first). The report's `loaded` is then the engine's report of what it loaded (WeightsLoaded), which the
        driver verifies. sleep: a level (1, 2) to sleep at after this step if nothing is left to generate: the
        train step that follows has the memory (rollout_fleet.RolloutFleet.sleep_idle).
        """
        pull_s, loaded = 0.0, None
        if self.engine.asleep and (pull is not None or route):
            if pull is None and self.engine.asleep == 2:
                raise RuntimeError(f"instance {self.instance_id} was routed work while asleep at level 2 without a pull "
                                   "of the weights to wake to; rollout_fleet.send attaches one")
            self.engine.wake_up()
        if pull is not None:
            version, published = pull
            t1 = time.perf_counter()
            hop_trace.mark("pulling", version)
            # bucket by bucket over the plan's transport (parameter_server.py); the engine loads each as it comes
            loaded = pull_into(self.engine, published, version)
            pull_s = time.perf_counter() - t1
            hop_trace.mark("loaded", version)
        episodes, done, interrupted = self.episodes, [], []
        for tid in abort:
            if not (episodes and episodes.drop(tid)):
                self.engine.abort(tid)
        for tid in interrupt:
            traj = self._interrupt(tid)
            if traj is None:
                continue
            if traj.finish_reason == "interrupt":
                interrupted.append(traj)
            else:  # its environment ended the episode meanwhile: complete, not partial
                done.append(traj)
                self.turns_not_complete -= 1
        for traj in route:
            if episodes is None or episodes.begin(traj):  # an agent's episode starts at its first request
                self.engine.start(traj)
        hop_trace.mark("routed", (t.group_id for t in route))
        if episodes:  # environment steps that came back: next turns, or episodes the environment ended
            ended = episodes.returned(self.engine, wait_s=0.0 if not self.engine.idle else ENV_WAIT_S)
            done.extend(ended)
            self.turns_not_complete -= len(ended)  # their last turn, handed to the environment, ended the episode
        busy = 0.0
        if not self.engine.idle:
            t0 = time.perf_counter()
            hop_trace.mark("decoding", f"instance-{self.instance_id}")
            try:
                turns = self.engine.step()
            except EngineDied as e:
                # Fault isolation (Laminar §3.3, §4.3): this instance leaves; the driver sees the actor die
                # and re-routes its trajectories to the others.
                print(f"rollout instance {self.instance_id}: {e}; exiting", flush=True)
                ray.actor.exit_actor()
            busy = time.perf_counter() - t0
            hop_trace.mark("decoded", f"instance-{self.instance_id}")
            final = episodes.finished(turns) if episodes else turns
            self.turns_not_complete += len(turns) - len(final)
            done.extend(final)
        if episodes and episodes.deferred:  # agents that returned while the engine decoded: reported now, not next step
            ended = episodes.ended()
            done.extend(ended)
            self.turns_not_complete -= len(ended)
        if done:
            hop_trace.mark("generated", (t.group_id for t in done))
            ray.get(self.store.put.remote(done))  # payload in the store before the driver hears of it
            hop_trace.mark("stored", (t.group_id for t in done))
        meta = [FinishedMeta(t.group_id, t.index, t.version, t.finish_reason, len(t.completion_ids),
                             len(t.turn_starts) or 1, t.loss_mask.count(0), t.env_s) for t in done]
        snapshot = self.engine.snapshot()
        if episodes:  # between turns, on their environment; and episodes completed, as the coordinator counts them
            snapshot = replace(snapshot, env_trajs=episodes.waiting_ids(),
                               complete_trajs=snapshot.complete_trajs - self.turns_not_complete)
        idle = self.engine.idle and not (episodes and episodes.waiting)
        freed, held = 0, None
        if sleep and idle and not self.engine.asleep:
            held = self.engine.held_bytes()
            freed = self.engine.sleep(sleep)
        return StepReport(self.instance_id, meta, interrupted, snapshot, busy, pull_s, idle, loaded,
                          self.engine.asleep, freed, held)

    def _interrupt(self, tid: str):
        """Hand a trajectory back partial: off the engine, or (multi-turn) from its environment; its episode's
        environment travels with it."""
        traj = self.engine.interrupt(tid)
        if self.episodes is None:
            return traj
        if traj is None:
            traj = self.episodes.take(tid)
            if traj is None or traj.finish_reason:
                return traj  # not here, or the environment ended the episode: complete, not partial
            traj.finish_reason = "interrupt"
            traj.completion = self.episodes.tokenizer.decode(traj.completion_ids, skip_special_tokens=True)
            traj.instance = self.instance_id
        self.episodes.leave(traj)
        return traj
