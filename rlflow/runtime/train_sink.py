"""Batches from the buffer into the trainer: the DeepSpeed GRPO trainer actor and the driver's side of a step.

The trainer takes the consumed groups' payloads straight from the trajectory store (they never pass
through the driver), runs one GRPO step (stages/trainer.py) and publishes version + 1 to the parameter
server itself (weight_sync.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import ray

from rlflow.errors import PipelineInvalid, Problem
from rlflow.runtime.rollout_worker import one_thread


def check_deepspeed_config(plan: dict) -> dict:
    """The trainer's DeepSpeed config, read and checked again at run start (it was there at compile, but may
    have been deleted or edited since): PipelineInvalid naming stages.<train>.deepspeed when it is missing,
    unreadable, not JSON, or not shaped like a DeepSpeed config. Returns the parsed config (the trainer is
    given this dict, so it runs on exactly what was checked)."""
    spec = next(a for a in plan["actors"] if a["role"] == "trainer")
    ref, loc = spec["deepspeed"], ("stages", spec["stage"], "deepspeed")

    def bad(message: str, rule: str, fix: str = "fix the file, or point the train stage at one of configs/deepspeed/*.json"):
        raise PipelineInvalid(plan["source"], [Problem(loc, message, rule, fix)])

    path = Path(ref)
    if not path.is_file():
        bad(f"DeepSpeed config '{ref}' no longer exists (it did when the plan was compiled)", "missing-file",
            "restore it, or point the train stage at one of configs/deepspeed/*.json and re-run rlflow compile")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as err:
        bad(f"cannot read DeepSpeed config '{ref}' ({type(err).__name__}: {err})", "bad-json")
    except json.JSONDecodeError as err:
        bad(f"DeepSpeed config '{ref}' is not valid JSON ({err})", "bad-json")
    if not isinstance(cfg, dict):
        bad(f"DeepSpeed config '{ref}' is a JSON {type(cfg).__name__}, not an object", "bad-deepspeed-config")
    for key in ("optimizer", "zero_optimization", "scheduler", "fp16", "bf16"):
        if key in cfg and not isinstance(cfg[key], dict):
            bad(f"DeepSpeed config '{ref}': \"{key}\" is a {type(cfg[key]).__name__}, not an object", "bad-deepspeed-config")
    if not isinstance(cfg.get("optimizer", {}).get("params", {}), dict):
        bad(f"DeepSpeed config '{ref}': \"optimizer.params\" is not an object", "bad-deepspeed-config")
    return cfg


@ray.remote
class TrainerWorker:
    """The DeepSpeed GRPO trainer; pushes each new version to the parameter server."""

    def __init__(self, model_dir: str, deepspeed_config: str | dict, trainer_kwargs: dict, store, params):
        one_thread()
        from rlflow.stages.trainer import DeepSpeedTrainer

        self.trainer = DeepSpeedTrainer(model_dir, deepspeed_config, **trainer_kwargs)
        self.store, self.params = store, params

    def ready(self) -> bool:
        return True

    def publish(self, version: int) -> float:
        """Push the current weights as `version`; returns the seconds it took."""
        t0 = time.perf_counter()
        ref = ray.put(self.trainer.state_numpy())
        ray.get(self.params.push.remote(version, [ref]))
        return time.perf_counter() - t0

    def train(self, traj_ids: list[str], rewards: dict[str, float], group_size: int, version: int) -> dict:
        """One step on the consumed groups; publishes version + 1."""
        from rlflow.stages.trajectory import Trajectory

        rows = ray.get(self.store.take.remote(traj_ids))
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


class TrainSink:
    """The plan's trainer actor and the step in flight."""

    def __init__(self, plan: dict, *, model_dir: str, store, params):
        deepspeed_config = check_deepspeed_config(plan)  # before the actor: a bad config is exit 2, not a traceback
        spec = next(a for a in plan["actors"] if a["role"] == "trainer")
        self.steps, self.checkpoint_every = spec["steps"], spec["checkpoint_every"]
        # groups may differ in size between rollout stages; the trainer checks none exceeds the largest
        self.group_size = max(a["group_size"] for a in plan["actors"] if a["role"] == "rollout")
        self.actor = TrainerWorker.options(num_cpus=spec["num_cpus"], num_gpus=spec["num_gpus"]).remote(
            model_dir, deepspeed_config, spec["trainer_kwargs"], store, params)
        self.ref = None  # the train step in flight
        self.batch_info: dict = {}

    def start(self, rewards: dict[str, float], version: int, info: dict, submit) -> None:
        self.batch_info = info
        self.ref = self.actor.train.remote(list(rewards), rewards, self.group_size, version)
        submit(self.ref, ("train", self, None))
