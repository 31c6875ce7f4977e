"""`rlflow run` (a plan, or a pipeline compiled first) and `rlflow scale` (resize a running run's elastic stage)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from rlflow.cli_options import EXIT_OK, EXIT_UNAVAILABLE, Bare, PlanFile, Sets, overrides_of
from rlflow.errors import PipelineInvalid

if TYPE_CHECKING:
    from rlflow.plan_model import Plan

PIPELINE_SUFFIXES = (".yaml", ".yml")


def run(plan: PlanFile = None, bare: Bare = None,
        resume: Annotated[str | None, typer.Option(
            "--resume", metavar="[RUN]", show_default=False,
            help="continue a run from its checkpoint: the newest run of the plan's pipeline, or RUN (a run id under "
                 ".rlflow/runs/<name>/, or a run directory). What the run started with is compared first: a changed "
                 "batch, group size, algorithm, model, tokenizer, data file or reward is refused (exit 2, with the way "
                 "to a new run from the checkpoint's weights: rlflow export, then model.path); appended data rows and "
                 "other settings are applied and said")] = None,
        address: Annotated[str | None, typer.Option(help="join this Ray cluster instead of starting an embedded one",
                                                    show_default=False)] = None,
        sets: Sets = None) -> int:
    """execute a compiled plan on Ray (a pipeline YAML is compiled first, as `rlflow compile` would)"""
    overrides = overrides_of(bare, sets)
    if plan is not None and "=" in plan and not Path(plan).exists():  # `rlflow run k=v`: an override, not a plan
        plan, overrides = None, [plan, *overrides]
    if resume not in (None, "latest") and plan is None and Path(resume).is_file():
        plan, resume = resume, "latest"  # `rlflow run --resume plan.json`: the plan, not a run
    if resume:  # the run's own overrides first, then these
        the_plan, resume = _resumed_with_its_overrides(_plan_for_run(plan, []), resume, overrides)
    else:
        the_plan = _plan_for_run(plan, overrides)
    from rlflow.runtime.launch import launch

    summary = launch(the_plan, resume=resume or False, address=address)
    if not summary.get("stopped"):
        return EXIT_OK
    import signal

    from rlflow.runtime.stop_signal import exit_code

    # stopped by a signal, checkpoint saved: 128 + its number, as a shell reports a process it ended (130, 143)
    return exit_code(signal.Signals[summary.get("stopped_by") or "SIGINT"])


def _plan_for_run(plan: str | None, overrides: list[str]) -> Plan:
    """The plan this run executes. A pipeline file is compiled to where `rlflow compile` writes its plan; overrides
    given to `run` apply to this run only (its run directory records them: run.json and plan.json), never to the
    shared plan file, so they do not pile up across runs."""
    from rlflow.compiler import DEFAULT_PLAN, compile_pipeline, gpus_given, read_plan, write_plan
    from rlflow.plan_model import Plan

    if plan is not None and Path(plan).suffix in PIPELINE_SUFFIXES:
        path, _ = write_plan(compile_pipeline(plan, []), DEFAULT_PLAN)
        print(f"compiled {plan} to {path} (as `rlflow compile {plan}` would); running it")
        plan = str(path)
    plan_path = plan or DEFAULT_PLAN
    typed = read_plan(plan_path)
    if not overrides:
        return typed
    compiled = compile_pipeline(typed.source, typed.overrides + overrides, gpus_given(typed))
    print(f"overrides for this run only: {' '.join(overrides)} (recorded in its run directory; {plan_path} is unchanged)")
    return Plan.of(compiled)


def _resumed_with_its_overrides(plan: Plan, resume: str, overrides: list[str]) -> tuple[Plan, str]:
    """The plan to resume a run with: `plan`, then the overrides that run was started with (its run.json) which
    `plan` lacks (they applied to that run; the shared plan never had them), then `overrides`; and the run's
    directory."""
    import json

    from rlflow.compiler import compile_pipeline, gpus_given
    from rlflow.plan_model import Plan
    from rlflow.runtime.launch import RUN_FILE, find_run

    run_dir = find_run(plan, resume)
    try:
        recorded = json.loads((run_dir / RUN_FILE).read_text()).get("overrides") or []
    except (OSError, ValueError, AttributeError):  # a run of an older rlflow: nothing recorded
        recorded = []
    missing = [o for o in recorded if o not in plan.overrides]
    if missing:
        print(f"resuming with the run's own overrides: {' '.join(missing)} (from {run_dir / RUN_FILE})")
    if overrides:
        print(f"overrides for this run only: {' '.join(overrides)} (the shared plan is unchanged)")
    if missing or overrides:
        plan = Plan.of(compile_pipeline(plan.source, plan.overrides + missing + overrides, gpus_given(plan)))
    return plan, str(run_dir)


def scale(stage: Annotated[str, typer.Argument(help="the rollout stage's name", show_default=False)],
          instances: Annotated[int, typer.Argument(help="instances it should have, within its elastic "
                                                        "min/max_replicas", show_default=False)],
          plan: Annotated[str | None, typer.Option("--plan", help="the run's plan (default .rlflow/plan.json)",
                                                   show_default=False)] = None,
          run: Annotated[str | None, typer.Option("--run", metavar="RUN", show_default=False,
                                                  help="a run directory or run id (default: the newest run of the "
                                                       "plan's pipeline)")] = None,
          wait: Annotated[float, typer.Option("--wait", metavar="SECONDS",
                                              help="wait up to SECONDS until that many serve (default: return once "
                                                   "asked)")] = 0.0) -> int:
    """resize an elastic rollout stage of a running run (stages.<rollout>.elastic)"""
    import time

    from rlflow.compiler import DEFAULT_PLAN, read_plan
    from rlflow.errors import Problem
    from rlflow.runtime.launch import list_runs, locate_run
    from rlflow.runtime.scaling import read_status, request_scale

    typed = read_plan(plan or DEFAULT_PLAN)
    first = next(iter(typed.rollouts(stage)), None)

    def fail(loc: str, message: str, rule: str, fix: str):
        raise PipelineInvalid("rlflow scale", [Problem((loc,), message, rule, fix)])

    if first is None:
        stages = sorted({a.stage for a in typed.rollouts()})
        fail("STAGE", f"the plan has no rollout stage '{stage}'", "unknown-stage", f"use one of {', '.join(stages)}")
    e = first.elastic
    if e is None:
        fail("STAGE", f"rollout stage '{stage}' is not elastic: it always has its replicas instances", "not-elastic",
             f"declare stages.{stage}.elastic (min_replicas, max_replicas), compile, and run again")
    if not e["min_replicas"] <= instances <= e["max_replicas"]:
        fail("INSTANCES", f"{instances} is outside stages.{stage}.elastic [{e['min_replicas']}, "
             f"{e['max_replicas']}]", "elastic-bounds", "ask for a count within the range, or widen it and run again")
    if run is not None:
        run_dir = locate_run(run, command="rlflow scale")
    else:
        runs = list_runs(typed.name)
        if not runs:
            fail("--run", f"no run of pipeline '{typed.name}' in .rlflow/runs/{typed.name}", "no-run",
                 "start one with `rlflow run`, or name its directory with --run")
        run_dir = runs[-1]
    path = request_scale(Path(run_dir), stage, instances)
    print(f"asked run {run_dir} for {instances} instance(s) of '{stage}' ({path}); the run applies it "
          "within a second and logs it")
    if wait <= 0:
        return EXIT_OK
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        status = read_status(Path(run_dir), stage)
        if status and status["serving"] == instances and not status["starting"] and not status["retiring"]:
            print(f"'{stage}' has {instances} serving instance(s)")
            return EXIT_OK
        time.sleep(0.5)
    print(f"rlflow scale: waited {wait:g} s for {instances} serving instance(s) of '{stage}'; "
          f"now {read_status(Path(run_dir), stage)} (is the run still going? an added instance may be waiting "
          "for Ray to place it)", file=sys.stderr)
    return EXIT_UNAVAILABLE
