"""LoRA: low-rank adapters trained and published instead of the whole policy (train.lora).

Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models" (2021), §4.1: a frozen weight W0 gets a trainable
update B A (B: d x r, zero at start; A: r x k), scaled by alpha / r, so h = W0 x + (alpha / r) B A x. Only A and B
are trained, so only they change between versions and only they need to travel: the trainer publishes the adapter
tensors alone (`is_adapter`), and every engine that applies them holds the same injected layers and copies the
adapter into them in place, never reloading W0.

The adapters are injected into the plain Hugging Face model (peft's `inject_adapter_in_model`), not wrapped in a
PeftModel: the model keeps its class, forward and `base_model` (the chunked lm_head of stages/logprobs.py attaches as
before); its weights are then named `...q_proj.base_layer.weight` (W0) and `...q_proj.lora_A.default.weight` (A), the
same names in the trainer and in the `hf` engine. Export (rlflow/runtime/export.py) rebuilds peft's own format:
`peft_model` loads a published adapter onto the base model, which peft saves (`PeftModel.from_pretrained` loads
it) or merges (W0 + (alpha / r) B A, a plain model).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

#: peft's name of the one adapter rlflow trains
ADAPTER = "default"
#: the name prefix a PeftModel puts before the injected model's names (PeftModel.base_model -> LoraModel.model)
PEFT_PREFIX = "base_model.model."


def lora_config(lora: Mapping[str, Any]):
    """peft's LoraConfig of a train.lora block ({rank, alpha, target_modules, dropout})."""
    from peft import LoraConfig

    return LoraConfig(r=int(lora["rank"]), lora_alpha=float(lora["alpha"]), target_modules=list(lora["target_modules"]),
                      lora_dropout=float(lora.get("dropout", 0.0)), bias="none", task_type="CAUSAL_LM")


def is_adapter(name: str) -> bool:
    """Whether a state-dict name is a LoRA adapter tensor (A or B), the only ones trained and published."""
    return ".lora_A." in name or ".lora_B." in name


def inject(model: torch.nn.Module, lora: Mapping[str, Any]) -> torch.nn.Module:
    """Inject the adapters into `model` in place (no wrapper) and freeze everything else; returns the model. B is
    zero at start (§4.1), so the injected model computes what the base model does until the first update."""
    from peft import inject_adapter_in_model

    model = inject_adapter_in_model(lora_config(lora), model, adapter_name=ADAPTER)
    names = [n for n, _ in model.named_parameters() if is_adapter(n)]
    if not names:
        raise ValueError(f"train.lora.target_modules {list(lora['target_modules'])} matched no module of "
                         f"{type(model).__name__}; name its linear layers (e.g. q_proj, v_proj)")
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    return model


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors of an injected model, by name (detached views)."""
    return {n: t.detach() for n, t in model.state_dict().items() if is_adapter(n)}


def adapter_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of the adapter tensors, bytes of every other tensor) of an injected model, as it holds them."""
    sizes = {n: t.numel() * t.element_size() for n, t in model.state_dict().items()}
    adapter = sum(b for n, b in sizes.items() if is_adapter(n))
    return adapter, sum(sizes.values()) - adapter


def peft_model(model_dir: str, lora: Mapping[str, Any], state: Mapping[str, Any]):
    """A PeftModel of the base model in `model_dir` (fp32) carrying the adapter tensors of `state` (injected names,
    as published or checkpointed; other names are ignored). `.save_pretrained(dir)` writes peft's adapter directory;
    `.merge_and_unload()` gives the merged plain model."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from rlflow.stages.hf_quiet import no_progress_bars
    from rlflow.stages.weight_buckets import as_tensor

    with no_progress_bars():
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, lora_config(lora), adapter_name=ADAPTER)
    adapters = {PEFT_PREFIX + n: as_tensor(t).to(torch.float32) for n, t in state.items() if is_adapter(n)}
    wanted = {n for n in model.state_dict() if is_adapter(n)}
    if set(adapters) != wanted:
        missing, extra = sorted(wanted - set(adapters)), sorted(set(adapters) - wanted)
        raise ValueError(f"the adapter does not fit train.lora on {model_dir}: missing {missing[:3]}, unknown {extra[:3]}")
    model.load_state_dict(adapters, strict=False)
    return model.eval()


def dropout_on(model: torch.nn.Module) -> None:
    """Put the adapters' dropout (train.lora.dropout, on the adapter's input only, §4.1's h = W0 x + B A dropout(x))
    in training mode in a model otherwise kept in eval. The engines sample without it, so with dropout > 0 the
    importance weights pi_old / pi_behaviour also carry its noise; the default, 0, leaves every log-prob exact."""
    for name, module in model.named_modules():
        if name.endswith(f"lora_dropout.{ADAPTER}"):
            module.train()


def adapter_names(shapes: Mapping[str, Any], lora: Mapping[str, Any]) -> list[str]:
    """The adapter tensor names (injected form, as published) the layers of a checkpoint (`shapes`: its weight names)
    get under `lora`: an A and a B for each `<module>.weight` whose module name ends in one of target_modules."""
    targets = tuple(lora["target_modules"])
    out = []
    for name in sorted(shapes):
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.split(".")[-1] in targets:
            out += [f"{module}.lora_A.{ADAPTER}.weight", f"{module}.lora_B.{ADAPTER}.weight"]
    return out


def write_adapter_dir(adapter: Mapping[str, torch.Tensor], lora: Mapping[str, Any], out: str, *, base: str) -> None:
    """Write `adapter` (injected names -> tensors) as peft's adapter directory at `out` (adapter_config.json,
    adapter_model.safetensors under a PeftModel's names), without loading the base model: what vLLM's LoRARequest
    and PeftModel.from_pretrained read."""
    from safetensors.torch import save_file

    config = lora_config(lora)
    config.base_model_name_or_path = base
    config.save_pretrained(out)
    save_file({PEFT_PREFIX + n.replace(f".{ADAPTER}.", "."): t.contiguous() for n, t in adapter.items()},
              f"{out}/adapter_model.safetensors", metadata={"format": "pt"})
