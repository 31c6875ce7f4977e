"""The policy model directory a run starts from: a built-in model built locally, or a local HF directory."""

from __future__ import annotations

from pathlib import Path

from rlflow import registry


def prepare_model(plan: dict, log=print) -> Path:
    """Local Hugging Face directory for plan's model (builds and caches builtin:tiny-llama on first use,
    warm-started on the plan's built-in tasks; on `arith` when the data are files)."""
    spec = plan["pipeline"]["model"]
    if spec["path"].startswith("builtin:"):
        sources = sorted({t["source"].removeprefix("builtin:") for t in plan["tasks"].values()
                          if t["source"].startswith("builtin:")})
        build = registry.resolve("model", spec["path"])
        return Path(build(task="+".join(sources) or "arith", seed=plan["pipeline"]["seed"], progress=log))
    return Path(spec["path"])
