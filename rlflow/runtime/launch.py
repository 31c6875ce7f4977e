"""Start (or join) Ray for a plan, run it, and shut down what was started."""

from __future__ import annotations

import math
import os
from pathlib import Path


def _logical_cpus(plan: dict) -> int:
    # Actors mostly wait on each other; give Ray enough logical CPUs to place every actor and the
    # Ray Data tasks even on a 2-core machine (the real cores are shared, one thread per process).
    return max(os.cpu_count() or 1, math.ceil(plan["resources"]["num_cpus"]) + 3)


def launch(plan: dict, *, resume: bool = False, address: str | None = None, log=print) -> dict:
    """Run the plan to completion (or Ctrl-C); returns the run summary."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    quiet = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    for k, v in quiet.items():
        os.environ.setdefault(k, v)
    import ray

    from rlflow.runtime.driver import Run

    cluster = plan["resources"]["cluster"]
    address = address or cluster["address"]
    started = not ray.is_initialized()
    if started:
        env = {"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **quiet}}
        # user modules the compiler found beside the pipeline or in the working dir, for every worker
        path = os.pathsep.join(plan.get("python_path", []) + [p for p in [os.environ.get("PYTHONPATH")] if p])
        if path:
            env["env_vars"]["PYTHONPATH"] = path
        if address:
            ray.init(address=address, runtime_env=env, log_to_driver=True)
        else:
            ray.init(num_cpus=cluster["num_cpus"] or _logical_cpus(plan), num_gpus=cluster["num_gpus"],
                     include_dashboard=False, runtime_env=env, log_to_driver=True)
    out_dir = Path(".rlflow") / "runs" / plan["name"]
    run = Run(plan, out_dir=out_dir, resume=resume, log=log)
    try:
        run.run()
        summary = run.summary() | {"stopped": run.stop_requested, "checkpoint": str(out_dir / "checkpoint")}
    finally:
        if started:
            ray.shutdown()
    if summary["stopped"]:
        log(f"stopped at step {summary['steps']}; resume with: rlflow run --resume")
    return summary
