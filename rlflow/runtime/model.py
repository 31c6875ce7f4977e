"""The policy model directory a run starts from: a built-in model built locally, or a local HF directory."""

from __future__ import annotations

from pathlib import Path

from rlflow import registry


def prepare_model(plan: dict, log=print) -> Path:
    """Local Hugging Face directory for plan's model (builds and caches builtin:tiny-llama on first use)."""
    spec = plan["pipeline"]["model"]
    if spec["path"].startswith("builtin:"):
        source = plan["pipeline"]["data"]["source"]
        task = source.removeprefix("builtin:") if source.startswith("builtin:") else "arith"
        build = registry.resolve("model", spec["path"])
        return Path(build(task=task, seed=plan["pipeline"]["seed"], progress=log))
    return Path(spec["path"])
