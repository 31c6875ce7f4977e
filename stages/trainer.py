"""DeepSpeedTrainer: grouped trajectories in, one policy-gradient optimizer step out, weights out in buckets.

The loss math lives in small pure modules: the algorithm's advantage estimator (stages/advantages.py), policy loss
(stages/policy_losses.py, PPO-clip in stages/grpo.py), aggregation (stages/loss_agg.py), KL (stages/kl.py) and
reward shaping (stages/reward_shaping.py); micro-batch layouts (padded, packed) in stages/packing.py, chunked
log-probs in stages/logprobs.py; the process group, engine config and model loading in stages/deepspeed_setup.py, the
batch checks and the non-finite verdict in stages/step_checks.py, the lr schedule in stages/lr_schedule.py; this module
is plumbing: the DeepSpeed engine, weights and checkpoints. With N
data-parallel ranks (one process each, joined in one process group by rlflow/runtime/trainer_worker.py), each rank
trains a shard of the batch cut by stages/batch_shards.py; `train_step` is the one-rank case of `train_shard`.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
import warnings
from typing import Any

import numpy as np
import torch

from rlflow.stages import advantages, critic, distill, grpo, kl, loss_agg, packing, policy_losses
from rlflow.stages.batch_shards import BatchShard, cost, shard_batch
from rlflow.stages.deepspeed_setup import checkpoint_layers_in_eval, engine_config, init_distributed, load_model
from rlflow.stages.logprobs import TokenLogprobs, supports
from rlflow.stages.lr_schedule import lr_factor
from rlflow.stages.packing import row_token_bound
from rlflow.stages.step_checks import check_batch, loss_agg_mode_of, nonfinite_verdict, optimizer_held
from rlflow.stages.trajectory import Trajectory
from rlflow.stages.weight_buckets import BUCKET_BYTES, module_buckets, module_layouts

_CLIENT_KEY = "rlflow"  # our entry in DeepSpeed's client_state: {"version": int, "client": user dict}


class DeepSpeedTrainer:
    """A causal LM under a DeepSpeed engine, updated by the named algorithm (GRPO by default) with decoupled PPO
    for stale trajectories."""

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
        packing: bool = False,
        micro_batch_tokens: int | None = None,
        gradient_checkpointing: bool = False,
        logit_chunk_tokens: int | None = None,
        algo: str = "grpo",
        algo_options: dict | None = None,
        entropy_coef: float = 0.0,
        kl_estimator: kl.KlEstimator | None = None,
        max_new_tokens: int | None = None,
        overlong: dict | None = None,
        lora: dict | None = None,
        epochs: int = 1,
        mini_batches: int = 1,
        distill: dict | None = None,
    ):
        """packing: each micro-batch's trajectories in one row without padding (stages/packing.py), checked on this
        model at start; micro_batch_tokens: with packing, at most this many tokens per micro-batch (None: as many
        micro-batches as micro_batch_size rows make). gradient_checkpointing: recompute each decoder layer's
        activations in backward. logit_chunk_tokens: positions per lm_head chunk (None: stages/logprobs.py's size;
        0: no chunks, the full logits).
        algo: the algorithm (stages/policy_losses.py POLICY_LOSSES), algo_options its block of the train stage (gspo,
        cispo: clip_low / clip_high, which replace the PPO ones; reinforce_pp: kl_in_reward; ppo: critic.OPTIONS); entropy_coef: weight
        of the entropy bonus; kl_estimator: k1 / k2 / k3 (None: k1 folded into the reward, k3 as a loss term);
        max_new_tokens: the generation budget, L of loss_agg seq-mean-token-sum-norm; overlong: keyword arguments of
        reward_shaping.overlong_penalty (None: no shaping). lora: train.lora ({rank, alpha, target_modules, dropout}):
        only the adapters are trained and published (stages/lora.py; None: the whole model). epochs, mini_batches:
        each batch trained in `epochs` passes of `mini_batches` optimizer steps (train.epochs, train.mini_batches).
        distill: train.distill ({teacher: a model directory, coef, reward_weight}): on-policy distillation from the
        frozen teacher (stages/distill.py; None: none)."""
        import deepspeed

        loss_agg_mode = loss_agg_mode_of(loss_agg, max_new_tokens)
        if algo not in policy_losses.POLICY_LOSSES:
            raise ValueError(f"algo must be one of {', '.join(policy_losses.POLICY_LOSSES)}; got {algo!r}")
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
        self.algo, self.entropy_coef, self.overlong = algo, entropy_coef, overlong
        self.max_tokens = max_new_tokens if loss_agg_mode == "seq-mean-token-sum-norm" else None
        options = dict(algo_options or {})
        #: PPO's critic and GAE options (stages/critic.py), not the policy loss's
        ppo = {k: options.pop(k) for k in critic.OPTIONS if k in options} if algo == "ppo" else None
        #: REINFORCE++ folds the KL into the per-token reward (then it is no loss term)
        kl_in_reward = options.pop("kl_in_reward", True)
        self.kl_in_reward = (algo in advantages.TOKEN_LEVEL or algo == "ppo") and kl_coef > 0 and kl_in_reward
        self.kl_estimator = kl_estimator or ("k1" if self.kl_in_reward else "k3")
        self._policy_loss = policy_losses.POLICY_LOSSES[algo]
        clip = {} if algo in ("gspo", "cispo") else {"clip_low": clip_low, "clip_high": clip_high}  # theirs: options
        self._loss_kwargs = {**clip, **options, "max_importance_ratio": max_importance_ratio, **self.off_policy}
        self.temperature = temperature
        if epochs < 1 or mini_batches < 1:
            raise ValueError(f"epochs and mini_batches must be >= 1, got {epochs} and {mini_batches}")
        #: passes over each batch, and optimizer steps per pass (train.epochs, train.mini_batches)
        self.epochs, self.mini_batches = epochs, mini_batches
        self.optimizer_steps = epochs * mini_batches  # per batch
        self.version = 0
        if micro_batch_tokens is not None and micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
        self.packing = packing
        #: tokens per packed micro-batch, for shard_batch's max_tokens (None: micro-batches counted in rows)
        self.micro_batch_tokens = micro_batch_tokens if packing else None
        #: packed micro-batches also bounded in rows (the DeepSpeed config's): micro_batch_tokens was not declared
        self._rows_too = False

        torch.manual_seed(seed)
        if torch.cuda.is_available():  # TF32 tensor cores for fp32 matmuls and convolutions (fp32 accumulation)
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
            # The bf16 step measured 8x slower than fp32 on an H100 (docs/guides/gpus.md). Likeliest cause, not yet
            # confirmed on a GPU: PyTorch's cuDNN attention (bf16 only) builds a plan per new input shape (hundreds
            # of ms), and micro-batches change shape every pass. Flash / memory-efficient attention do not.
            torch.backends.cuda.enable_cudnn_sdp(False)
        init_distributed()
        cfg = engine_config(deepspeed_config, lr, micro_batch_size, dtype)
        self.lr, self.lr_schedule = lr, lr_schedule
        if "scheduler" in cfg and lr_schedule and (lr_schedule.get("kind") != "constant" or lr_schedule.get("warmup_steps")):
            raise ValueError("the DeepSpeed config has a 'scheduler' and the train stage sets lr_schedule/lr_warmup_steps; "
                             "keep one (remove 'scheduler' from the DeepSpeed config to use the stage's)")
        self.micro_batch_size = int(cfg["train_micro_batch_size_per_gpu"])
        zero3 = cfg.get("zero_optimization", {}).get("stage", 0) == 3

        if lora is not None and zero3:
            raise ValueError("train.lora runs under ZeRO 0-2 (the adapters are small and the base is frozen); "
                             "use configs/deepspeed/zero1.json")
        model = load_model(model_dir, cfg if zero3 else None)
        model.config.use_cache = False
        if packing and micro_batch_tokens is None:  # packed rows short enough that attention stays cheap
            self.micro_batch_tokens = row_token_bound(model.config, getattr(model.config, "_attn_implementation", None))
            self._rows_too = self.micro_batch_tokens is not None
        if pad_token_id is None:
            pad_token_id = getattr(model.config, "pad_token_id", None) or 0  # padding is masked: any id works
        self.pad_token_id = int(pad_token_id)
        ref = None
        if kl_coef > 0:  # under ZeRO-3 partitioned like the policy; else a copy on each rank
            ref = load_model(model_dir, cfg) if zero3 else copy.deepcopy(model)
            ref.config.use_cache = False
            ref.eval().requires_grad_(False)
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.lora = lora
        if lora is not None:  # after the reference copy: the reference is the base model
            from rlflow.stages import lora as lora_adapters

            lora_adapters.inject(model, lora)
        trained = [p for p in model.parameters() if p.requires_grad]  # the optimizer sees only these (LoRA: adapters)
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=trained, config=cfg)
        # Dropout off for good: the ratio and importance weights compare log-probs of the same weights.
        self.engine.eval()
        if lora is not None:
            lora_adapters.dropout_on(self.engine.module)  # train.lora.dropout, LoRA's own regulariser (0: none)
        if gradient_checkpointing:
            checkpoint_layers_in_eval(self.engine.module)
        self.ref_model = self._frozen(ref, cfg, zero3) if ref is not None else None
        #: on-policy distillation's teacher (train.distill), frozen like the reference: its own weights
        self.distill = {"coef": distill.get("coef", 1.0), "reward_weight": distill.get("reward_weight", 1.0)} \
            if distill is not None else None
        teacher = None
        if distill is not None:
            teacher = load_model(distill["teacher"], cfg if zero3 else None)
            if teacher.config.vocab_size != model.config.vocab_size:  # a builtin student is known only now
                raise ValueError(f"train.distill.teacher {distill['teacher']} has a vocabulary of "
                                 f"{teacher.config.vocab_size} tokens and the student {model.config.vocab_size}: "
                                 "the teacher cannot score the student's tokens; use a teacher of its tokenizer")
            teacher.config.use_cache = False
            teacher.eval().requires_grad_(False)
        self.teacher = self._frozen(teacher, cfg, zero3) if teacher is not None else None
        chunked = logit_chunk_tokens != 0 and supports(model)  # attached after deepspeed.initialize (its docstring)
        self._logprobs = TokenLogprobs(model, logit_chunk_tokens) if chunked else None
        self._ref_logprobs = TokenLogprobs(ref, logit_chunk_tokens) if chunked and ref is not None else None
        self._teacher_logprobs = (TokenLogprobs(teacher, logit_chunk_tokens)
                                  if teacher is not None and logit_chunk_tokens != 0 and supports(teacher) else None)
        self._check_forward(dtype)
        self.critic = None
        if ppo is not None:  # PPO's critic: its own engine and optimizer on these ranks (stages/critic.py)
            value_lm = load_model(ppo.pop("critic_model", None) or model_dir, cfg if zero3 else None)
            if gradient_checkpointing:
                value_lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.critic = critic.Critic(value_lm, cfg, lr, **ppo)
            if gradient_checkpointing:
                checkpoint_layers_in_eval(self.critic.engine.module)

    # ------------------------------------------------------------------ batching

    def _frozen(self, model, cfg: dict, zero3: bool):
        """A model that only scores (the reference, the teacher): under ZeRO-3 an engine without optimizer, which
        gathers the partitioned weights per layer; else the model on the engine's device in its compute dtype, so
        its log-probs compare like with like."""
        import deepspeed

        if zero3:
            inference = {k: v for k, v in cfg.items() if k not in ("optimizer", "scheduler")}
            engine, *_ = deepspeed.initialize(model=model, config=inference)
            engine.eval()  # DeepSpeedEngine.eval returns None, not the engine
            return engine
        return model.to(self.engine.device, dtype=next(self.engine.module.parameters()).dtype)

    def _micro_batches(self, shard: BatchShard) -> list[packing.MicroBatch]:
        """Exactly shard.micro_batches micro-batches: packed rows of near-equal tokens, or length-sorted padded rows
        (less padding); order does not matter as the loss is normalised batch-wide. A part without rows is a masked
        pad row: the rank still runs the pass its peers run (collectives)."""
        rows = list(shard.trajectories)
        costs = [cost(t) for t in rows]
        split = packing.split_by_tokens if self.packing else packing.split_by_rows
        batches = []
        for part in split(costs, shard.micro_batches):
            members = [rows[i] for i in part] or [shard.pad]
            advantages = [shard.advantages[i] for i in part] or [0.0]
            if self.packing:
                mb = packing.packed(members, advantages, trained=bool(part))
            else:
                mb = packing.padded(members, advantages, self.pad_token_id, trained=bool(part))
            batches.append(mb.to(self.engine.device))
        return batches

    def _forward(self, model, head: TokenLogprobs | None, input_ids, *, attention_mask=None, position_ids=None,
                 entropy: bool | str = False, chunks: int | None = None,
                 mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """([B, L-1] log-probs of input_ids[:, 1:] at the sampler's temperature, their entropy or None): the lm_head
        in `chunks` runs when `head` is attached to `model`, else from the full logits. entropy "grad": with its
        gradient (the entropy bonus), else a metric. mask: the micro-batch's trained positions; with `head`, the
        lm_head runs on them alone and the other positions read 0 (every loss and metric is masked by it)."""
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        if head is not None:
            positions = None if mask is None else mask > 0
            with head.request(input_ids[:, 1:], self.temperature, entropy, chunks, positions):
                return model(**inputs, **TokenLogprobs.FORWARD_KWARGS)
        logits = model(**inputs, use_cache=False).logits[:, :-1].float() / self.temperature
        logprobs = grpo.token_logprobs(logits, input_ids[:, 1:])
        if not entropy:
            return logprobs, None
        with torch.no_grad() if entropy != "grad" else contextlib.nullcontext():
            return logprobs, grpo.entropy_from_logits(logits)

    def _chunks(self, batches: list[packing.MicroBatch]) -> int | None:
        """lm_head runs per forward this step: enough for the most trained positions of any rank's micro-batch, the
        same on every rank (ZeRO-3 gathers the lm_head weight for each run, a collective)."""
        if self._logprobs is None:
            return None
        longest = torch.tensor([max(int((mb.mask > 0).sum()) for mb in batches)], device=self.engine.device)
        torch.distributed.all_reduce(longest, op=torch.distributed.ReduceOp.MAX)
        return self._logprobs.chunks_for(int(longest.item()))

    def _check_forward(self, dtype: str) -> None:
        """Once, on the weights being trained: the chunked lm_head must give the full logits' log-probs (a model that
        transforms its logits after the lm_head, e.g. soft-capping, falls back to full logits) and packed sequences
        must not see each other. Deviations are the max over ranks, so every rank decides alike."""
        device = self.engine.device

        def logprobs_of(head):
            def run(ids, positions):
                with torch.no_grad():
                    out, _ = self._forward(self.engine, head, ids.to(device),
                                           position_ids=None if positions is None else positions.to(device))
                return out.float()
            return run

        vocab = self.engine.module.config.vocab_size
        ids = (torch.arange(2, 14) % vocab)[None]
        deviations = {"chunked": 0.0, "crossed": 0.0, "moved": 0.0}
        if self._logprobs is not None:
            chunked, full = logprobs_of(self._logprobs)(ids, None), logprobs_of(None)(ids, None)
            deviations["chunked"] = (chunked - full).abs().mean().item()
        if self.packing:
            deviations.update(packing.probe(logprobs_of(self._logprobs), vocab))
        values = torch.tensor(list(deviations.values()), device=device)
        torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
        deviations = dict(zip(deviations, values.tolist()))
        # rounding only: ~1e-7 in fp32 on a CPU; bf16, fp16 and TF32 round logits to ~3 significant digits
        tolerance = 1e-3 if dtype == "float32" and not torch.cuda.is_available() else 0.1
        if deviations["chunked"] > tolerance:
            warnings.warn(f"{type(self.engine.module).__name__}: the chunked lm_head's log-probs differ from the full "
                          f"logits' by {deviations['chunked']:.3g} (logits transformed after the lm_head?); "
                          "using full logits", stacklevel=2)
            self._logprobs = self._ref_logprobs = None
        if self.packing and (why := packing.problem(deviations, tolerance)):
            raise ValueError(f"train.packing cannot be used with {type(self.engine.module).__name__}: {why}; "
                             "set packing: false")

    # ------------------------------------------------------------------ training

    def train_step(self, trajectories: list[Trajectory], group_size: int) -> dict[str, float]:
        """One optimizer step on whole groups of `group_size` trajectories (this process is the only rank)."""
        check_batch(trajectories, group_size)
        (shard,) = self.shards(trajectories, 1)
        return self.train_shard(shard)

    def shards(self, trajectories: list[Trajectory], world_size: int) -> list[BatchShard]:
        """The batch cut for `world_size` ranks, with this algorithm's sequence-level advantages and reward shaping."""
        return shard_batch(trajectories, world_size, self.micro_batch_size, self.micro_batch_tokens,
                           rows_too=self._rows_too, advantages=advantages.ESTIMATORS[self.algo], overlong=self.overlong,
                           mini_batches=self.mini_batches)

    def _token_advantages(self, batches: list[packing.MicroBatch], world_size: int) -> None:
        """Token-level estimators (REINFORCE++): each micro-batch's rewards become per-token returns, the KL to the
        reference folded in (KL(t) of pi_behaviour, the policy that sampled: pi_old's log-probs come from the
        training forward, after this), whitened over every token of the batch on all ranks."""
        totals = torch.zeros(3, device=self.engine.device)
        for mb in batches:
            token_rewards = None
            if self.kl_in_reward:
                token_rewards = kl.kl_reward(mb.behaviour_logprobs, mb.ref_logprobs.float(), mb.mask, self.kl_coef,
                                             self.kl_estimator)
            mb.advantages = advantages.token_returns(mb.advantages, token_rewards, mb.mask, mb.segments)
            totals += advantages.moments(mb.advantages, mb.mask)
        if world_size > 1:
            torch.distributed.all_reduce(totals)
        for mb in batches:
            mb.advantages = advantages.whiten(mb.advantages, mb.mask, totals)

    def train_shard(self, shard: BatchShard) -> dict[str, float]:
        """This rank's part of one batch: epochs x mini_batches optimizer steps (one by default), then one new weights
        version; every rank of the process group calls it with its shard of the same batch. Returns this rank's
        metrics, means over the optimizer steps (batch_shards.merge_rank_metrics adds them up over the ranks)."""
        t0 = time.perf_counter()
        batches = self._micro_batches(shard)
        num_tokens, num_sequences = shard.num_tokens, shard.num_sequences
        chunks = self._chunks(batches)
        if self.ref_model is not None:
            with torch.no_grad():
                for mb in batches:
                    mb.ref_logprobs, _ = self._forward(self.ref_model, self._ref_logprobs, mb.input_ids, chunks=chunks,
                                                       attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                                                       mask=mb.mask)
        if self.algo in advantages.TOKEN_LEVEL:
            self._token_advantages(batches, shard.world_size)
        if self.critic is not None:  # GAE on the critic's values, the KL to the reference in the per-token reward
            kl_rewards = [kl.kl_reward(mb.behaviour_logprobs, mb.ref_logprobs.float(), mb.mask, self.kl_coef,
                                       self.kl_estimator) if self.kl_in_reward else None for mb in batches]
            value_targets = self.critic.advantages(batches, kl_rewards, shard.world_size)

        distilled = self._distill(batches, chunks, num_tokens) if self.teacher is not None else {}
        if self.optimizer_steps > 1:  # pi_old: the weights before the batch's first optimizer step, taken once
            with torch.no_grad():
                for mb in batches:
                    mb.old_logprobs, _ = self._forward(self.engine, self._logprobs, mb.input_ids, chunks=chunks,
                                                       attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                                                       mask=mb.mask)
        size = len(batches) // self.mini_batches  # shard_batch made the count a multiple: equal parts on every rank
        parts = [batches[k * size:(k + 1) * size] for k in range(self.mini_batches)]
        sums: dict[str, float] = {}
        weight_max, finite, applied = 0.0, True, True
        if self.lr_schedule and self.engine.lr_scheduler is None:  # the schedule moves per batch (version), not per
            for group in self.engine.optimizer.param_groups:      # optimizer step: `steps` counts batches
                group["lr"] = self.lr * lr_factor(self.lr_schedule, self.version)
        lr = float(self.engine.optimizer.param_groups[0]["lr"])  # the rate this step uses, whoever set it
        for _epoch in range(self.epochs):
            for part in parts:
                counts = (num_tokens, num_sequences) if len(parts) == 1 else self._counts(part, shard.world_size)
                stats, grad_norm, step_applied = self._optimizer_step(part, chunks, shard.world_size, *counts)
                weight_max = max(weight_max, stats.pop("importance_weight_max"))
                for key, value in stats.items():
                    sums[key] = sums.get(key, 0.0) + value / self.optimizer_steps  # means over the optimizer steps
                sums.setdefault("ratio_mean_first", stats["ratio_mean"])  # 1 on fresh data: pi_old is these weights
                sums["ratio_mean_last"] = stats["ratio_mean"]
                finite = finite and grad_norm is not None and math.isfinite(grad_norm) and math.isfinite(stats["loss"])
                applied = applied and step_applied
        self.version += 1
        if self.optimizer_steps == 1:  # one step a batch: its ratio is the step's, reported as ratio_mean
            del sums["ratio_mean_first"], sums["ratio_mean_last"]
        # the critic keeps its own number of optimizer steps a batch (ppo.critic_epochs)
        critic_metrics = self.critic.train(batches, value_targets, num_tokens, shard.world_size, optimizer_held) \
            if self.critic else {}
        return {
            **sums,
            # "": finite; "skipped": a non-finite loss or gradient, not applied (the weights are as before);
            # "poisoned": the update made the weights non-finite (e.g. a learning rate too large)
            "nonfinite": nonfinite_verdict(sums["loss"] if finite else math.nan, grad_norm, applied,
                                           self._weights_finite()),
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "importance_weight_max": weight_max,
            "reward_mean": shard.reward_mean,
            "tokens": int(sum(float(mb.mask.sum()) for mb in batches)),
            "micro_batches": len(batches),
            **({"optimizer_steps": self.optimizer_steps} if self.optimizer_steps > 1 else {}),
            "step_time_s": time.perf_counter() - t0,
            "version": self.version,
            "lr": lr,
            **critic_metrics,
            **distilled,
        }

    def _distill(self, batches: list[packing.MicroBatch], chunks: int | None, num_tokens: float) -> dict[str, float]:
        """On-policy distillation (stages/distill.py): each micro-batch's advantages become per-token, the teacher's
        log-probs of the sampled tokens against the sampler's added in. Returns this rank's part of the batch's mean
        reverse KL (to the teacher, on the samples)."""
        kl_sum = 0.0
        with torch.no_grad():
            for mb in batches:
                teacher, _ = self._forward(self.teacher, self._teacher_logprobs, mb.input_ids, chunks=chunks,
                                           attention_mask=mb.attention_mask, position_ids=mb.position_ids, mask=mb.mask)
                kl_sum += distill.reverse_kl(teacher, mb.behaviour_logprobs, mb.mask)[0]
                mb.advantages = distill.token_advantages(mb.advantages, teacher, mb.behaviour_logprobs, mb.mask,
                                                         **self.distill)
        return {"distill_reverse_kl": kl_sum / max(num_tokens, 1.0)}

    def _counts(self, part: list[packing.MicroBatch], world_size: int) -> tuple[float, float]:
        """(trained tokens, non-empty sequences) of a mini-batch on all ranks: its loss normalisers."""
        counts = torch.zeros(2, device=self.engine.device)
        for mb in part:
            counts[0] += mb.mask.sum()
            counts[1] += (loss_agg.sequence_sums(mb.mask.float(), mb.segments) > 0).sum()
        if world_size > 1:
            torch.distributed.all_reduce(counts)
        return float(counts[0]), float(counts[1])

    def _optimizer_step(self, part: list[packing.MicroBatch], chunks: int | None, world_size: int, num_tokens: float,
                        num_sequences: float) -> tuple[dict[str, float], float | None, bool]:
        """One optimizer step on `part`'s micro-batches, its loss normalised over the part on all ranks: (this rank's
        metrics, each a part-wide sum or token-weighted mean; the pre-clip grad norm; whether the step was applied)."""
        normalizer = loss_agg.normalizer_of(self.loss_agg, num_tokens, num_sequences)
        agg = {"loss_agg": self.loss_agg, "normalizer": normalizer, "max_tokens": self.max_tokens}
        token_means = ("clip_frac", "ratio_mean", "importance_weight_mean", "importance_weight_used_mean",
                       "importance_truncated_frac", "importance_masked_frac")
        sums = dict.fromkeys(("loss", "pg_loss", "kl", "entropy", *token_means), 0.0)
        weight_max = 0.0
        for k, mb in enumerate(part):
            self.engine.set_gradient_accumulation_boundary(k == len(part) - 1)
            logprobs, entropy = self._forward(self.engine, self._logprobs, mb.input_ids, chunks=chunks,
                                              entropy="grad" if self.entropy_coef > 0 else True,
                                              attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                                              mask=mb.mask)
            if self.optimizer_steps == 1:
                # pi_old, the proximal policy, is the weights at the start of this step, and the batch is one
                # optimizer step: the weights of this forward. Its log-probs, detached, are pi_old's, so no separate
                # no-grad forward is run for them (a quarter of the step's forward and backward compute)
                mb.old_logprobs = logprobs.detach()
            pg_loss, stats = self._policy_loss(logprobs, mb.old_logprobs, mb.behaviour_logprobs, mb.advantages, mb.mask,
                                               segments=mb.segments, **agg, **self._loss_kwargs)
            loss = pg_loss
            if self.ref_model is not None:
                with torch.no_grad() if self.kl_in_reward else contextlib.nullcontext():  # in the reward: a metric
                    kl_term = kl.kl_penalty(logprobs, mb.ref_logprobs, mb.mask, segments=mb.segments,
                                            estimator=self.kl_estimator, **agg)
                if not self.kl_in_reward:
                    loss = loss + self.kl_coef * kl_term
                sums["kl"] += kl_term.item()
            if self.entropy_coef > 0:
                loss = loss - policy_losses.entropy_bonus(entropy, mb.mask, self.entropy_coef, segments=mb.segments,
                                                          **agg)
            # DeepSpeed averages gradients over the ranks; each rank's loss is its part of the batch's sum
            self.engine.backward(loss * world_size)

            share = float(mb.mask.sum()) / max(num_tokens, 1.0)  # token-weighted means across micro-batches
            sums["entropy"] += float((entropy.detach() * mb.mask).sum()) / max(num_tokens, 1.0)
            sums["loss"] += loss.item()
            sums["pg_loss"] += pg_loss.item()
            for key in token_means:
                sums[key] += stats[key] * share
            if mb.mask.sum() > 0:
                weight_max = max(weight_max, stats["importance_weight_max"])
        grad_norm = self._grad_norm_stage0() if self.engine.zero_optimization_stage() == 0 else None
        # a non-finite gradient is not applied: ZeRO 1-3 skip the step themselves (their overflow check, fp32 and
        # bf16 alike); without ZeRO the plain torch optimizer would apply it (and poison its moments), so it is held
        # here. The norm is taken after the all-reduce, so every rank decides alike.
        held = grad_norm is not None and not math.isfinite(grad_norm)
        frozen = self.critic is not None and self.version < self.critic.warmup_steps  # ppo.critic_warmup_steps
        with optimizer_held(self.engine.optimizer) if held or frozen else contextlib.nullcontext():
            self.engine.step()  # its bookkeeping (step count, zeroed gradients) runs either way
        if grad_norm is None:
            grad_norm = self.engine.get_global_grad_norm()  # ZeRO 1-3 optimizers record the pre-clip norm
        return {**sums, "importance_weight_max": weight_max}, grad_norm, not held and self.engine.was_step_applied()

    def _weights_finite(self) -> bool:
        """Whether every weight this rank holds is finite (under ZeRO-3 its partition: each rank checks its own)."""
        with torch.no_grad():  # one device sync for the whole check, not one per parameter (it runs every step)
            flags = [torch.isfinite(getattr(p, "ds_tensor", p)).all() for p in self.engine.module.parameters()]
            return bool(torch.stack(flags).all()) if flags else True

    def _grad_norm_stage0(self) -> float:
        """Pre-clip global grad norm; without ZeRO the plain torch optimizer does not record it."""
        norms = [p.grad.detach().float().norm() for p in self.engine.module.parameters() if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0

    # ------------------------------------------------------------------ weights and checkpoints

    def state_numpy(self) -> dict[str, np.ndarray]:
        """Full weights under the HF state-dict names, as contiguous fp32 CPU numpy copies (tests and tools: one
        whole fp32 copy on purpose; publishing goes bucket by bucket in the training dtype, `weight_buckets`).
        Under ZeRO-3 every rank must call this."""
        return {name: t.to("cpu", torch.float32).numpy().copy(order="C")
                for layout, bucket in self.weight_buckets() for name, t in zip(layout.names, bucket)}

    def weight_buckets(self, bucket_bytes: int = BUCKET_BYTES):
        """The weights as (layout, tensors) a bucket at a time, as the engine holds them (device, training dtype:
        no conversion, no whole-model copy); under ZeRO-3 each bucket is gathered in turn and every rank must
        iterate in step. The tensors are valid until the next bucket is asked for."""
        return module_buckets(self.engine.module, bucket_bytes, gather=self.gathers_to_publish, keep=self._published)

    def weight_layouts(self, bucket_bytes: int = BUCKET_BYTES):
        """The buckets `weight_buckets` will yield, known before any is gathered (a receiver allocates from them)."""
        return module_layouts(self.engine.module, bucket_bytes, keep=self._published)

    @property
    def _published(self):
        """Which tensors a version carries: with LoRA the adapters alone (the base never changes), else all."""
        from rlflow.stages.lora import is_adapter

        return is_adapter if self.lora is not None else None

    @property
    def gathers_to_publish(self) -> bool:
        """Whether publishing the weights needs every rank (ZeRO-3 shards the parameters themselves)."""
        return self.engine.zero_optimization_stage() == 3

    def save_checkpoint(self, dir: str, client_state: dict | None = None, tag: str | None = None) -> dict[str, int]:
        """DeepSpeed checkpoint (weights, optimizer, engine counters) plus the version and `client_state`, under `tag`
        in `dir`. With a tag DeepSpeed writes no `latest` file: the caller publishes the tag itself
        (rlflow/runtime/checkpoint.py); without one, DeepSpeed's global_step<N> and `latest`. Returns the
        counters a resume checks against the run's state (`counters`)."""
        from rlflow.runtime.fault_points import reach

        state = {_CLIENT_KEY: {"version": self.version, "client": dict(client_state or {})}}
        engine, step = self.engine.checkpoint_engine, int((client_state or {}).get("step", self.version))
        save_file = engine.save

        def save_then_fault(*args, **kwargs):  # a fault point after DeepSpeed's first file of the tag
            out = save_file(*args, **kwargs)
            reach("trainer_file", step)
            return out

        engine.save = save_then_fault
        try:
            self.engine.save_checkpoint(dir, tag=tag, client_state=state, save_latest=tag is None)
        finally:
            engine.save = save_file
        if self.critic is not None:
            self.critic.save(dir, tag)
        return self.counters()

    def load_checkpoint(self, dir: str, tag: str | None = None) -> dict[str, Any]:
        """Restore the checkpoint `tag` in `dir` (None: the one DeepSpeed's `latest` names) into this trainer (call on a
        fresh one); returns the saved client_state."""
        path, state = self.engine.load_checkpoint(dir, tag=tag)
        if path is None:
            where = f"tag {tag!r}" if tag else "a 'latest' file"
            raise FileNotFoundError(f"no DeepSpeed checkpoint found in {dir!r} (expected {where})")
        ours = state.get(_CLIENT_KEY)
        if ours is None:
            raise ValueError(f"{path}: a DeepSpeed checkpoint not written by DeepSpeedTrainer.save_checkpoint")
        self.version = int(ours["version"])
        if self.critic is not None:
            self.critic.load(dir, tag)
        return ours["client"]

    def counters(self) -> dict[str, int]:
        """The weights version and the engine's optimizer step count (DeepSpeed's global_steps, saved and restored
        with a checkpoint): a resume checks both against the run's state."""
        return {"version": self.version, "optimizer_steps": int(self.engine.global_steps)}

    def close(self) -> None:
        """Drop the engine and models. The process group stays: it is process-wide and other engines may share it."""
        self.engine = None
        self.ref_model = self.teacher = None
        self._logprobs = self._ref_logprobs = self._teacher_logprobs = None
        self.critic = None
