"""The Python API: compile, run, simulate and tune a pipeline from a script or a notebook.

    import rlflow

    plan = rlflow.compile("pipelines/quickstart.yaml", overrides={"stages.train.steps": 10})
    result = rlflow.run(plan)                     # RunResult: summary, run_dir, mlflow_run_id, export_dir
    sim = rlflow.simulate(plan, steps=200)        # SimulationResult of the discrete-event simulator
    advice = rlflow.tune("pipelines/staleflow.yaml", gpus=64)

The CLI (`rlflow compile / run / simulate / tune`) is a layer over these functions that prints what they return.
Errors are the ones the CLI reports: a pipeline that cannot run as declared raises rlflow.errors.PipelineInvalid,
whose `problems` each carry a location, a message, a named rule and the way out (`str()` prints them as the CLI does).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlflow.plan_model import Plan

PIPELINES_DIR = Path(".rlflow") / "pipelines"  # where a pipeline given as a dict is written before it is compiled


@dataclass
class RunResult:
    """What `run` returns: the run's summary (as in <run_dir>/summary.json) and where its outputs are."""

    summary: dict[str, Any]
    run_dir: Path | None
    mlflow_run_id: str | None
    steps: int
    stopped: bool  # stopped by a signal (Ctrl-C, SIGTERM) with a checkpoint, rather than finished
    export_dir: Path | None = None  # the policy as a Hugging Face directory, when the run wrote one

    @classmethod
    def of(cls, summary: dict) -> RunResult:
        run_dir = Path(summary["run_dir"]).absolute() if summary.get("run_dir") else None  # relative to the cwd
        export = run_dir / "export" if run_dir is not None and (run_dir / "export").is_dir() else None
        return cls(summary=summary, run_dir=run_dir, mlflow_run_id=summary.get("mlflow_run_id"),
                   steps=int(summary.get("steps", 0)), stopped=bool(summary.get("stopped")), export_dir=export)


@dataclass
class TuneResult:
    """What `tune` returns: every candidate split, the recommended one, and the overrides that apply it."""

    plan: Plan  # the pipeline as compiled (with the given overrides)
    candidates: list
    best: Any
    overrides: list[str]  # the given ones, then those that apply the recommendation
    notes: list[str] = field(default_factory=list)


def overrides_list(overrides: Sequence[str] | Mapping[str, Any] | None) -> list[str]:
    """`--set` overrides as `key=value` strings: a mapping's values are written as YAML flow values (JSON is YAML),
    so {"stages.train.steps": 10, "stages.train.algo": "rloo"} gives ["stages.train.steps=10", "stages.train.algo=rloo"]."""
    if not overrides:
        return []
    if isinstance(overrides, str):
        raise TypeError(f"overrides: a list of 'key=value' strings or a mapping, not the string {overrides!r}")
    if isinstance(overrides, Mapping):
        return [f"{key}={value if isinstance(value, str) else json.dumps(value)}" for key, value in overrides.items()]
    return [str(o) for o in overrides]


def pipeline_file(pipeline: str | os.PathLike | Mapping) -> Path:
    """A pipeline's path; a pipeline given as a dict is written as YAML under .rlflow/pipelines/<name>.yaml first, so
    the plan records a source to resume from and relative paths in it resolve against the working directory."""
    if not isinstance(pipeline, Mapping):
        return Path(pipeline)
    import yaml

    name = str(pipeline.get("name") or "pipeline")
    path = PIPELINES_DIR / f"{''.join(c if c.isalnum() or c in '-_' else '-' for c in name)}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# written by rlflow.compile from a dict\n{yaml.safe_dump(dict(pipeline), sort_keys=False)}")
    return path


def compile(pipeline: str | os.PathLike | Mapping, overrides: Sequence[str] | Mapping[str, Any] | None = None, *,
            gpus: int | None = None) -> Plan:
    """Validate a pipeline (a YAML path, or the same structure as a dict) and lower it to its plan, as
    `rlflow compile` does; nothing is written except a dict's YAML (pipeline_file). `gpus`: compile for a cluster
    of that many GPUs (default: the GPUs counted here). Raises PipelineInvalid."""
    from rlflow.compiler import compile_pipeline
    from rlflow.plan_model import Plan

    return Plan.of(compile_pipeline(pipeline_file(pipeline), overrides_list(overrides), gpus))


def as_plan(plan: Plan | str | os.PathLike | Mapping, overrides: Sequence[str] | Mapping[str, Any] | None = None) -> Plan:
    """A Plan from a Plan (recompiled with `overrides` if any), a plan.json path, a pipeline path or a pipeline
    dict."""
    from rlflow.compiler import compile_pipeline, gpus_given, read_plan
    from rlflow.plan_model import Plan

    extra = overrides_list(overrides)
    if isinstance(plan, Plan):
        typed = plan
    elif isinstance(plan, Mapping) and "pipeline" in plan and "plan_version" in plan:  # a compiled plan's dict
        typed = Plan.of(dict(plan))
    elif isinstance(plan, Mapping) or Path(plan).suffix in (".yaml", ".yml"):
        return compile(plan, extra)
    else:
        typed = read_plan(plan)
    if not extra:
        return typed
    return Plan.of(compile_pipeline(typed.source, typed.overrides + extra, gpus_given(typed)))


def run(plan: Plan | str | os.PathLike | Mapping, *, overrides: Sequence[str] | Mapping[str, Any] | None = None,
        resume: bool | str = False, address: str | None = None, log=print) -> RunResult:
    """Run a plan to its last step (or until Ctrl-C / SIGTERM, which stop it with a checkpoint), as `rlflow run`
    does: `plan` is a Plan, a plan.json, a pipeline YAML or a pipeline dict (compiled first). `resume`: True for the
    newest run of this pipeline with a checkpoint, or a run id / run directory. `address`: join that Ray cluster
    instead of starting one here. `log`: where progress lines go (print by default). Raises PipelineInvalid,
    RunFailed (rlflow.errors) when the run stops on an error."""
    from rlflow.runtime.launch import launch

    return RunResult.of(launch(as_plan(plan, overrides), resume=resume, address=address, log=log))


def simulate(plan: Plan | str | os.PathLike | Mapping, *, steps: int = 100, overrides=None, log=None, **options):
    """The plan in the discrete-event simulator, as `rlflow simulate` runs it: returns (result, notes), the
    rlflow.sim SimulationResult (mean_staleness, tokens_per_s, summary(), ...) and what the simulator assumed.
    `options`: sim_config's (mode, instances, profile, train_tokens_per_s, prompt_tokens, seed, scale). `log`: if
    given, the notes and a line saying what is simulated go to it before the simulation runs. Raises
    PipelineInvalid for a plan or options it cannot simulate."""
    from rlflow.errors import PipelineInvalid, Problem
    from rlflow.sim import SimConfigError, SimulationStalled
    from rlflow.sim import simulate as run_simulation
    from rlflow.sim.from_plan import sim_config

    typed = as_plan(plan, overrides)
    simulable(typed)
    try:
        config, notes = sim_config(typed, steps=steps, **options)
        if log is not None:
            for note in notes:
                log(f"note: {note}")
            log(f"simulating '{typed.name}': {config.steps} steps, {config.mode} mode, {_stage_instances(config)}, "
                f"policy {config.policy}" + (f" eta={config.eta}" if config.eta is not None else ""))
        return run_simulation(config), notes
    except (SimConfigError, ValueError, SimulationStalled) as e:
        raise PipelineInvalid(typed.source, [Problem(("simulate",), str(e), "bad-simulation",
                                                     "see rlflow simulate --help")]) from None


def _stage_instances(config) -> str:
    """'4 instances', or per rollout stage: 'gen_arith 1, gen_repeat 1 instance(s)'."""
    if not config.stages:
        return f"{config.instances} instances"
    return ", ".join(f"{s.name} {s.instances}" for s in config.rollouts) + " instance(s)"


def simulable(plan: Plan) -> None:
    """A plan the simulator cannot run as declared is refused (PipelineInvalid, exit 2 in the CLI), not simulated
    otherwise (rlflow.sim.from_plan.not_simulable says why)."""
    from rlflow.errors import PipelineInvalid, Problem
    from rlflow.sim.from_plan import ONE_STAGE_FIX, ONE_STAGE_RULE, not_simulable

    why = not_simulable(plan)
    if why:
        raise PipelineInvalid(plan.source, [Problem(("stages",), why, ONE_STAGE_RULE, ONE_STAGE_FIX)])


def tune(pipeline: str | os.PathLike | Mapping, *, gpus: int, overrides=None, steps: int = 30, **options) -> TuneResult:
    """Recommend the rollout/train GPU split and staleness setting for `gpus` GPUs (closed form + simulator), as
    `rlflow tune` does. `options`: rlflow.tune.tune's (profile, per_instance, train_tokens_per_gpu, screen_steps,
    jobs, batch_sizes). The result's `overrides` apply the recommendation (`rlflow compile --set` each)."""
    from rlflow.errors import PipelineInvalid, Problem
    from rlflow.tune import TuneArgError
    from rlflow.tune import tune as search
    from rlflow.tune_report import choose
    from rlflow.tune_report import overrides as recommended

    given = overrides_list(overrides)
    plan = compile(pipeline, given)
    simulable(plan)
    options.setdefault("jobs", os.cpu_count() or 1)
    try:
        candidates, notes = search(plan, gpus=gpus, steps=steps, **options)
    except TuneArgError as e:
        raise PipelineInvalid(plan.source, [Problem((e.option,), str(e), "bad-tune", "see rlflow tune --help")]) from None
    except ValueError as e:  # the simulator's (SimConfigError: e.g. lengths that cannot fit the KV budget)
        raise PipelineInvalid(plan.source, [Problem(("tune",), str(e), "bad-simulation", "see rlflow tune --help")]) from None
    best = choose(candidates)
    return TuneResult(plan=plan, candidates=candidates, best=best, overrides=[*given, *recommended(plan, best)],
                      notes=notes)
