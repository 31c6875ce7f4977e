"""DeepSpeedTrainer: grouped trajectories in, one GRPO optimizer step out, weights out as numpy.

The loss math lives in stages/grpo.py; this module is plumbing: batching, the DeepSpeed engine,
weights and checkpoints. Written for one process (world size 1): no data sharding across ranks.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlflow.stages import grpo
from rlflow.stages.trajectory import Trajectory

_CLIENT_KEY = "rlflow"  # our entry in DeepSpeed's client_state: {"version": int, "client": user dict}


@dataclass
class _MicroBatch:
    """Right-padded prompt+completion rows; targets, masks and per-token values are aligned to logits[:, :-1]."""

    input_ids: torch.Tensor  # [b, L]
    attention_mask: torch.Tensor  # [b, L]
    targets: torch.Tensor  # [b, L-1] = input_ids[:, 1:]
    mask: torch.Tensor  # [b, L-1] float, 1 where the target is a completion token
    behaviour_logprobs: torch.Tensor  # [b, L-1], 0 off the mask
    advantages: torch.Tensor  # [b]
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_distributed() -> None:
    """Join (or create) the process group DeepSpeed needs; a single process gets a gloo group on a free port."""
    import deepspeed
    import deepspeed.comm as ds_comm

    if torch.distributed.is_initialized() and ds_comm.is_initialized():
        return
    if torch.distributed.is_initialized():  # the caller made the group; DeepSpeed wraps it
        world_size = torch.distributed.get_world_size()
    else:
        if "WORLD_SIZE" not in os.environ:  # not under a launcher: a world of one
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ["MASTER_PORT"] = str(_free_port())
        world_size = int(os.environ["WORLD_SIZE"])
    if world_size == 1:
        # DeepSpeed's CPU backend builds its shared-memory all-reduce op (a ~2 min C++ compile on first use)
        # for every process group; a world of one never uses it, so mark it unavailable to skip the build.
        from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

        deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    deepspeed.init_distributed(dist_backend=backend)


def _engine_config(deepspeed_config: str | dict, lr: float, micro_batch_size: int | None) -> dict:
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
    # A batch is any number of micro-batches; train_step marks the accumulation boundary itself.
    cfg["gradient_accumulation_steps"] = 1
    cfg.pop("train_batch_size", None)
    return cfg


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
        temperature: float = 1.0,
        micro_batch_size: int | None = None,
        seed: int = 0,
        pad_token_id: int | None = None,
    ):
        import deepspeed
        from transformers import AutoModelForCausalLM

        if loss_agg not in ("token", "sequence"):
            raise ValueError(f"loss_agg must be 'token' or 'sequence', got {loss_agg!r}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 (the sampler's temperature), got {temperature}")
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
        cfg = _engine_config(deepspeed_config, lr, micro_batch_size)
        self.micro_batch_size = int(cfg["train_micro_batch_size_per_gpu"])
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        # Dropout off for good: the ratio and importance weights compare log-probs of the same weights.
        self.engine.eval()
        if self.ref_model is not None:
            self.ref_model.to(self.engine.device)

    # ------------------------------------------------------------------ batching

    def _micro_batches(self, trajectories: list[Trajectory], advantages: torch.Tensor) -> list[_MicroBatch]:
        """Length-sorted micro-batches (less padding); order does not matter as the loss is normalised batch-wide."""
        lengths = [len(t.prompt_ids) + len(t.completion_ids) for t in trajectories]
        order = sorted(range(len(trajectories)), key=lengths.__getitem__)
        device = self.engine.device
        batches = []
        for start in range(0, len(order), self.micro_batch_size):
            idx = order[start : start + self.micro_batch_size]
            rows = [trajectories[i] for i in idx]
            length = max(lengths[i] for i in idx)
            ids = torch.full((len(rows), length), self.pad_token_id, dtype=torch.long)
            attn = torch.zeros((len(rows), length), dtype=torch.long)
            mask = torch.zeros((len(rows), length - 1))
            behaviour = torch.zeros((len(rows), length - 1))
            for r, t in enumerate(rows):
                p, c = len(t.prompt_ids), len(t.completion_ids)
                ids[r, : p + c] = torch.tensor(list(t.prompt_ids) + list(t.completion_ids), dtype=torch.long)
                attn[r, : p + c] = 1
                # completion token j sits at position p + j and is predicted by the logits at p + j - 1
                mask[r, p - 1 : p + c - 1] = 1.0
                behaviour[r, p - 1 : p + c - 1] = torch.tensor(t.behaviour_logprobs, dtype=torch.float32)
            batches.append(
                _MicroBatch(
                    input_ids=ids.to(device),
                    attention_mask=attn.to(device),
                    targets=ids[:, 1:].to(device),
                    mask=mask.to(device),
                    behaviour_logprobs=behaviour.to(device),
                    advantages=advantages[idx].to(device),
                )
            )
        return batches

    def _logits(self, model, mb: _MicroBatch) -> torch.Tensor:
        out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False)
        return out.logits[:, :-1].float() / self.temperature

    # ------------------------------------------------------------------ training

    def train_step(self, trajectories: list[Trajectory], group_size: int) -> dict[str, float]:
        """One optimizer step on whole groups of `group_size` trajectories; returns metrics."""
        t0 = time.perf_counter()
        _check_trajectories(trajectories, group_size)
        rewards, advantages = _advantages(trajectories)
        batches = self._micro_batches(trajectories, advantages)
        num_tokens = float(sum(len(t.completion_ids) for t in trajectories))
        num_sequences = float(sum(1 for t in trajectories if t.completion_ids))
        normalizer = num_tokens if self.loss_agg == "token" else num_sequences

        with torch.no_grad():
            for mb in batches:
                mb.old_logprobs = grpo.token_logprobs(self._logits(self.engine, mb), mb.targets)
                if self.ref_model is not None:
                    mb.ref_logprobs = grpo.token_logprobs(self._logits(self.ref_model, mb), mb.targets)

        token_means = ("clip_frac", "ratio_mean", "importance_weight_mean", "importance_truncated_frac")
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
            )  # fmt: skip
            loss = pg_loss
            if self.ref_model is not None:
                kl = grpo.kl_penalty(logprobs, mb.ref_logprobs, mb.mask, loss_agg=self.loss_agg, normalizer=normalizer)
                loss = loss + self.kl_coef * kl
                sums["kl"] += kl.item()
            self.engine.backward(loss)

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
        self.engine.step()
        self.version += 1
        if grad_norm is None:
            grad_norm = self.engine.get_global_grad_norm()  # ZeRO 1-3 optimizers record the pre-clip norm
        return {
            **sums,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "importance_weight_max": weight_max,
            "reward_mean": float(rewards.mean()),
            "tokens": int(num_tokens),
            "micro_batches": len(batches),
            "step_time_s": time.perf_counter() - t0,
            "version": self.version,
        }

    def _grad_norm_stage0(self) -> float:
        """Pre-clip global grad norm; without ZeRO the plain torch optimizer does not record it."""
        norms = [p.grad.detach().float().norm() for p in self.engine.module.parameters() if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0

    # ------------------------------------------------------------------ weights and checkpoints

    def state_numpy(self) -> dict[str, np.ndarray]:
        """Full weights under the HF state-dict names, as contiguous CPU numpy copies (gathered under ZeRO-3)."""
        import deepspeed

        module = self.engine.module
        params = list(module.parameters())
        gather = self.engine.zero_optimization_stage() == 3
        ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=None) if gather else contextlib.nullcontext()
        with ctx, torch.no_grad():
            return {name: t.detach().cpu().numpy().copy(order="C") for name, t in module.state_dict().items()}

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


def _advantages(trajectories: list[Trajectory]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards of all trajectories and the [B] GRPO advantage of each, computed within its own group.

    Groups may be smaller than group_size when a member's reward failed (the runtime drops that
    member, not the group), so each group is normalised on its own.
    """
    groups: dict[str, list[int]] = {}
    for i, t in enumerate(trajectories):
        groups.setdefault(t.group_id, []).append(i)
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
    advantages = torch.empty(len(trajectories))
    for members in groups.values():
        advantages[members] = grpo.group_advantages(rewards[members].unsqueeze(0))[0]
    return rewards, advantages


def _check_trajectories(trajectories: list[Trajectory], group_size: int) -> None:
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
