"""What the trainer needs before its first step: the process group, the DeepSpeed engine config, the model loaded
(whole, or partitioned across the ranks under ZeRO-3), and activation checkpointing that works in eval mode.

stages/trainer.py builds its DeepSpeedTrainer from these; rlflow/runtime/trainer_worker.py picks the rendezvous port
with `free_port`.
"""

from __future__ import annotations

import copy
import json
import os
import socket
from datetime import timedelta

import torch

#: how long a collective (or joining the process group) may wait for the other ranks before it fails
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_distributed() -> None:
    """Join (or create) the process group DeepSpeed needs: the ranks' launcher (trainer_worker.py) sets RANK,
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


def engine_config(deepspeed_config: str | dict, lr: float, micro_batch_size: int | None, dtype: str = "float32") -> dict:
    if isinstance(deepspeed_config, (str, os.PathLike)):
        with open(deepspeed_config) as f:
            cfg = json.load(f)
    else:
        cfg = copy.deepcopy(deepspeed_config)
    cfg.setdefault("optimizer", {"type": "AdamW", "params": {}})
    params = cfg["optimizer"].setdefault("params", {})
    params["lr"] = lr
    if not torch.cuda.is_available() and cfg["optimizer"].get("type", "").lower() in ("adam", "adamw"):
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


def load_model(model_dir: str, zero3_config: dict | None = None):
    """The causal LM in fp32; with a ZeRO-3 config, built inside deepspeed.zero.Init (each rank holds only its
    partition, in the config's dtype) and filled one tensor at a time from the safetensors checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if zero3_config is None:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    import deepspeed
    from transformers.initialization import no_init_weights

    with no_init_weights(), deepspeed.zero.Init(config_dict_or_path=zero3_config):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    model.tie_weights()
    fill_partitioned(model, model_dir)
    return model


def fill_partitioned(model, model_dir: str) -> None:
    """Copy a safetensors checkpoint into a ZeRO-3 partitioned model: per parameter, every rank gathers it, rank 0
    reads that one tensor (memory-mapped) and writes it, and the exit re-partitions it from rank 0."""
    import deepspeed
    from safetensors import safe_open

    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(model_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{model_dir}: ZeRO-3 loads safetensors weights and found none; "
                                "re-save the model with save_pretrained(safe_serialization=True)")
    params = dict(model.named_parameters())  # a tied weight appears once, under its first name
    writer = torch.distributed.get_rank() == 0
    for name in files:
        with safe_open(os.path.join(model_dir, name), framework="pt") as f:
            for key in f.keys():  # the file's own order: the same on every rank
                param = params.pop(key if key in params else f"{model.base_model_prefix}.{key}", None)
                if param is None:
                    continue  # the second name of a tied weight
                with deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
                    if writer:
                        param.copy_(f.get_tensor(key))
    if params:
        raise ValueError(f"{model_dir}: the checkpoint has no weights for {', '.join(sorted(params)[:4])}")


def checkpoint_layers_in_eval(module) -> None:
    """transformers checkpoints a decoder layer only while the layer is in training mode, and the trainer keeps
    its model in eval (no dropout): flag the layers themselves; their submodules, dropout included, stay in eval."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    for m in module.modules():
        if isinstance(m, GradientCheckpointingLayer):
            m.training = True
