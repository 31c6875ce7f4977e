"""PPO's critic: a value head on a causal LM's backbone, trained as its own DeepSpeed engine beside the policy's.

The critic is the policy's architecture with its lm_head replaced by a linear value head (initialised to 0, so the
first values are 0 and the first advantages are the returns), started from the policy's weights unless
`critic_model` names another model. It runs on the trainer's ranks, with its own optimizer; its gradients average
over the ranks like the policy's (each rank's loss is its part of the batch's sum, times the world size).

Per step (DeepSpeedTrainer.train_shard with algo ppo): `advantages` runs the critic without gradient over each
micro-batch, puts each sequence's reward on its last trained token plus the per-token KL reward, and turns them into
GAE advantages and returns (stages/advantages.py `gae`); the policy takes its PPO-clip step on those advantages; then
`train` takes `critic_epochs` optimizer steps of the clipped value loss toward the returns. The values come from
the critic at train time, so the staleness of a trajectory does not touch them.

Checkpoints: the critic's engine saves into the policy's tag directory, as DeepSpeed tag `critic` (so one tag holds
both, under one manifest, pruned together: rlflow/runtime/checkpoint.py).
"""

from __future__ import annotations

import contextlib
import copy
import math
import os

import numpy as np
import torch
from torch import Tensor, nn

from rlflow.stages import advantages as adv
from rlflow.stages.packing import MicroBatch

#: the critic's DeepSpeed tag inside the policy's checkpoint tag directory
CRITIC_TAG = "critic"
#: PpoOptions fields (rlflow/schema.py) the Critic takes
OPTIONS = ("gamma", "lam", "value_clip", "critic_lr", "critic_epochs", "critic_warmup_steps", "critic_model",
           "normalize_advantages")


class ValueModel(nn.Module):
    """A causal LM's backbone (its `base_model_prefix` module: the decoder without lm_head) and a value head: [B, L]
    values, V(s_k) at position k, the state from which target k (input_ids[k + 1]) is chosen."""

    def __init__(self, causal_lm: nn.Module):
        super().__init__()
        self.backbone = getattr(causal_lm, causal_lm.base_model_prefix)
        self.config = causal_lm.config
        self.value_head = nn.Linear(causal_lm.config.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None) -> Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, value_clip: float | None,
               normalizer: float) -> tuple[Tensor, Tensor]:
    """(sum over the mask of the per-token value loss / normalizer, how many tokens the clip decided).

    Clipped (PPO, Schulman et al. arXiv:1707.06347, as its baselines code runs it; "The 37 Implementation Details of
    Proximal Policy Optimization", Huang et al. 2022, detail 9): 1/2 max((V - R)^2, (V_old + clip(V - V_old, -c, c)
    - R)^2); value_clip None: 1/2 (V - R)^2."""
    mask = mask.to(torch.float32)
    error = (values - returns) ** 2
    if value_clip is None:
        per_token, decided = error, torch.zeros((), device=values.device)
    else:
        clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
        clipped_error = (clipped - returns) ** 2
        per_token = torch.maximum(error, clipped_error)
        decided = ((clipped_error > error).to(torch.float32) * mask).sum().detach()
    return 0.5 * (per_token * mask).sum() / max(normalizer, 1.0), decided


class Critic:
    """The value model under its own DeepSpeed engine (a copy of the policy's config, with the critic's rate)."""

    def __init__(self, causal_lm: nn.Module, engine_config: dict, lr: float, *, gamma: float = 1.0,
                 lam: float = 0.95, value_clip: float | None = 0.2, critic_lr: float | None = None,
                 critic_epochs: int = 1, critic_warmup_steps: int = 0, normalize_advantages: bool = True):
        import deepspeed

        causal_lm.config.use_cache = False
        model = ValueModel(causal_lm)
        cfg = copy.deepcopy(engine_config)
        cfg["optimizer"]["params"]["lr"] = critic_lr or lr
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        self.engine.eval()  # no dropout: V_old and V compare the same weights' values
        self.gamma, self.lam, self.value_clip = gamma, lam, value_clip
        self.epochs, self.warmup_steps, self.normalize = critic_epochs, critic_warmup_steps, normalize_advantages

    def _values(self, mb: MicroBatch) -> Tensor:
        """[B, L-1] values aligned to the targets (packing.py's convention)."""
        return self.engine(mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids)[:, :-1]

    def advantages(self, batches: list[MicroBatch], kl_rewards: list[Tensor | None],
                   world_size: int) -> list[tuple[Tensor, Tensor]]:
        """Each micro-batch's raw rewards (mb.advantages) become GAE advantages, whitened over every token of the
        batch on all ranks (`normalize_advantages`); returns each micro-batch's (V_old, returns) for `train`."""
        targets = []
        totals = torch.zeros(3, device=self.engine.device)
        for mb, kl_reward in zip(batches, kl_rewards):
            with torch.no_grad():
                values = self._values(mb) * mb.mask
            rewards = adv.last_token_rewards(mb.advantages, mb.mask, mb.segments)
            if kl_reward is not None:
                rewards = rewards + kl_reward
            mb.advantages, returns = adv.gae(rewards, values, mb.mask, self.gamma, self.lam, mb.segments)
            totals += adv.moments(mb.advantages, mb.mask)
            targets.append((values, returns))
        if self.normalize:
            if world_size > 1:
                torch.distributed.all_reduce(totals)
            for mb in batches:
                mb.advantages = adv.whiten(mb.advantages, mb.mask, totals)
        return targets

    def train(self, batches: list[MicroBatch], targets: list[tuple[Tensor, Tensor]], num_tokens: float,
              world_size: int, held=None) -> dict[str, float]:
        """`critic_epochs` optimizer steps of the value loss over the micro-batches; this rank's metrics (critic_loss,
        value_mean and value_clip_frac add up over ranks; explained_variance is the batch's on every rank).
        held(optimizer): a context in which the optimizer's step does nothing (a non-finite gradient without ZeRO)."""
        device = self.engine.device
        first_loss, decided = 0.0, 0.0
        for epoch in range(self.epochs):
            for k, (mb, (old_values, returns)) in enumerate(zip(batches, targets)):
                self.engine.set_gradient_accumulation_boundary(k == len(batches) - 1)
                loss, clipped = value_loss(self._values(mb), old_values, returns, mb.mask, self.value_clip, num_tokens)
                self.engine.backward(loss * world_size)  # DeepSpeed averages over ranks: each loss is its part of the sum
                if epoch == 0:
                    first_loss += loss.item()
                decided += float(clipped)
            grad_norm = self._grad_norm()
            hold = held is not None and grad_norm is not None and not math.isfinite(grad_norm)
            with held(self.engine.optimizer) if hold else contextlib.nullcontext():
                self.engine.step()
        # explained variance 1 - Var(R - V) / Var(R) over every token of the batch, from moments summed over ranks
        sums = torch.zeros(5, device=device)
        for mb, (values, returns) in zip(batches, targets):
            m = mb.mask.to(torch.float32)
            residual = (returns - values) * m
            sums += torch.stack([(returns * m).sum(), (returns * returns * m).sum(), residual.sum(),
                                 (residual * residual).sum(), m.sum()])
        value_sum = float(sum((values * mb.mask).sum() for mb, (values, _) in zip(batches, targets)))
        if world_size > 1:
            torch.distributed.all_reduce(sums)
        count = max(float(sums[4]), 1.0)
        var_returns = float(sums[1]) / count - (float(sums[0]) / count) ** 2
        var_residual = float(sums[3]) / count - (float(sums[2]) / count) ** 2
        explained = 1.0 - var_residual / var_returns if var_returns > 1e-12 else float("nan")
        grad_norm = self.engine.get_global_grad_norm() if self.engine.zero_optimization_stage() else grad_norm
        return {"critic_loss": first_loss, "value_mean": value_sum / max(num_tokens, 1.0),
                "value_clip_frac": decided / max(num_tokens * self.epochs, 1.0), "explained_variance": explained,
                "critic_grad_norm": float(grad_norm) if grad_norm is not None else float("nan")}

    def _grad_norm(self) -> float | None:
        """Without ZeRO, the pre-step global norm (after the all-reduce, so every rank decides alike); ZeRO 1-3
        skip a non-finite step themselves."""
        if self.engine.zero_optimization_stage():
            return None
        norms = [p.grad.detach().float().norm() for p in self.engine.module.parameters() if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0

    # ------------------------------------------------------------------ checkpoints

    def save(self, directory: str, tag: str | None) -> None:
        """Beside the policy's checkpoint: into its tag's directory as tag `critic`; without a tag (DeepSpeed's
        global_step<N> and `latest`), into `critic/` of `directory`."""
        if tag is None:
            self.engine.save_checkpoint(os.path.join(directory, CRITIC_TAG))
        else:
            self.engine.save_checkpoint(os.path.join(directory, tag), tag=CRITIC_TAG, save_latest=False)

    def load(self, directory: str, tag: str | None) -> None:
        where = os.path.join(directory, CRITIC_TAG) if tag is None else os.path.join(directory, tag)
        path, _ = self.engine.load_checkpoint(where, tag=None if tag is None else CRITIC_TAG)
        if path is None:
            raise FileNotFoundError(f"no critic checkpoint in {where!r} (algo ppo saves one beside the policy's)")

    def state_numpy(self) -> dict[str, np.ndarray]:
        """The critic's weights as fp32 numpy copies (tests; not under ZeRO-3, whose parameters are partitioned)."""
        return {k: v.detach().to("cpu", torch.float32).numpy().copy() for k, v in self.engine.module.state_dict().items()}

