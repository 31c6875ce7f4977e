"""Long-lived Ray actors that do the heavy work: rollout instances and the trainer.

Each rollout instance is driven by one outstanding `step` call at a time: the call carries the
coordinator's commands (route, interrupt, abort, pull) and returns what finished plus a snapshot,
which is StaleFlow's snapshot -> command cycle (§5.2) over plain actor calls.
"""

from __future__ import annotations

import os
import time

import ray

from rlflow import registry
from rlflow.stages.engine import EngineDied


def _one_thread() -> None:
    # PLATFORM-NOTES: two threads per process on shared cores make step times jump 20x.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)


@ray.remote
class RolloutWorker:
    """One rollout instance: an engine behind the rollout-engine interface."""

    def __init__(self, engine: str, model_dir: str, instance_id: int, engine_kwargs: dict, server):
        _one_thread()
        self.instance_id = instance_id
        self.engine = registry.resolve("engine", engine)(model_dir, instance_id=instance_id, **engine_kwargs)
        self.server = server
        self.busy_s = 0.0

    def ready(self) -> int:
        return self.instance_id

    def step(self, route: list[dict], abort: list[str], interrupt: list[str], pull) -> dict:
        """Apply commands, generate one chunk, report finished work and a snapshot.

        pull: None, or (version, [state ObjectRef]) to load before generating.
        """
        from rlflow.stages.trajectory import Trajectory

        t0 = time.perf_counter()
        pull_s = 0.0
        if pull is not None:
            version, (ref,) = pull
            t1 = time.perf_counter()
            self.engine.load_weights(ray.get(ref), version)
            pull_s = time.perf_counter() - t1
        for tid in abort:
            self.engine.abort(tid)
        interrupted = [t.as_dict() for t in (self.engine.interrupt(tid) for tid in interrupt) if t is not None]
        for row in route:
            self.engine.start(Trajectory.from_dict(row))
        finished = []
        if not self.engine.idle:
            try:
                finished = [t.as_dict() for t in self.engine.step()]
            except EngineDied as e:
                # Fault isolation (laminar.txt §3.3, §4.3): this instance leaves; the driver sees the actor die
                # and re-routes its trajectories to the others.
                print(f"rollout instance {self.instance_id}: {e}; exiting", flush=True)
                ray.actor.exit_actor()
        else:
            time.sleep(0.01)  # nothing to do: do not spin the driver
        if finished:
            ray.get(self.server.put.remote(finished))  # payload in the server before the driver hears of it
        busy = time.perf_counter() - t0
        self.busy_s += busy
        meta = [{k: t[k] for k in ("group_id", "index", "version", "finish_reason")} | {"tokens": len(t["completion_ids"])}
                for t in finished]
        return {"instance": self.instance_id, "finished": meta, "interrupted": interrupted,
                "snapshot": self.engine.snapshot(), "busy_s": busy, "pull_s": pull_s}


@ray.remote
class TrainerWorker:
    """The DeepSpeed GRPO trainer; pushes each new version to the parameter server itself."""

    def __init__(self, model_dir: str, deepspeed_config: str, trainer_kwargs: dict, server, params):
        _one_thread()
        from rlflow.stages.trainer import DeepSpeedTrainer

        self.trainer = DeepSpeedTrainer(model_dir, deepspeed_config, **trainer_kwargs)
        self.server, self.params = server, params

    def publish(self, version: int) -> float:
        """Push the current weights as `version`; returns the seconds it took."""
        t0 = time.perf_counter()
        ref = ray.put(self.trainer.state_numpy())
        ray.get(self.params.push.remote(version, [ref]))
        return time.perf_counter() - t0

    def train(self, traj_ids: list[str], rewards: dict[str, float], group_size: int, version: int) -> dict:
        """One step on the consumed groups; publishes version + 1."""
        from rlflow.stages.trajectory import Trajectory

        rows = ray.get(self.server.take.remote(traj_ids))
        trajectories = []
        for row in rows:
            t = Trajectory.from_dict(row)
            t.reward = rewards[t.traj_id]
            trajectories.append(t)
        metrics = self.trainer.train_step(trajectories, group_size)
        metrics["sync_s"] = self.publish(version + 1)
        return metrics

    def save(self, directory: str, client_state: dict) -> None:
        self.trainer.save_checkpoint(directory, client_state)

    def load(self, directory: str) -> dict:
        return self.trainer.load_checkpoint(directory)
