"""What the integration tests share: a shipped pipeline compiled small, and a run of it in this process."""

from __future__ import annotations

from pathlib import Path

from rlflow.compiler import compile_pipeline

REPO = Path(__file__).resolve().parents[2]
SMALL = ["stages.train.steps=3", "stages.buffer.batch_groups=2", "stages.rollout.group_size=4",
         "tracking.progress=false"]


def plan_for(name: str, *extra: str) -> dict:
    """pipelines/<name>.yaml with SMALL overrides, then `extra` (later overrides win)."""
    return compile_pipeline(REPO / "pipelines" / f"{name}.yaml", SMALL + list(extra))


def run_plan(plan: dict, **kwargs):
    """Run the plan to the end in .rlflow/runs/<name> of the working directory; returns the Run."""
    from rlflow.runtime.driver import Run

    kwargs.setdefault("log", lambda *a, **k: None)
    run = Run(plan, out_dir=Path(".rlflow") / "runs" / plan["name"], **kwargs)
    run.run()
    return run
