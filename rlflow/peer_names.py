"""The names users of other RL post-training frameworks bring, mapped to rlflow's fields, for "did you mean".

String similarity alone points a TRL user who writes `learning_rate` at `lr_min_ratio`; this table knows it is `lr`.
It is read before string similarity when a pipeline has an unknown field (rlflow/validate.py), and also says where
rlflow's field lives when that is not where it was written (`num_generations` under the train stage belongs to the
rollout stage: `group_size`).

Who uses which name (the frameworks' own config classes / flags, as of 2025):

- TRL (`GRPOConfig`, `PPOConfig`, `ModelConfig`, the Trainer's `TrainingArguments` and the example scripts'
  `ScriptArguments`): learning_rate, lr_scheduler_type, warmup_steps, warmup_ratio, max_steps, save_steps, eval_steps,
  per_device_train_batch_size, gradient_accumulation_steps, num_iterations, max_grad_norm, bf16, num_generations,
  max_completion_length, max_prompt_length, beta, epsilon, epsilon_high, cliprange, loss_type, reward_funcs,
  reward_weights, use_vllm, vllm_gpu_memory_utilization, model_name_or_path, torch_dtype, use_peft, lora_r,
  lora_alpha, dataset_name, dataset_train_split, temperature, top_p.
- verl (ppo_trainer.yaml, Hydra keys): data.train_files, data.prompt_key, data.train_batch_size,
  data.max_prompt_length, data.max_response_length, actor_rollout_ref.rollout.{n, response_length, temperature,
  top_p, gpu_memory_utilization, max_num_seqs}, actor_rollout_ref.actor.{ppo_epochs, ppo_mini_batch_size,
  ppo_micro_batch_size_per_gpu, ppo_max_token_len_per_gpu, clip_ratio, clip_ratio_low, clip_ratio_high,
  entropy_coeff, use_kl_loss, kl_loss_coef, kl_loss_type, loss_agg_mode, grad_clip}, actor.optim.{lr,
  lr_warmup_steps_ratio, min_lr_ratio, warmup_style}, algorithm.{adv_estimator, kl_ctrl.kl_coef},
  trainer.{total_training_steps, save_freq, test_freq}, model.{lora_rank, lora_alpha, target_modules}.
- OpenRLHF (`train_ppo_ray` flags): pretrain, prompt_data, prompt_split, input_key, label_key, apply_chat_template,
  max_samples, prompt_max_len, generate_max_len, max_epochs, n_samples_per_prompt, rollout_batch_size, train_batch_size,
  micro_train_batch_size, actor_learning_rate, critic_learning_rate, lr_warmup_ratio, lr_scheduler, init_kl_coef,
  kl_estimator, eps_clip, eps_clip_low_high, entropy_loss_coef, advantage_estimator, zero_stage, max_norm,
  vllm_num_engines, vllm_gpu_memory_utilization, lora_rank, lora_alpha, remote_rm_url, reward_pretrain, save_steps,
  eval_steps, temperature, top_p, bf16.
- vLLM's `SamplingParams` / engine arguments (which verl and TRL pass on): n, max_tokens, max_num_seqs.

Not mapped, for want of an rlflow field: top_k, min_p, repetition_penalty (sampling), weight_decay and the Adam betas
(set in the DeepSpeed config file), tensor_parallel_size (a vLLM instance spans its stage's `num_gpus`).
tests/unit/compiler/test_peer_names.py checks that every target here is a real field of its place.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from rlflow.schema import BufferStage, DataSpec, ModelSpec, Pipeline, RewardStage, RolloutStage, TrainStage

#: where an rlflow field lives: a stage kind, the model / data block, or the top level of the pipeline
PLACES: dict[str, type] = {"rollout": RolloutStage, "reward": RewardStage, "buffer": BufferStage, "train": TrainStage,
                           "model": ModelSpec, "data": DataSpec, "pipeline": Pipeline}


@dataclass(frozen=True)
class PeerName:
    """A name another framework uses, as rlflow spells it and where."""

    place: str  # a key of PLACES
    field: str  # rlflow's field there
    who: tuple[str, ...]  # the frameworks that use the name ("" none in particular)
    meaning: str = ""  # what the peer's name means in rlflow, where that differs from the field's own meaning
    spelled: str = ""  # how the peer writes it, where that is more than the key (verl's actor_rollout_ref.rollout.n)
    only_in: tuple[str, ...] = ()  # places where a short, ambiguous name is read as the peer's; () anywhere


def _p(place: str, field: str, *who: str, meaning: str = "", spelled: str = "", only_in: tuple[str, ...] = ()) -> PeerName:
    return PeerName(place, field, who, meaning, spelled, only_in)


_PER_STEP = "rlflow counts groups (prompts) per training step over all ranks; the batch is batch_groups x group_size completions"
_CLIP = "rlflow clips the ratio to [1 - clip_low, 1 + clip_high]; set both for a symmetric clip"
_WARMUP_RATIO = "rlflow counts warmup in steps: the ratio x steps"
_LORA = "train LoRA adapters with lora: {rank: 8, alpha: 16}"
_MICRO = "rlflow bounds a micro-batch by its tokens and accumulates the gradients of a mini-batch's micro-batches itself"
_EPOCHS = "passes over each batch"
_PROMPT = ("rlflow bounds prompt + completion together: a prompt may take max_model_len - max_new_tokens tokens, and a "
           "longer one is rejected")

#: peer name -> rlflow's field; keys as the peer writes its last part (a `--set data.train_batch_size=...` reaches here
#: as `train_batch_size`)
PEER_NAMES: dict[str, PeerName] = {
    # ---- the train stage: optimizer and schedule
    "learning_rate": _p("train", "lr", "TRL"),
    "actor_learning_rate": _p("train", "lr", "OpenRLHF"),
    "critic_learning_rate": _p("train", "ppo", "OpenRLHF", meaning="the critic's learning rate is ppo: {critic_lr: ...}, with algo ppo"),
    "lr_scheduler_type": _p("train", "lr_schedule", "TRL", meaning="constant or cosine"),
    "lr_scheduler": _p("train", "lr_schedule", "OpenRLHF", meaning="constant or cosine"),
    "warmup_style": _p("train", "lr_schedule", "verl", meaning="constant or cosine", spelled="actor.optim.warmup_style"),
    "warmup_steps": _p("train", "lr_warmup_steps", "TRL"),
    "warmup_ratio": _p("train", "lr_warmup_steps", "TRL", meaning=_WARMUP_RATIO),
    "lr_warmup_ratio": _p("train", "lr_warmup_steps", "OpenRLHF", meaning=_WARMUP_RATIO),
    "lr_warmup_steps_ratio": _p("train", "lr_warmup_steps", "verl", meaning=_WARMUP_RATIO),
    "min_lr_ratio": _p("train", "lr_min_ratio", "verl", meaning="with lr_schedule: cosine"),
    "max_steps": _p("train", "steps", "TRL"),
    "num_iterations": _p("train", "epochs", "TRL", meaning=_EPOCHS),
    "ppo_epochs": _p("train", "epochs", "verl", meaning=_EPOCHS),
    "max_epochs": _p("train", "epochs", "OpenRLHF", meaning=_EPOCHS),
    "ppo_mini_batch_size": _p("train", "mini_batches", "verl", meaning="rlflow counts optimizer steps per pass: "
                              "train_batch_size / ppo_mini_batch_size"),
    "total_training_steps": _p("train", "steps", "verl", spelled="trainer.total_training_steps"),
    "gradient_accumulation_steps": _p("train", "micro_batch_tokens", "TRL", meaning=_MICRO),
    "micro_train_batch_size": _p("train", "micro_batch_tokens", "OpenRLHF", meaning=_MICRO),
    "ppo_micro_batch_size_per_gpu": _p("train", "micro_batch_tokens", "verl", meaning=_MICRO),
    "ppo_max_token_len_per_gpu": _p("train", "micro_batch_tokens", "verl", meaning="the same bound: tokens per micro-batch"),
    "max_grad_norm": _p("train", "deepspeed", "TRL", meaning="set gradient_clipping in the DeepSpeed config file it names"),
    "max_norm": _p("train", "deepspeed", "OpenRLHF", meaning="set gradient_clipping in the DeepSpeed config file it names"),
    "grad_clip": _p("train", "deepspeed", "verl", meaning="set gradient_clipping in the DeepSpeed config file it names"),
    "zero_stage": _p("train", "deepspeed", "OpenRLHF", meaning="name a DeepSpeed config: configs/deepspeed/zero0.json ... zero3.json"),
    "save_steps": _p("train", "save_every", "TRL", "OpenRLHF", meaning="a Hugging Face export every N steps; checkpoint_every saves resumable state"),
    "save_freq": _p("train", "checkpoint_every", "verl", spelled="trainer.save_freq"),
    "eval_steps": _p("train", "eval_every", "TRL", "OpenRLHF", meaning="with data.eval"),
    "test_freq": _p("train", "eval_every", "verl", meaning="with data.eval", spelled="trainer.test_freq"),
    # ---- the train stage: the loss
    "beta": _p("train", "kl_coef", "TRL", meaning="the KL penalty's weight; 0 turns the reference model off"),
    "kl_loss_coef": _p("train", "kl_coef", "verl", meaning="the KL penalty's weight; 0 turns the reference model off"),
    "init_kl_coef": _p("train", "kl_coef", "OpenRLHF", meaning="a fixed weight: rlflow has no adaptive KL controller"),
    "use_kl_loss": _p("train", "kl_coef", "verl", meaning="the KL loss is on when kl_coef > 0"),
    "kl_loss_type": _p("train", "kl_estimator", "verl", meaning="kl -> k1, mse -> k2, low_var_kl -> k3"),
    "epsilon": _p("train", "clip_low", "TRL", meaning=_CLIP),
    "epsilon_high": _p("train", "clip_high", "TRL"),
    "cliprange": _p("train", "clip_low", "TRL", meaning=_CLIP),
    "clip_range": _p("train", "clip_low", "Stable-Baselines3", meaning=_CLIP),
    "eps_clip": _p("train", "clip_low", "OpenRLHF", meaning=_CLIP),
    "eps_clip_low_high": _p("train", "clip_low", "OpenRLHF", meaning="its two values are clip_low and clip_high"),
    "clip_ratio": _p("train", "clip_low", "verl", meaning=_CLIP),
    "clip_ratio_low": _p("train", "clip_low", "verl"),
    "clip_ratio_high": _p("train", "clip_high", "verl"),
    "entropy_coeff": _p("train", "entropy_coef", "verl"),
    "entropy_loss_coef": _p("train", "entropy_coef", "OpenRLHF"),
    "loss_type": _p("train", "loss_agg", "TRL", meaning="how token losses are averaged: grpo -> seq-mean-token-mean, "
                    "bnpo and dapo -> token-mean, dr_grpo -> algo: dr_grpo"),
    "loss_agg_mode": _p("train", "loss_agg", "verl", meaning="the same values"),
    "adv_estimator": _p("train", "algo", "verl", meaning="grpo, rloo, reinforce_plus_plus -> reinforce_pp, gae -> ppo",
                        spelled="algorithm.adv_estimator"),
    "advantage_estimator": _p("train", "algo", "OpenRLHF", meaning="grpo, rloo, reinforce_plus_plus -> reinforce_pp, gae -> ppo"),
    # ---- the train stage: LoRA
    "use_peft": _p("train", "lora", "TRL", meaning=_LORA),
    "lora_r": _p("train", "lora", "TRL", meaning=_LORA),
    "lora_rank": _p("train", "lora", "verl", "OpenRLHF", meaning=_LORA),
    "lora_alpha": _p("train", "lora", "TRL", "verl", "OpenRLHF", meaning=_LORA),
    "target_modules": _p("train", "lora", "verl", meaning="lora: {target_modules: [...]}"),
    # ---- the rollout stage
    "num_generations": _p("rollout", "group_size", "TRL", meaning="completions per prompt"),
    "n_samples_per_prompt": _p("rollout", "group_size", "OpenRLHF", meaning="completions per prompt"),
    "n": _p("rollout", "group_size", "verl", meaning="completions per prompt, vLLM's n", spelled="rollout.n", only_in=("rollout",)),
    "max_completion_length": _p("rollout", "max_new_tokens", "TRL"),
    "generate_max_len": _p("rollout", "max_new_tokens", "OpenRLHF"),
    "response_length": _p("rollout", "max_new_tokens", "verl", spelled="rollout.response_length"),
    "max_response_length": _p("rollout", "max_new_tokens", "verl", spelled="data.max_response_length"),
    "max_tokens": _p("rollout", "max_new_tokens", "vLLM", only_in=("rollout",)),
    "temperature": _p("rollout", "temperature", "TRL", "verl", "OpenRLHF", meaning="rlflow samples in its rollout stages"),
    "top_p": _p("rollout", "top_p", "TRL", "verl", "OpenRLHF", meaning="rlflow samples in its rollout stages"),
    "max_num_seqs": _p("rollout", "max_running", "vLLM", "verl", meaning="trajectories one instance generates at once"),
    "vllm_gpu_memory_utilization": _p("rollout", "gpu_memory_utilization", "TRL", "OpenRLHF"),
    "use_vllm": _p("rollout", "engine", "TRL", meaning="engine: vllm"),
    "vllm_num_engines": _p("rollout", "replicas", "OpenRLHF", meaning="rollout instances"),
    # ---- the buffer stage: the batch
    "per_device_train_batch_size": _p("buffer", "batch_groups", "TRL", meaning=_PER_STEP),
    "train_batch_size": _p("buffer", "batch_groups", "verl", "OpenRLHF", meaning="verl counts prompts per step, as "
                           "batch_groups does; OpenRLHF counts completions per optimizer step: batch_groups x "
                           "group_size / mini_batches"),
    "rollout_batch_size": _p("buffer", "batch_groups", "OpenRLHF", meaning="prompts per step"),
    "batch_size": _p("buffer", "batch_groups", meaning=_PER_STEP),  # no one's in particular (a reward stage has its own)
    # ---- the reward stage
    "reward_funcs": _p("reward", "fn", "TRL", meaning="one reward stage's fn; several, weighted: scorers"),
    "reward_weights": _p("reward", "scorers", "TRL", meaning="each scorer has a weight"),
    "reward_pretrain": _p("reward", "model", "OpenRLHF"),
    "remote_rm_url": _p("reward", "http", "OpenRLHF"),
    # ---- the model
    "model_name_or_path": _p("model", "path", "TRL"),
    "pretrain": _p("model", "path", "OpenRLHF"),
    "torch_dtype": _p("model", "dtype", "TRL"),
    "bf16": _p("model", "dtype", "TRL", "OpenRLHF", meaning="dtype: bfloat16"),
    "max_prompt_length": _p("model", "max_model_len", "TRL", "verl", meaning=_PROMPT),
    "prompt_max_len": _p("model", "max_model_len", "OpenRLHF", meaning=_PROMPT),
    # ---- the data
    "dataset_name": _p("data", "source", "TRL"),
    "prompt_data": _p("data", "source", "OpenRLHF"),
    "train_files": _p("data", "source", "verl", spelled="data.train_files"),
    "val_files": _p("data", "eval", "verl", spelled="data.val_files"),
    "dataset_train_split": _p("data", "split", "TRL"),
    "prompt_split": _p("data", "split", "OpenRLHF"),
    "prompt_key": _p("data", "prompt_field", "verl"),
    "input_key": _p("data", "prompt_field", "OpenRLHF"),
    "label_key": _p("data", "answer_field", "OpenRLHF"),
    "apply_chat_template": _p("data", "prompt_format", "OpenRLHF", meaning="prompt_format: chat"),
    "max_samples": _p("data", "limit", "OpenRLHF"),
    # ---- the top level
    "actor_rollout_ref": _p("pipeline", "stages", "verl", meaning="a rollout stage (rollout.n -> group_size, ...) and a "
                            "train stage (actor.optim.lr -> lr, ...)"),
}


def place_of(owner: type | None) -> str | None:
    """The PLACES key of a model class, or None (a nested block such as a rollout stage's coordinator)."""
    return next((place for place, cls in PLACES.items() if cls is owner), None)


def peer_name(name, owner: type | None) -> PeerName | None:
    """The table's entry for `name` written in `owner` (dashes read as underscores), or None."""
    entry = PEER_NAMES.get(str(name).replace("-", "_").lower())
    if entry is None or entry.only_in and place_of(owner) not in entry.only_in:
        return None
    return entry


def _frameworks(who: tuple[str, ...]) -> str:
    names = [f"{w}'s" for w in who]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def explain(name, entry: PeerName) -> str:
    """"TRL's 'num_generations' is rlflow's 'group_size' (completions per prompt)"; '' for rlflow's own name."""
    if str(name) == entry.field:
        return entry.meaning
    spelled = entry.spelled or name
    head = f"{_frameworks(entry.who)} '{spelled}'" if entry.who else f"'{spelled}'"
    return f"{head} is rlflow's '{entry.field}'" + (f" ({entry.meaning})" if entry.meaning else "")


def _under(place: str) -> str:
    return {"model": "under model", "data": "under data", "pipeline": "at the top level"}.get(place, f"under a {place} stage")


def paths(place: str, field: str, data) -> list[str]:
    """Where to write `field` of `place` in this document: stages.<name>.<field> for each stage of that kind."""
    if place == "pipeline":
        return [field]
    if place in ("model", "data"):
        return [f"{place}.{field}"]
    stages = data.get("stages") if isinstance(data, dict) else None
    names = [n for n, s in stages.items() if isinstance(s, dict) and s.get("kind") == place] if isinstance(stages, dict) else []
    return [f"stages.{n}.{field}" for n in names] or [f"stages.<name>.{field} (a stage with kind: {place})"]


def _elsewhere(name, owner: type | None) -> list[str]:
    """The places other than `owner` where `name` is one of rlflow's own fields (`kind` aside: every stage has one)."""
    return [place for place, cls in PLACES.items() if cls is not owner and name != "kind" and str(name) in cls.model_fields]


def _moved(name, note: str, places: list[str], field: str, data) -> tuple[str, str]:
    there = [p for place in places for p in paths(place, field, data)]
    under = " or ".join(_under(p) for p in places)
    what = f"'{name}' belongs {under}" + (f" ({note})" if note else "") if str(name) == field else f"{note}, which belongs {under}"
    return f": {what}", f"set {' or '.join(there)} instead"


def suggest(name, owner: type | None, allowed: list[str], data) -> tuple[str, str | None]:
    """(what follows "unknown field 'name'", a way out or None for the usual one) for an unknown field `name` written
    in `owner` (fields `allowed` there) of the document `data`. In order: a name of TRL, verl or OpenRLHF (the
    table), one of rlflow's fields written in the wrong place, then the closest allowed name (or peer name of a
    field allowed here: `lerning_rate` -> `lr`)."""
    entry = peer_name(name, owner)
    if entry is not None:
        if PLACES[entry.place] is owner:
            return f" (did you mean '{entry.field}'? {explain(name, entry)})", None
        return _moved(name, explain(name, entry), [entry.place], entry.field, data)
    places = _elsewhere(name, owner)
    if places:
        return _moved(name, "", places, str(name), data)
    here = {key: e for key, e in PEER_NAMES.items() if PLACES[e.place] is owner and peer_name(key, owner) is e}
    close = difflib.get_close_matches(str(name), [*allowed, *here], n=1, cutoff=0.6)
    if not close:
        return "", None
    if close[0] in here:
        return f" (did you mean '{here[close[0]].field}'? {explain(close[0], here[close[0]])})", None
    return f" (did you mean '{close[0]}'?)", None
