"""The trainer as Ray actors: the ranks of the DeepSpeed GRPO trainer (the driver's side is train_sink.py).

Rank 0 takes the consumed groups' payloads straight from the payload store (they never pass through the driver),
runs one GRPO step (stages/trainer.py) over its N data-parallel ranks (`replicas` of the train stage: Ray actors in
one placement group, one DeepSpeed process group over gloo on CPU or NCCL on GPU) and publishes version + 1 to the
parameter server itself (parameter_server.py).
"""

from __future__ import annotations

import os

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlflow.errors import PipelineInvalid, Problem
from rlflow.runtime import hop_trace
from rlflow.runtime.actor_threads import use_threads
from rlflow.runtime.messages import StepResult, TrainStep
from rlflow.runtime.model_shipping import local_model_dir

#: how long the trainer's ranks may wait for the cluster to place them (a placement group the cluster
#: cannot hold stays pending forever: fail with what was asked for instead)
PLACEMENT_TIMEOUT_S = 120
#: one call from rank 0 to the other ranks (their part of a step, a checkpoint, a gather)
RANK_CALL_TIMEOUT_S = 600


@ray.remote
class TrainerWorker:
    """One rank of the DeepSpeed GRPO trainer.

    Rank 0 leads: the driver talks only to it. It creates ranks 1..N-1 itself (so they share its fate: a
    killed or ended rank 0 takes them down), joins them in one process group, takes each batch from the
    payload store, cuts it into token-balanced shards (stages/batch_shards.py), runs its own shard while
    the others run theirs, and publishes the new weights. If another rank dies, rank 0 exits too, so the
    driver sees the trainer die as it does with one rank.
    """

    def __init__(self, model_dir: str, deepspeed_config: str | dict, trainer_kwargs: dict, store, params, *,
                 rank: int = 0, world_size: int = 1, placement=None, master: tuple[str, int] | None = None,
                 rank_options: dict | None = None, weights: dict | None = None, threads: tuple[int | str, int] = (1, 1)):
        """weights: how versions leave rank 0, {"transport": "object_store" | "collective", "bucket_bytes": int}
        (the plan's weight_sync.transport). threads: (threads, share) as the plan gives them
        (runtime/actor_threads.py), each rank's torch threads."""
        self.threads = use_threads(*threads)
        from rlflow.stages.deepspeed_setup import free_port
        from rlflow.stages.trainer import DeepSpeedTrainer
        from rlflow.stages.weight_buckets import BUCKET_BYTES

        self.rank, self.world_size = rank, world_size
        self.store, self.params = store, params
        self.weights = weights or {"transport": "object_store", "bucket_bytes": BUCKET_BYTES}
        self.link = None  # collective transport: rank 0's weight link to the parameter server
        self.published_bytes = 0  # the last version's bytes on the wire (step metric published_bytes)
        self.peers = []
        if rank == 0 and world_size > 1:
            master = (ray.util.get_node_ip_address(), free_port("0.0.0.0"))
            self.peers = [
                TrainerWorker.options(**rank_options, scheduling_strategy=PlacementGroupSchedulingStrategy(placement, r))
                .remote(model_dir, deepspeed_config, trainer_kwargs, None, None, rank=r, world_size=world_size, master=master,
                        threads=threads)
                for r in range(1, world_size)]
        if world_size > 1:
            # LOCAL_RANK 0: Ray gives each rank its own GPU as device 0 (CUDA_VISIBLE_DEVICES); on CPU it is unused
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0",
                              MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))
        else:  # a world of one on a port of its own: not a launcher's RANK/WORLD_SIZE/MASTER_PORT inherited from the driver
            for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
                os.environ.pop(key, None)
        # each rank materialises the shipped model on its own node (rank 0 passed the shipment on, not its path)
        self.trainer = DeepSpeedTrainer(local_model_dir(model_dir), deepspeed_config, **trainer_kwargs)  # joins the process group

    def _all(self, method: str, *args, own, peer_args: list[tuple] | None = None):
        """Call `method` on every other rank (with `args`, or with rank r's own `peer_args[r - 1]`), run `own()`
        here meanwhile, and return [own result, *theirs]. A rank that died takes this one down with it (the
        driver then reports the trainer dead)."""
        calls = peer_args if peer_args is not None else [args] * len(self.peers)
        refs = [getattr(p, method).remote(*a) for p, a in zip(self.peers, calls)]
        try:
            mine = own()
            return [mine, *ray.get(refs, timeout=RANK_CALL_TIMEOUT_S)]
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, RuntimeError) as err:
            if not self.peers:
                raise
            print(f"trainer rank 0: another rank failed during {method} ({type(err).__name__}: {err}); "
                  "the trainer stops", flush=True)
            ray.actor.exit_actor()

    def ready(self) -> bool:
        self._all("ready", own=lambda: True)
        return True

    def publish(self, version: int) -> float:
        """Push the current weights as `version` (rank 0), bucket by bucket over the plan's transport; returns the
        seconds it took."""
        from rlflow.runtime.parameter_server import publish
        from rlflow.runtime.weight_link import open_link

        transport, bucket_bytes = self.weights["transport"], self.weights["bucket_bytes"]

        def put():
            if transport == "collective" and self.link is None:
                self.link = open_link(self.params)  # rank 0's link to the parameter server, kept for the run
            layouts = self.trainer.weight_layouts(bucket_bytes)
            sent = publish(self.params, version, layouts, self.trainer.weight_buckets(bucket_bytes),
                           transport=transport, link=self.link)
            self.published_bytes = sent["bytes"]  # a version's size on the wire (LoRA: the adapters alone)
            return sent["sync_s"]

        if self.trainer.gathers_to_publish:  # ZeRO-3: every rank takes part in each bucket's gather
            return self._all("gather", bucket_bytes, own=put)[0]
        return put()

    def gather(self, bucket_bytes: int) -> None:
        for _ in self.trainer.weight_buckets(bucket_bytes):
            pass

    def train(self, step: TrainStep) -> StepResult:
        """One step on the consumed groups (rank 0: all ranks train their shard); publishes step.version + 1."""
        from rlflow.stages.batch_shards import merge_rank_metrics
        from rlflow.stages.step_checks import NONFINITE_ORDER, check_batch

        trajectories = ray.get(self.store.take.remote(step.traj_ids), timeout=RANK_CALL_TIMEOUT_S)
        hop_trace.mark("taken", step.version + 1)
        for t in trajectories:
            t.reward = step.rewards[t.traj_id]
        check_batch(trajectories, step.group_size)
        shards = self.trainer.shards(trajectories, self.world_size)  # the algorithm's advantages, once, over the batch
        per_rank = self._all("train_shard", own=lambda: self.trainer.train_shard(shards[0]),
                             peer_args=[(shard,) for shard in shards[1:]])
        nonfinite = max((m.pop("nonfinite") for m in per_rank), key=NONFINITE_ORDER.index)
        hop_trace.mark("computed", step.version + 1)
        # poisoned weights are never published (the driver stops without saving them); a skipped step's are as before
        sync_s = self.publish(step.version + 1) if nonfinite != "poisoned" else 0.0
        hop_trace.mark("published", step.version + 1)
        metrics = merge_rank_metrics(per_rank)
        metrics["published_bytes"] = float(self.published_bytes if nonfinite != "poisoned" else 0)
        return StepResult(metrics, nonfinite, sync_s, self.world_size)

    def train_shard(self, shard) -> dict:
        return self.trainer.train_shard(shard)

    def save(self, directory: str, tag: str, client_state: dict) -> dict:
        """Every rank writes its part of checkpoint `tag`; returns rank 0's counters (DeepSpeedTrainer.counters)."""
        return self._all("save", directory, tag, client_state,
                         own=lambda: self.trainer.save_checkpoint(directory, client_state, tag=tag))[0]

    def load(self, directory: str, tag: str) -> dict:
        """Every rank restores checkpoint `tag`; returns {"client": the saved client_state, **rank 0's counters}."""
        client = self._all("load", directory, tag, own=lambda: self.trainer.load_checkpoint(directory, tag=tag))[0]
        return {"client": client, **self.trainer.counters()}


def launch_trainer(model_dir, deepspeed_config: dict, trainer_kwargs: dict, store, params, *, world_size: int,
                   options: dict, source: str, stage: str, weights: dict | None = None,
                   threads: tuple[int | str, int] = (1, 1)):
    """Rank 0 of a `world_size`-rank trainer (it starts the others) and their placement group."""
    placement = _place(world_size, options, source, stage)
    leader = TrainerWorker.options(**options, scheduling_strategy=PlacementGroupSchedulingStrategy(placement, 0)).remote(
        model_dir, deepspeed_config, trainer_kwargs, store, params, world_size=world_size, placement=placement,
        rank_options=options, weights=weights, threads=threads)
    return leader, placement


def _place(world_size: int, options: dict, source: str, stage: str):
    """A placement group with one bundle per rank, packed onto as few nodes as possible (collectives are
    fastest within a node); fails, naming what it asked for, if the cluster cannot hold it."""
    from ray.util.placement_group import placement_group, remove_placement_group

    bundle = {"CPU": options["num_cpus"], **({"GPU": options["num_gpus"]} if options["num_gpus"] else {}),
              **options.get("resources", {})}
    group = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise PipelineInvalid(source, [Problem(
            ("stages", stage, "replicas"),
            f"the cluster could not place {world_size} trainer rank(s) of {bundle} within {PLACEMENT_TIMEOUT_S} s "
            f"(it has {ray.cluster_resources()})", "cluster-too-small",
            "lower stages.<train>.replicas, num_cpus or num_gpus, or add nodes")]) from None
    return group
