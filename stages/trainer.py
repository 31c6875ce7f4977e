"""DeepSpeedTrainer: grouped trajectories in, one GRPO optimizer step out, weights out as numpy.

The loss math lives in stages/grpo.py; this module is plumbing: batching, the DeepSpeed engine,
weights and checkpoints. With N data-parallel ranks (one process each, joined in one process group by
rlflow/runtime/train_sink.py), each rank trains a shard of the batch cut by stages/batch_shards.py;
`train_step` is the one-rank case of `train_shard`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
from rlflow.stages import grpo
from rlflow.stages.batch_shards import BatchShard, shard_batch
from rlflow.stages.trajectory import Trajectory

_CLIENT_KEY = "rlflow"  # our entry in DeepSpeed's client_state: {"version": int, "client": user dict}


@dataclass
class _MicroBatch:
    """Right-padded prompt+completion rows; targets, masks and per-token values are aligned to logits[:, :-1]."""

    input_ids: torch.Tensor  # [b, L]
    attention_mask: torch.Tensor  # [b, L]
    targets: torch.Tensor  # [b, L-1] = input_ids[:, 1:]
    mask: torch.Tensor  # [b, L-1] float, 1 where the target is a generated completion token (not padding, not environment)
    behaviour_logprobs: torch.Tensor  # [b, L-1], 0 off the mask
    advantages: torch.Tensor  # [b]
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None


#: how long a collective (or joining the process group) may wait for the other ranks before it fails
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _init_distributed() -> None:
    """Join (or create) the process group DeepSpeed needs: the ranks' launcher (train_sink.py) sets RANK,
    WORLD_SIZE and MASTER_ADDR/PORT; a process on its own gets a world of one on a free port."""
    import deepspeed
    import deepspeed.comm as ds_comm

    if torch.distributed.is_initialized() and ds_comm.is_initialized():
        return
    if not torch.distributed.is_initialized():  # else the caller made the group; DeepSpeed wraps it
        if "WORLD_SIZE" not in os.environ:  # not under a launcher: a world of one
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ["MASTER_PORT"] = str(free_port())
    if not torch.cuda.is_available():
        # DeepSpeed's CPU backend builds its shared-memory all-reduce op (a ~2 min C++ compile on first use)
        # for every process group, but only its inference_all_reduce uses it; training all-reduces go through
        # torch.distributed (gloo). Mark it unavailable to skip the build, for any world size.
        from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

        deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    deepspeed.init_distributed(dist_backend=backend, timeout=COLLECTIVE_TIMEOUT)


def _engine_config(deepspeed_config: str | dict, lr: float, micro_batch_size: int | None, dtype: str = "float32") -> dict:
    if isinstance(deepspeed_config, (str, os.PathLike)):
        with open(deepspeed_config) as f:
            cfg = json.load(f)
    else:
        cfg = copy.deepcopy(deepspeed_config)
    cfg.setdefault("optimizer", {"type": "AdamW", "params": {}})
    params = cfg["optimizer"].setdefault("params", {})
    params["lr"] = lr
    if not torch.cuda.is_available():
        params.setdefault("torch_adam", True)  # else DeepSpeed JIT-compiles FusedAdam (~90 s on CPU)
    if micro_batch_size is not None:
        cfg["train_micro_batch_size_per_gpu"] = micro_batch_size
    cfg.setdefault("train_micro_batch_size_per_gpu", 8)
    # model.dtype decides the precision (one declaration for rollout and train): bf16/fp16 mode or neither
    cfg["bf16"] = {**cfg.get("bf16", {}), "enabled": dtype == "bfloat16"}
    cfg["fp16"] = {**cfg.get("fp16", {}), "enabled": dtype == "float16"}
    # A batch is any number of micro-batches; train_step marks the accumulation boundary itself.
    cfg["gradient_accumulation_steps"] = 1
    cfg.pop("train_batch_size", None)
    return cfg


def lr_factor(schedule: dict | None, step: int) -> float:
    """The learning rate of optimizer step `step` (0-based) as a fraction of the stage's `lr`.

    schedule: {"kind": "constant"|"cosine", "warmup_steps": W, "min_ratio": m, "total_steps": T} (None: constant).
    Warmup: (step + 1) / W for the first W steps, so the first step already moves. Cosine: from 1 after warmup
    down to m at the last step, T - 1. Set by hand before each optimizer step from the trainer's version (which
    the checkpoint keeps), not by a DeepSpeed scheduler: DeepSpeed's run their first step at a rate of 0.
    """
    if not schedule:
        return 1.0
    kind, warmup = schedule.get("kind", "constant"), int(schedule.get("warmup_steps", 0))
    if step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    if kind == "cosine":
        span = max(1, int(schedule["total_steps"]) - 1 - warmup)
        progress = min(1.0, (step - warmup) / span)
        low = float(schedule.get("min_ratio", 0.1))
        return low + (1.0 - low) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"lr_schedule kind must be 'constant' or 'cosine', got {kind!r}")


class DeepSpeedTrainer:
    """A causal LM under a DeepSpeed engine, updated by GRPO with decoupled PPO for stale trajectories."""

    def __init__(
        self,
        model_dir: str,
        deepspeed_config: str | dict,
        *,
        lr: float,
        clip_low: float,
        clip_high: float,
        loss_agg: grpo.LossAgg,
        kl_coef: float,
        max_importance_ratio: float,
        off_policy: grpo.OffPolicy = "decoupled",
        tis_cap: float = 2.0,
        mask_low: float = 0.5,
        mask_high: float = 2.0,
        temperature: float = 1.0,
        micro_batch_size: int | None = None,
        seed: int = 0,
        pad_token_id: int | None = None,
        dtype: str = "float32",
        lr_schedule: dict | None = None,
    ):
        import deepspeed
        from transformers import AutoModelForCausalLM

        if loss_agg not in ("token", "sequence"):
            raise ValueError(f"loss_agg must be 'token' or 'sequence', got {loss_agg!r}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 (the sampler's temperature), got {temperature}")
        if off_policy not in grpo.OFF_POLICY:
            raise ValueError(f"off_policy must be one of {', '.join(grpo.OFF_POLICY)}; got {off_policy!r}")
        # the off-policy correction and its parameters (grpo.importance_weights)
        self.off_policy = {"off_policy": off_policy, "tis_cap": tis_cap, "mask_low": mask_low, "mask_high": mask_high}
        self.clip_low, self.clip_high = clip_low, clip_high
        self.loss_agg = loss_agg
        self.kl_coef = kl_coef
        self.max_importance_ratio = max_importance_ratio
        self.temperature = temperature
        self.version = 0

        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.config.use_cache = False
        if pad_token_id is None:
            pad_token_id = getattr(model.config, "pad_token_id", None) or 0  # padding is masked: any id works
        self.pad_token_id = int(pad_token_id)

        self.ref_model = None
        if kl_coef > 0:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)

        _init_distributed()
        cfg = _engine_config(deepspeed_config, lr, micro_batch_size, dtype)
        self.lr, self.lr_schedule = lr, lr_schedule
        if "scheduler" in cfg and lr_schedule and (lr_schedule.get("kind") != "constant" or lr_schedule.get("warmup_steps")):
            raise ValueError("the DeepSpeed config has a 'scheduler' and the train stage sets lr_schedule/lr_warmup_steps; "
                             "keep one (remove 'scheduler' from the DeepSpeed config to use the stage's)")
        self.micro_batch_size = int(cfg["train_micro_batch_size_per_gpu"])
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        # Dropout off for good: the ratio and importance weights compare log-probs of the same weights.
        self.engine.eval()
        if self.ref_model is not None:
            self.ref_model.to(self.engine.device)

    # ------------------------------------------------------------------ batching

    def _micro_batches(self, shard: BatchShard) -> list[_MicroBatch]:
        """Exactly shard.micro_batches length-sorted micro-batches (less padding); order does not matter as the
        loss is normalised batch-wide. With fewer rows than micro-batches, the rest are masked padding rows."""
        trajectories = list(shard.trajectories)
        advantages = torch.tensor(shard.advantages, dtype=torch.float32)
        lengths = [len(t.prompt_ids) + len(t.completion_ids) for t in trajectories]
        order = sorted(range(len(trajectories)), key=lengths.__getitem__)
        real = min(shard.micro_batches, len(order))
        chunks = [order[k * len(order) // real : (k + 1) * len(order) // real] for k in range(real)]
        device = self.engine.device
        batches = []
        for idx in chunks + [None] * (shard.micro_batches - real):
            padding = idx is None  # a masked row: the rank still runs the pass its peers run (collectives)
            rows = [shard.pad] if padding else [trajectories[i] for i in idx]
            length = len(rows[0].prompt_ids) + len(rows[0].completion_ids) if padding else max(lengths[i] for i in idx)
            ids = torch.full((len(rows), length), self.pad_token_id, dtype=torch.long)
            attn = torch.zeros((len(rows), length), dtype=torch.long)
            mask = torch.zeros((len(rows), length - 1))
            behaviour = torch.zeros((len(rows), length - 1))
            for r, t in enumerate(rows):
                p, c = len(t.prompt_ids), len(t.completion_ids)
                ids[r, : p + c] = torch.tensor(list(t.prompt_ids) + list(t.completion_ids), dtype=torch.long)
                attn[r, : p + c] = 1
                # completion token j sits at position p + j and is predicted by the logits at p + j - 1
                # environment segments of a multi-turn episode (loss_mask 0) are context, not trained
                mask[r, p - 1 : p + c - 1] = 0.0 if padding else torch.tensor(t.trained_mask(), dtype=torch.float32)
                behaviour[r, p - 1 : p + c - 1] = torch.tensor(t.behaviour_logprobs, dtype=torch.float32)
            batches.append(
                _MicroBatch(
                    input_ids=ids.to(device),
                    attention_mask=attn.to(device),
                    targets=ids[:, 1:].to(device),
                    mask=mask.to(device),
                    behaviour_logprobs=behaviour.to(device),
                    advantages=(torch.zeros(1) if padding else advantages[idx]).to(device),
                )
            )
        return batches

    def _logits(self, model, mb: _MicroBatch) -> torch.Tensor:
        out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False)
        return out.logits[:, :-1].float() / self.temperature

    # ------------------------------------------------------------------ training

    def train_step(self, trajectories: list[Trajectory], group_size: int) -> dict[str, float]:
        """One optimizer step on whole groups of `group_size` trajectories (this process is the only rank)."""
        check_batch(trajectories, group_size)
        (shard,) = shard_batch(trajectories, 1, self.micro_batch_size)
        return self.train_shard(shard)

    def train_shard(self, shard: BatchShard) -> dict[str, float]:
        """This rank's part of one optimizer step; every rank of the process group calls it with its shard
        of the same batch. Returns this rank's metrics (batch_shards.merge_rank_metrics adds them up)."""
        t0 = time.perf_counter()
        batches = self._micro_batches(shard)
        num_tokens, num_sequences = shard.num_tokens, shard.num_sequences
        normalizer = num_tokens if self.loss_agg == "token" else num_sequences

        with torch.no_grad():
            for mb in batches:
                mb.old_logprobs = grpo.token_logprobs(self._logits(self.engine, mb), mb.targets)
                if self.ref_model is not None:
                    mb.ref_logprobs = grpo.token_logprobs(self._logits(self.ref_model, mb), mb.targets)

        token_means = ("clip_frac", "ratio_mean", "importance_weight_mean", "importance_weight_used_mean",
                       "importance_truncated_frac", "importance_masked_frac")
        sums = dict.fromkeys(("loss", "pg_loss", "kl", "entropy", *token_means), 0.0)
        weight_max = 0.0
        for k, mb in enumerate(batches):
            self.engine.set_gradient_accumulation_boundary(k == len(batches) - 1)
            logits = self._logits(self.engine, mb)
            logprobs = grpo.token_logprobs(logits, mb.targets)
            pg_loss, stats = grpo.policy_loss(
                logprobs, mb.old_logprobs, mb.behaviour_logprobs, mb.advantages, mb.mask,
                clip_low=self.clip_low, clip_high=self.clip_high,
                max_importance_ratio=self.max_importance_ratio, loss_agg=self.loss_agg, normalizer=normalizer,
                **self.off_policy,
            )  # fmt: skip
            loss = pg_loss
            if self.ref_model is not None:
                kl = grpo.kl_penalty(logprobs, mb.ref_logprobs, mb.mask, loss_agg=self.loss_agg, normalizer=normalizer)
                loss = loss + self.kl_coef * kl
                sums["kl"] += kl.item()
            # DeepSpeed averages gradients over the ranks; each rank's loss is its part of the batch's sum
            self.engine.backward(loss * shard.world_size)

            share = float(mb.mask.sum()) / max(num_tokens, 1.0)  # token-weighted means across micro-batches
            with torch.no_grad():
                entropy = grpo.entropy_from_logits(logits)
                sums["entropy"] += float((entropy * mb.mask).sum()) / max(num_tokens, 1.0)
            sums["loss"] += loss.item()
            sums["pg_loss"] += pg_loss.item()
            for key in token_means:
                sums[key] += stats[key] * share
            if mb.mask.sum() > 0:
                weight_max = max(weight_max, stats["importance_weight_max"])
        grad_norm = self._grad_norm_stage0() if self.engine.zero_optimization_stage() == 0 else None
        if self.lr_schedule and self.engine.lr_scheduler is None:
            for group in self.engine.optimizer.param_groups:
                group["lr"] = self.lr * lr_factor(self.lr_schedule, self.version)
        lr = float(self.engine.optimizer.param_groups[0]["lr"])  # the rate this step uses, whoever set it
        self.engine.step()
        self.version += 1
        if grad_norm is None:
            grad_norm = self.engine.get_global_grad_norm()  # ZeRO 1-3 optimizers record the pre-clip norm
        return {
            **sums,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "importance_weight_max": weight_max,
            "reward_mean": shard.reward_mean,
            "tokens": int(sum(float(mb.mask.sum()) for mb in batches)),
            "micro_batches": len(batches),
            "step_time_s": time.perf_counter() - t0,
            "version": self.version,
            "lr": lr,
        }

    def _grad_norm_stage0(self) -> float:
        """Pre-clip global grad norm; without ZeRO the plain torch optimizer does not record it."""
        norms = [p.grad.detach().float().norm() for p in self.engine.module.parameters() if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0

    # ------------------------------------------------------------------ weights and checkpoints

    def state_numpy(self) -> dict[str, np.ndarray]:
        """Full weights under the HF state-dict names, as contiguous fp32 CPU numpy copies (gathered under ZeRO-3,
        where every rank must call this)."""
        with self.full_state() as state:
            return {name: t.numpy().copy(order="C") for name, t in state.items()}

    @contextlib.contextmanager
    def full_state(self):
        """The full weights as name -> CPU tensor, without a copy where the parameters already live on the CPU
        in fp32 (gathered under ZeRO-3: every rank enters, and the views are valid only inside the block).
        bf16 or GPU parameters are converted to fp32 CPU copies (the engines load fp32 and cast themselves)."""
        import deepspeed

        module = self.engine.module
        gather = self.engine.zero_optimization_stage() == 3
        ctx = deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None) if gather else contextlib.nullcontext()
        with ctx, torch.no_grad():
            yield {name: t.detach().to("cpu", torch.float32) for name, t in module.state_dict().items()}

    @property
    def gathers_to_publish(self) -> bool:
        """Whether publishing the weights needs every rank (ZeRO-3 shards the parameters themselves)."""
        return self.engine.zero_optimization_stage() == 3

    def save_checkpoint(self, dir: str, client_state: dict | None = None) -> None:
        """DeepSpeed checkpoint (weights, optimizer, engine counters) plus the version and `client_state`."""
        state = {_CLIENT_KEY: {"version": self.version, "client": dict(client_state or {})}}
        self.engine.save_checkpoint(dir, client_state=state)

    def load_checkpoint(self, dir: str) -> dict[str, Any]:
        """Restore the latest checkpoint in `dir` (call on a fresh trainer); returns the saved client_state."""
        path, state = self.engine.load_checkpoint(dir)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint found in {dir!r} (expected a 'latest' file)")
        ours = state.get(_CLIENT_KEY)
        if ours is None:
            raise ValueError(f"{path}: a DeepSpeed checkpoint not written by DeepSpeedTrainer.save_checkpoint")
        self.version = int(ours["version"])
        return ours["client"]

    def close(self) -> None:
        """Drop the engine and models. The process group stays: it is process-wide and other engines may share it."""
        self.engine = None
        self.ref_model = None


def check_batch(trajectories: list[Trajectory], group_size: int) -> None:
    """Groups of at most group_size (fewer when a reward failed), every member rewarded, one log-prob per token."""
    if not trajectories:
        raise ValueError("train_step needs at least one group of trajectories")
    counts: dict[str, int] = {}
    for t in trajectories:
        counts[t.group_id] = counts.get(t.group_id, 0) + 1
        if t.reward is None:
            raise ValueError(f"trajectory {t.traj_id} reached the trainer without a reward (reward stage bug)")
        if len(t.behaviour_logprobs) != len(t.completion_ids):
            raise ValueError(
                f"trajectory {t.traj_id}: {len(t.behaviour_logprobs)} behaviour log-probs for "
                f"{len(t.completion_ids)} completion tokens"
            )
        if not t.prompt_ids:
            raise ValueError(f"trajectory {t.traj_id} has an empty prompt")
    wrong = {g: n for g, n in counts.items() if n > group_size}
    if wrong:
        raise ValueError(f"groups may have at most group_size={group_size} members; got {wrong}")
