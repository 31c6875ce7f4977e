"""Export: the policy as a Hugging Face directory that transformers and vLLM load.

A run exports the weights the parameter server last published (no trainer call) into
`<run dir>/export/` when it ends (and on Ctrl-C), and into `<run dir>/export/step-<N>/` every
`stages.<train>.save_every` steps; `rlflow export RUN` rebuilds the full fp32 state from the run's DeepSpeed
checkpoint instead, without Ray. Either way the directory holds config.json, model.safetensors (in the published
dtype; fp32 from a checkpoint), the tokenizer and generation files of the model directory the run started from,
plan.json and rlflow_export.json (version, step, where the weights came from).

A train.lora run publishes and checkpoints its adapters (stages/lora.py): its export is peft's adapter directory
(adapter_config.json, adapter_model.safetensors: `PeftModel.from_pretrained(base, dir)` loads it) beside the same
tokenizer, plan and info files, and, on request (`rlflow export --merged`), the merged model W0 + (alpha / r) B A as
a plain Hugging Face directory in `merged/`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from rlflow.plan_model import Plan

WEIGHTS = "model.safetensors"
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft's file name (train.lora exports)
INFO = "rlflow_export.json"
#: files of the source model directory not copied: its weights (replaced) and its config (rewritten)
SKIP_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack")
SKIP_NAMES = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json"}


def _as_tensor(t):
    """A contiguous CPU torch tensor of a numpy array or tensor (bf16 has no numpy dtype: the file is written from torch)."""
    from rlflow.stages.weight_buckets import as_tensor

    return as_tensor(t).detach().to("cpu").contiguous()


def _tied(model_dir: Path) -> bool:
    """Whether the model ties lm_head to the input embeddings (transformers then saves only the embeddings)."""
    from transformers import AutoConfig

    return bool(getattr(AutoConfig.from_pretrained(str(model_dir)), "tie_word_embeddings", False))


def write(state: dict, model_dir: str | Path, out: str | Path, *, info: dict | None = None,
          plan: dict | None = None) -> Path:
    """Write `state` (name -> numpy array or tensor, Hugging Face parameter names) as a Hugging Face directory at
    `out`, with the config and tokenizer of `model_dir` (and `plan`, plan.json as written: Plan.raw). Files are written beside and moved in one by one, so a
    reader never sees a half-written file; subdirectories of `out` (step-<N>/ exports) are kept."""
    from safetensors.torch import save_file

    model_dir, out = Path(model_dir), Path(out)
    arrays = {name: _as_tensor(t) for name, t in state.items()}
    if "lm_head.weight" in arrays and _tied(model_dir):
        arrays.pop("lm_head.weight")  # tied: loaders take it from the embeddings (as save_pretrained writes it)
    dtypes = {str(a.dtype).removeprefix("torch.") for a in arrays.values()}
    out.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_file(arrays, str(tmp / WEIGHTS), metadata={"format": "pt"})
        config = json.loads((model_dir / "config.json").read_text())
        if len(dtypes) == 1:  # the dtype the file holds, so dtype="auto" loads it as written
            (dtype,) = dtypes
            config["dtype"] = dtype
            if "torch_dtype" in config:
                config["torch_dtype"] = dtype
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for f in sorted(model_dir.iterdir()):
            if f.is_file() and f.name not in SKIP_NAMES and not f.name.endswith(SKIP_SUFFIXES) and f.name != INFO:
                shutil.copy2(f, tmp / f.name)
        if plan is not None:
            (tmp / "plan.json").write_text(json.dumps(plan, indent=2))
        (tmp / INFO).write_text(json.dumps({"source_model": str(model_dir), **(info or {})}, indent=2))
        for f in sorted(tmp.iterdir(), key=lambda f: f.name == WEIGHTS):  # the weights last
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def write_lora(state: dict, model_dir: str | Path, out: str | Path, lora: dict, *, merged: bool = False,
               info: dict | None = None, plan: dict | None = None) -> Path:
    """Write the LoRA adapter of `state` (its adapter tensors: published, or a whole checkpoint's) at `out` as peft's
    adapter directory, with the tokenizer and generation files of `model_dir`, `plan` and the info file; merged: also
    the merged model in `out/merged/` (`write`). Files move in one by one, the adapter weights last."""
    from rlflow.stages.lora import peft_model

    model_dir, out = Path(model_dir), Path(out)
    model = peft_model(str(model_dir), lora, state)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(str(tmp))  # adapter_config.json and adapter_model.safetensors
        for f in sorted(model_dir.iterdir()):
            if f.is_file() and f.name not in SKIP_NAMES and not f.name.endswith(SKIP_SUFFIXES) and f.name != INFO:
                shutil.copy2(f, tmp / f.name)
        if plan is not None:
            (tmp / "plan.json").write_text(json.dumps(plan, indent=2))
        (tmp / INFO).write_text(json.dumps({"source_model": str(model_dir), "lora": dict(lora), **(info or {})}, indent=2))
        for f in sorted(tmp.iterdir(), key=lambda f: f.name == ADAPTER_WEIGHTS):
            if f.is_file():
                os.replace(f, out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if merged:
        write(model.merge_and_unload().state_dict(), model_dir, out / "merged", info={**(info or {}), "merged_lora": True},
              plan=plan)
    return out


def load_state(path: str | Path) -> dict[str, np.ndarray]:
    """An export's weights as name -> numpy array (tests and checks; transformers loads the directory itself)."""
    from safetensors.numpy import load_file

    return load_file(str(Path(path) / WEIGHTS))


# ---------------------------------------------------------------------------------------------- from a checkpoint
def checkpoint_tag(ckpt: Path) -> str | None:
    latest = ckpt / "latest"
    return latest.read_text().strip() if latest.is_file() else None


def from_checkpoint(ckpt: str | Path, tag: str | None = None) -> tuple[dict, dict]:
    """The full fp32 weights of checkpoint `tag` in `ckpt` (None: the one DeepSpeed's `latest` names), written by the
    run's trainer (stages/trainer.py save_checkpoint), and what it says of itself ({version, step, zero_stage, tag});
    no Ray, no process group.

    ZeRO 1-3 keep the fp32 master weights partitioned in the optimizer states: DeepSpeed's zero_to_fp32 joins them
    (and restores tied parameters). ZeRO 0 saves the module itself in mp_rank_00_model_states.pt."""
    import torch

    ckpt = Path(ckpt)
    tag = tag or checkpoint_tag(ckpt)
    if tag is None:
        raise FileNotFoundError(f"no DeepSpeed checkpoint in {ckpt} (no 'latest' file)")
    states = torch.load(ckpt / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    ours = states.get("rlflow", {})  # stages/trainer.py _CLIENT_KEY: {"version", "client": {"step"}}
    zero = int(((states.get("ds_config") or {}).get("zero_optimization") or {}).get("stage", 0))
    info = {"version": ours.get("version"), "step": (ours.get("client") or {}).get("step"), "zero_stage": zero, "tag": tag}
    if zero >= 1:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        from rlflow.runtime.run_log import printed_here

        with printed_here():  # its "Processing zero checkpoint ..." prints: to the run's run.log, not the terminal
            state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag=tag)
    else:
        state = states["module"]
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}, info


# ---------------------------------------------------------------------------------------------- during a run
class RunExports:
    """A run's exports of its published weights: `<run dir>/export/` at the end, `export/step-<N>/` every
    `save_every` steps. Step exports are written by a background thread (training goes on); `final` waits for
    them, then writes its own."""

    def __init__(self, run_dir: Path, model_dir: str, plan: Plan, save_every: int):
        from concurrent.futures import ThreadPoolExecutor

        self.root, self.model_dir, self.plan, self.save_every = Path(run_dir) / "export", model_dir, plan, save_every
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="export")
        self.jobs: list = []

    def _write(self, published, step: int, out: Path) -> Path:
        from rlflow.runtime.parameter_server import fetch_state

        state = fetch_state(published)  # the one whole copy of the weights, written out
        info = {"pipeline": self.plan.name, "step": step, "version": published.version,
                "checksum": published.checksum, "from": "published weights", "run_dir": str(self.root.parent)}
        lora = self.plan.trainer.trainer_kwargs.get("lora")
        if lora is not None:  # the published version is the adapter alone
            return write_lora(state, self.model_dir, out, lora, info=info, plan=self.plan.raw)
        return write(state, self.model_dir, out, info=info, plan=self.plan.raw)

    def step(self, step: int, published) -> bool:
        """Export `step`'s weights into export/step-<N>/ in the background when save_every says so."""
        if not self.save_every or step % self.save_every or published is None:
            return False
        self.jobs.append(self.pool.submit(self._write, published, step, self.root / f"step-{step}"))
        return True

    def final(self, step: int, published) -> Path:
        """Export into export/ (after the step exports in flight); returns the directory."""
        self.wait()
        return self._write(published, step, self.root)

    def wait(self) -> None:
        """Until the step exports in flight are written (one that failed raises here)."""
        jobs, self.jobs = self.jobs, []
        for job in jobs:
            job.result()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
