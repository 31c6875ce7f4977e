"""Start (or join) Ray for a plan, run it, and shut down what was started.

Every run has its own directory, `.rlflow/runs/<pipeline name>/<run id>` (run id: the UTC start time and a
short random suffix, e.g. 20261123-041502-7f3a), holding its checkpoint, its state and `run.json` (what
started it). Two runs of one pipeline in one working directory never share one. `--resume` continues a
run in its own directory: by default the newest run of the pipeline that has a checkpoint, or the one named
by run id or path. Inputs that may have changed since compile (the model directory, the DeepSpeed config) are
checked before Ray starts, so a bad one exits 2 at once. A run owns its directory while it runs (run_lock.py): a
second `--resume` of it is refused before Ray starts, exit 2, naming the process that holds it.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import signal
import sys
import threading
import time
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path

from rlflow.errors import PipelineInvalid, Problem
from rlflow.placement import check_cluster, embedded_resources
from rlflow.plan_model import Plan
from rlflow.runtime import hop_trace, reaper, run_fingerprint, run_lock, stop_signal

RUNS_DIR = Path(".rlflow") / "runs"
RUN_FILE = "run.json"  # in each run directory: run id, pipeline, source, start time, overrides
RUN_PLAN_FILE = "plan.json"  # in each run directory: the plan it ran, overrides applied
STATE_FILE = "state.json"  # the checkpoint's state file, unless rlflow/runtime/checkpoint.py names another
LATEST = "latest"  # `--resume` with no run named


IMPORT_TIMEOUT_S = 120.0


def _import_in_background() -> threading.Thread:
    """Import what the driver needs next (transformers for the tokenizer, MLflow for the tracker: about 6 s of a
    run's start-up here, #15) while Ray starts its processes. The caller joins the thread before the driver
    imports them itself."""
    def work():
        try:
            import mlflow  # noqa: F401
            from transformers import AutoTokenizer  # noqa: F401
        except Exception:  # noqa: BLE001, S110 - the real import later reports any problem where it matters
            pass

    t = threading.Thread(target=work, name="rlflow-imports", daemon=True)
    t.start()
    return t


def _logical_cpus(plan: Plan) -> int:
    # Actors mostly wait on each other; give Ray enough logical CPUs to place every actor and the
    # Ray Data tasks even on a 2-core machine (the real cores are shared, one thread per process).
    return max(os.cpu_count() or 1, math.ceil(plan.resources.num_cpus) + 3)


# ---------------------------------------------------------------------------------------------- run directories
def new_run_id(now: float | None = None) -> str:
    """'20261123-041502-7f3a': UTC start time (sorts by time) and 4 random hex digits (two runs in one second)."""
    stamp = datetime.fromtimestamp(time.time() if now is None else now, UTC).strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{secrets.token_hex(2)}"


def new_run_dir(plan: Plan, root: Path = RUNS_DIR) -> Path:
    """A fresh run directory for `plan`, with its run.json written (created atomically: never reused) and the plan
    it runs (plan.json: with the overrides `rlflow run --set` gave this run alone, which run.json lists)."""
    base = Path(root) / plan.name
    base.mkdir(parents=True, exist_ok=True)
    while True:
        run_id = new_run_id()
        try:
            (base / run_id).mkdir()
            break
        except FileExistsError:
            continue
    info = {"run_id": run_id, "pipeline": plan.name, "source": plan.source, "started": time.time(),
            "started_utc": datetime.now(UTC).isoformat(timespec="seconds"), "overrides": list(plan.overrides)}
    (base / run_id / RUN_FILE).write_text(json.dumps(info, indent=2))
    (base / run_id / RUN_PLAN_FILE).write_text(json.dumps(plan.raw, indent=2) + "\n")
    run_fingerprint.record(plan, base / run_id)  # what a --resume of it is compared with (run_fingerprint.py)
    return base / run_id


def resumable(run_dir: Path) -> bool:
    """The run directory holds a checkpoint to resume from (checkpoint.resumable when it has one, else its
    state file)."""
    from rlflow.runtime import checkpoint

    if callable(getattr(checkpoint, "resumable", None)):
        return bool(checkpoint.resumable(Path(run_dir)))
    return (Path(run_dir) / getattr(checkpoint, "STATE_FILE", STATE_FILE)).is_file()


def _started(run_dir: Path) -> float:
    try:
        return float(json.loads((run_dir / RUN_FILE).read_text())["started"])
    except (OSError, ValueError, KeyError, TypeError):
        return run_dir.stat().st_mtime


def list_runs(name: str, root: Path = RUNS_DIR) -> list[Path]:
    """The run directories of pipeline `name`, oldest first. A checkpoint written by an rlflow from before run
    directories (state.json directly in .rlflow/runs/<name>/) counts as one run, the directory itself."""
    base = Path(root) / name
    if not base.is_dir():
        return []
    runs = [d for d in base.iterdir() if d.is_dir() and ((d / RUN_FILE).is_file() or resumable(d))]
    if resumable(base):
        runs.append(base)
    return sorted(runs, key=lambda d: (_started(d), d.name))


def find_run(plan: Plan, which: str, root: Path = RUNS_DIR, log=print) -> Path:
    """The run directory `--resume [which]` means: LATEST (the newest run of this pipeline with a checkpoint),
    a run id of this pipeline, or a path to a run directory. PipelineInvalid (exit 2) with the way out when
    there is none."""
    name, source = plan.name, plan.source
    runs = list_runs(name, root)
    where = Path(root) / name

    def fail(message: str, rule: str, fix: str):
        raise PipelineInvalid(source, [Problem(("--resume",), message, rule, fix)])

    def listed() -> str:
        shown = [f"{r.name}{'' if resumable(r) else ' (no checkpoint)'}" for r in runs[-5:]]
        return f"runs in {where}: {', '.join(shown)}" if runs else f"no runs in {where}"

    if which == LATEST:
        ok = [r for r in runs if resumable(r)]
        if not ok:
            if runs:
                fail(f"no run of pipeline '{name}' has a checkpoint to resume ({listed()})", "no-checkpoint",
                     "run without --resume to start afresh (a checkpoint is saved on Ctrl-C, at the end, "
                     "and every stages.<train>.checkpoint_every steps)")
            fail(f"no run of pipeline '{name}' to resume (nothing in {where})", "no-run",
                 "run without --resume first (Ctrl-C saves a checkpoint)")
        newer = [r.name for r in runs if _started(r) > _started(ok[-1])]
        if newer:
            log(f"resuming run {ok[-1].name}: the newer run(s) {', '.join(newer)} have no checkpoint")
        return ok[-1]
    candidates = [where / which, Path(which)]
    run_dir = next((c for c in candidates if c.is_dir()), None)
    if run_dir is None:
        fail(f"no run '{which}' of pipeline '{name}' ({listed()})", "no-run",
             "name one of those run ids (or a run directory), or use --resume alone for the newest")
    if not resumable(run_dir):
        fail(f"run '{which}' ({run_dir}) has no checkpoint to resume", "no-checkpoint",
             "resume another run (--resume alone takes the newest with a checkpoint), or run without --resume")
    return run_dir


def locate_run(which: str, root: Path = RUNS_DIR, *, command: str = "rlflow export") -> Path:
    """A run directory named without a plan (`rlflow export RUN`, `rlflow eval RUN`): a path to a run directory, a
    run id under `root`, or a pipeline name (its newest run with a checkpoint). PipelineInvalid (exit 2) else."""
    def fail(message: str, fix: str):
        raise PipelineInvalid(command, [Problem(("RUN",), message, "no-run", fix)])

    if Path(which).is_dir() and ((Path(which) / RUN_FILE).is_file() or resumable(Path(which))):
        return Path(which)
    base = Path(root)
    if (base / which).is_dir():  # a pipeline name
        runs = list_runs(which, root)
        ok = [r for r in runs if resumable(r)]
        if ok:
            return ok[-1]
        if runs:
            return runs[-1]
    by_id = sorted(d / which for d in base.iterdir() if (d / which).is_dir()) if base.is_dir() else []
    if by_id:
        return by_id[-1]
    names = sorted(d.name for d in base.iterdir() if d.is_dir()) if base.is_dir() else []
    fail(f"no run '{which}': not a run directory, nor a run id or pipeline name under {base}"
         + (f" (pipelines: {', '.join(names)})" if names else ""),
         "name a run directory (.rlflow/runs/<pipeline>/<run id>), a run id, or a pipeline name")


# ---------------------------------------------------------------------------------------------- user code
def user_modules(python_path: list[str]) -> list[str]:
    """What `PYTHONPATH=<python_path>` makes importable, as Ray `py_modules` entries for a cluster: each directory's
    top-level modules (.py files and packages), except names importable without it (installed packages)."""
    from rlflow.user_code import _found_without

    dirs = [Path(d).resolve() for d in python_path]
    out = []
    for d in dirs:
        for entry in sorted(d.iterdir()) if d.is_dir() else []:
            if entry.name.startswith((".", "__")) or not entry.name.isascii():
                continue
            if entry.is_file() and entry.suffix == ".py":
                name = entry.stem
            elif entry.is_dir() and (entry / "__init__.py").is_file():
                name = entry.name
            else:
                continue
            if name.isidentifier() and not _found_without(name, dirs):
                out.append(str(entry))
    return out


# ---------------------------------------------------------------------------------------------- before Ray starts
def preflight(plan: Plan) -> None:
    """Inputs the plan names that may have changed since compile, checked before Ray starts: the model
    directory, the DeepSpeed config and the user code (user_code_check.py) (PipelineInvalid, exit 2). The driver
    checks the first two again itself."""
    from rlflow.runtime import user_code_check

    problems: list[Problem] = user_code_check.check(plan)
    if not plan.model["path"].startswith("builtin:"):
        from rlflow.runtime.model import check_model_dir

        try:
            check_model_dir(plan.model["path"], source=plan.source)
        except PipelineInvalid as e:
            problems += e.problems
    from rlflow.runtime.train_sink import check_deepspeed_config

    try:
        check_deepspeed_config(plan)
    except PipelineInvalid as e:
        problems += e.problems
    if problems:
        raise PipelineInvalid(plan.source, problems)


def check_local_gpus(plan: Plan) -> None:
    """Before an embedded cluster starts with the plan's GPUs: a plan compiled for GPUs this machine lacks (`rlflow
    compile --gpus N` elsewhere) would hand actors GPU ids that are not there. PipelineInvalid (exit 2) then."""
    from rlflow.devices import local_gpus

    declared = plan.resources.cluster["num_gpus"]
    want = max(declared if isinstance(declared, (int, float)) else 0, plan.resources.num_gpus)
    have = local_gpus()
    if want > have.gpus:
        compiled = (plan.devices or {}).get("counted_by", "resources.num_gpus")
        raise PipelineInvalid(plan.source, [Problem(
            ("resources", "num_gpus"), f"the plan was compiled for {want:g} GPU(s) ({compiled}), but this machine has "
            f"{have.gpus} ({have.counted_by})", "no-gpus" if have.gpus == 0 else "more-gpus-than-cluster",
            f"compile it here (rlflow compile {plan.source}, without --gpus), run it where it was compiled for, or "
            "join a cluster that has them with --address")])


def launch(plan: Plan | dict, *, resume: bool | str = False, address: str | None = None, log=print,
           root: Path = RUNS_DIR) -> dict:
    """Run the plan to completion (or Ctrl-C); returns the run summary. `resume`: False (a new run), True or
    LATEST (the newest run of this pipeline with a checkpoint), or a run id / run directory. The run directory is
    this process's own (run_lock.py) until the run ends, however it ends. `plan`: read_plan's, or a compiled
    dict (compile_pipeline's), typed here once."""
    from rlflow.runtime.run_clock import RunClock

    plan = Plan.of(plan)

    clock = RunClock()  # the start-up timeline counts from here (run_clock.py)
    stop_signal.grace_s()  # a bad RLFLOW_STOP_GRACE_S exits 2 now, not when SIGTERM comes
    run_dir = find_run(plan, LATEST if resume is True else resume, root, log=log) if resume else None
    with ExitStack() as owned:
        if run_dir is not None:  # before anything starts: a run in use is refused at no cost
            owned.enter_context(run_lock.acquire(run_dir, source=plan.source, log=log))
            run_fingerprint.check(plan, run_dir, log=log)  # a changed batch, model, data... is refused here, exit 2
        return _launch(plan, clock, run_dir, owned, resume=resume, address=address, log=log, root=root)


def _launch(plan: Plan, clock, run_dir: Path | None, owned: ExitStack, *, resume, address, log, root) -> dict:
    preflight(plan)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not sys.stdout.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # no ANSI codes around worker log prefixes in a log file
        sys.stdout.reconfigure(line_buffering=True)  # one progress line at a time in a log, not a block later
    quiet = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    for k, v in quiet.items():
        os.environ.setdefault(k, v)
    import ray

    from rlflow.runtime import run_summary
    from rlflow.runtime.driver import Run
    from rlflow.runtime.run_log import RunLog

    run_log = RunLog()  # known-harmless lines of Ray and MLflow: to <run dir>/run.log, not the terminal (run_log.py)
    owned.callback(run_log.close)
    run_log.divert_logging("ray")

    # after `import ray` and the driver, joined after ray.init (which mostly waits on its processes): transformers
    # is a lazy module, and a second thread using it half-imported fails with "cannot import name"
    importing = _import_in_background()

    cluster = plan.resources.cluster
    address = address or cluster["address"]
    started = not ray.is_initialized()
    if started and not address:
        check_local_gpus(plan)  # the embedded cluster gets the plan's resolved GPU count (resources.num_gpus)
    if started:
        env = {"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **quiet}}
        if hop_trace.enabled():  # benchmarks/bench_step_latency.py: every worker writes its hops too
            env["env_vars"][hop_trace.ENV] = os.environ[hop_trace.ENV]
        # user modules the compiler found beside the pipeline or in the working dir, for every worker: on a
        # cluster uploaded through the runtime env (other nodes lack these paths), on this machine by path
        dirs = plan.python_path if not address else []
        path = os.pathsep.join(dirs + [p for p in [os.environ.get("PYTHONPATH")] if p])
        if path:
            env["env_vars"]["PYTHONPATH"] = path
        if address:
            modules = user_modules(plan.python_path)
            if modules:
                env["py_modules"] = modules
                log(f"user code shipped to the cluster: {', '.join(Path(m).name for m in modules)}")
            ray.init(address=address, runtime_env=env, log_to_driver=True)
        else:
            ray.init(num_cpus=cluster["num_cpus"] or _logical_cpus(plan), num_gpus=cluster["num_gpus"],
                     resources=embedded_resources(plan) or None, include_dashboard=False, runtime_env=env,
                     log_to_driver=True)
            # Ray's agents outlive a killed driver by a minute or more; the reaper ends them (reaper.py)
            owned.callback(reaper.stop, reaper.start(ray.get_runtime_context().get_node_id()))
    run_log.divert_worker_output()
    importing.join(IMPORT_TIMEOUT_S)
    run_log.divert_logging("mlflow")  # its handler exists once it is imported
    if importing.is_alive():
        log(f"transformers and MLflow still importing after {IMPORT_TIMEOUT_S:g} s (a slow disk?); going on")
    clock.mark("ray")
    try:  # a cluster that cannot place the plan's stages fails here, before a run directory exists
        check_cluster(plan, ray.nodes(), f"the Ray cluster at {address}" if address else "the embedded Ray cluster")
        out_dir = run_dir or new_run_dir(plan, root)
        if run_dir is None:  # a fresh directory has no checkpoint: no --resume can have taken it since its mkdir
            owned.enter_context(run_lock.acquire(out_dir, source=plan.source, log=log))
        run_log.attach(out_dir)
        log(f"{'resuming' if resume else 'run'} directory: {out_dir}")
        run = Run(plan, out_dir=out_dir, resume=bool(resume), log=log, clock=clock)
    except BaseException:
        if started:
            ray.shutdown()
        raise
    # Run.run holds its own handler (stop at the step's end); before and after it, until this process is done,
    # a stop signal quits at once saying what is left (Ray's handler, put back otherwise, exits 15 saying nothing)
    owned.enter_context(stop_signal.quit_on_signal(lambda: "the run's summary and Ray's shutdown" if getattr(run, "history", None)
                                                   else "the run's start (nothing trained yet)"))
    try:
        run.run()
        summary = run.summary() | {"stopped": run.stop_requested, "run_dir": str(out_dir),
                                   "stopped_by": signal.Signals(run.stop_signal).name if run.stop_signal else None,
                                   "checkpoint": str(out_dir / "checkpoint"),
                                   "mlflow_uri": getattr(getattr(run, "tracker", None), "uri", None)}
    finally:
        if started:
            ray.shutdown()
    measured = summary.get("workload_measured")
    if measured:
        from rlflow.runtime.workload_measured import as_overrides

        log(f"measured on the last {measured['groups']} trained groups: mean length {measured['mean_length']:g}, "
            f"tailness {measured['tailness']:g}, prompt_share {measured['prompt_share']:g}; to simulate or tune with "
            f"them: {as_overrides(measured)}")
    run_summary.write(summary, out_dir)
    for line in run_summary.describe(summary, plan.trainer.steps):
        log(line)
    return summary
