"""Batches from the buffer into the trainer: the driver's side of a train step and of the trainer's checkpoints.

The driver holds rank 0 of the trainer's actors (trainer_worker.py) and sends it the consumed groups' ids and
rewards; rank 0 takes their payloads from the payload store, trains, and publishes the new weights to the parameter
server itself (parameter_server.py). The DeepSpeed config is checked here first, so a bad one is exit 2, not a
traceback from inside an actor.
"""

from __future__ import annotations

import json
from pathlib import Path

import ray

from rlflow.errors import PipelineInvalid, Problem
from rlflow.plan_model import Plan
from rlflow.runtime.checkpoint import CheckpointDamaged
from rlflow.runtime.messages import Started, TrainBatch, Trained, TrainStep
from rlflow.runtime.model_shipping import ship_model
from rlflow.runtime.trainer_worker import RANK_CALL_TIMEOUT_S, launch_trainer
from rlflow.runtime.watchdog import RunStalled


def check_deepspeed_config(plan: dict | Plan) -> dict:
    """The trainer's DeepSpeed config, read and checked again at run start (it was there at compile, but may
    have been deleted or edited since): PipelineInvalid naming stages.<train>.deepspeed when it is missing,
    unreadable, not JSON, or not shaped like a DeepSpeed config. Returns the parsed config (the trainer is
    given this dict, so it runs on exactly what was checked)."""
    plan = Plan.of(plan)
    spec = plan.trainer
    ref, loc = spec.deepspeed, ("stages", spec.stage, "deepspeed")

    def bad(message: str, rule: str, fix: str = "fix the file, or point the train stage at one of configs/deepspeed/*.json"):
        raise PipelineInvalid(plan.source, [Problem(loc, message, rule, fix)])

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


#: a resume's load: queued behind the ranks' start (DeepSpeed, the model), as the driver's own start is
LOAD_TIMEOUT_S = 900


class TrainSink:
    """The plan's trainer (its ranks in one placement group; the driver holds rank 0) and the step in flight."""

    def __init__(self, plan: dict | Plan, *, model_dir: str, store, params):
        plan = Plan.of(plan)
        deepspeed_config = check_deepspeed_config(plan)  # before the actor: a bad config is exit 2, not a traceback
        spec = plan.trainer
        self.steps, self.checkpoint_every = spec.steps, spec.checkpoint_every
        # groups may differ in size between rollout stages; the trainer checks none exceeds the largest
        self.group_size = max(a.group_size for a in plan.rollouts())
        self.actor, self.placement = launch_trainer(
            ship_model(model_dir), deepspeed_config, spec.trainer_kwargs, store, params, world_size=spec.replicas,
            options={"num_cpus": spec.num_cpus, "num_gpus": spec.num_gpus, "resources": spec.resources},
            source=plan.source, stage=spec.stage, weights=spec.weights, threads=(spec.threads, spec.threads_share))
        self.ref = None  # the train step in flight
        self.batch_info: dict = {}

    def start(self, batch: TrainBatch, info: dict) -> Started:
        """Rank 0 trains `batch` (its payloads it takes from the store by id) and publishes batch.version + 1;
        returns the call, for the driver to wait on."""
        self.batch_info = info
        self.ref = self.actor.train.remote(TrainStep(batch.rewards, self.group_size, batch.version))
        return Started(self.ref, Trained())

    def save(self, directory: str, tag: str, client_state: dict) -> dict:
        """Checkpoint `tag` from every rank (checkpoint.py's trainer side); the trainer's counters."""
        return self._call(self.actor.save.remote(directory, tag, client_state), f"the trainer to save checkpoint {tag}")

    def load(self, directory: str, tag: str) -> dict:
        """Restore checkpoint `tag` into every rank; a checkpoint the trainer cannot read is CheckpointDamaged (the
        caller falls back to an older one), not a bug."""
        try:
            return self._call(self.actor.load.remote(directory, tag), f"the trainer to load checkpoint {tag}", LOAD_TIMEOUT_S)
        except ray.exceptions.RayTaskError as err:
            raise CheckpointDamaged(f"the trainer could not load it ({type(err.cause).__name__}: {err.cause})") from None

    @staticmethod
    def _call(ref, what: str, timeout_s: float = RANK_CALL_TIMEOUT_S):
        try:
            return ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RunStalled(f"waited {timeout_s:.0f} s for {what}; see the Ray logs above") from None

    def close(self) -> None:
        """End every rank and give their resources back (the placement group outlives its actors otherwise)."""
        from ray.util.placement_group import remove_placement_group

        ray.kill(self.actor)
        remove_placement_group(self.placement)
