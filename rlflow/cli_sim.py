"""`rlflow simulate`, `tune` and `profile`: the plan in the discrete-event simulator, the GPU split it recommends,
and the cost model fitted to an engine."""

from __future__ import annotations

import json
import os
import shlex
from datetime import UTC, datetime
from typing import Annotated, Literal

import typer

from rlflow.cli_options import EXIT_OK, Bare, PipelineFile, PlanFile, Sets, overrides_of
from rlflow.errors import PipelineInvalid

PROFILE_HELP = "cost-model profile JSON (default: the plan's, else StaleFlow Table 4)"


def simulate(plan: PlanFile = None, bare: Bare = None,
             steps: Annotated[int, typer.Option(help="training steps to simulate")] = 100,
             mode: Annotated[Literal["slots", "cost_model"] | None, typer.Option(
                 show_default=False, help="slots: the closed form's C slots at speed s_R; cost_model: StaleFlow's "
                                          "per-instance cost model")] = None,
             instances: Annotated[int | None, typer.Option(help="rollout instances (default: the plan's replicas)",
                                                           show_default=False)] = None,
             profile: Annotated[str | None, typer.Option(help=PROFILE_HELP, show_default=False)] = None,
             train_tokens_per_s: Annotated[float | None, typer.Option(
                 help="trainer throughput (default: a measured profile's trainer, else the workload block, else rho = 1)", show_default=False)] = None,
             prompt_tokens: Annotated[int, typer.Option(help="prompt length held in the KV cache")] = 0,
             seed: Annotated[int | None, typer.Option(show_default=False)] = None,
             scale: Annotated[list[str] | None, typer.Option(
                 "--scale", metavar="STEP:N", show_default=False,
                 help="elastic rollout: N instances once STEP train steps have ended, as `rlflow scale` would ask "
                      "(repeatable; cost_model mode)")] = None,
             control_costs: Annotated[str | None, typer.Option(
                 "--control-costs", metavar="FILE|NAME|none", show_default=False,
                 help="seconds charged between actors per group and per step: a control-costs JSON, a name in "
                      "configs/control_costs/, or none for instant hand-offs (default: cpu-2core, measured by "
                      "benchmarks/bench_step_latency.py)")] = None,
             output: Annotated[str, typer.Option("-o", "--output", help="folder for the report")] = ".rlflow/sim",
             sets: Sets = None) -> int:
    """run the plan in the discrete-event simulator (any scale, seconds)"""
    from rlflow import api
    from rlflow.compiler import DEFAULT_PLAN
    from rlflow.errors import Problem
    from rlflow.sim.from_plan import plan_rollouts
    from rlflow.sim.report import text_report, write_report

    overrides = overrides_of(bare, sets)
    if plan is not None and "=" in plan and not os.path.exists(plan):  # `rlflow simulate k=v`: an override
        plan, overrides = None, [plan, *overrides]
    typed = api.as_plan(plan or DEFAULT_PLAN, overrides)
    api.simulable(typed)
    rollouts = [n for n, _ in plan_rollouts(typed)]
    if instances is not None and len(rollouts) > 1:
        raise PipelineInvalid(typed.source, [Problem(
            ("--instances",), f"--instances {instances} is one count, but this plan has {len(rollouts)} rollout "
            f"stages ({', '.join(rollouts)})", "instances-per-stage",
            f"set each stage's count with --set stages.<name>.replicas=N (e.g. --set stages.{rollouts[0]}.replicas="
            f"{instances}), or leave --instances out for the plan's replicas")])
    scale = scale or []
    points = [tuple(int(x) for x in item.split(":")) for item in scale if item.count(":") == 1
              and all(x.strip().isdigit() for x in item.split(":"))]
    if len(points) != len(scale):
        raise PipelineInvalid(typed.source, [Problem(("simulate",), f"--scale: expected STEP:N (two whole numbers), got "
                                                     f"{', '.join(scale)}", "bad-simulation", "see rlflow simulate --help")])
    options = dict(mode=mode, instances=instances, profile=profile, train_tokens_per_s=train_tokens_per_s,
                   prompt_tokens=prompt_tokens, seed=seed, scale=tuple(points), control_costs=control_costs)
    result, _ = api.simulate(typed, steps=steps, log=lambda line: print(line, flush=True), **options)  # prints its notes and what it simulates
    for t, after, n, why in result.scale_events:
        print(f"scale at {t:,.1f} s (after step {after}): {n} instance(s); {why}")
    print(text_report(result))
    pred = typed.prediction
    if pred.get("available"):
        print(f"plan's predicted mean staleness {pred['mean']:.3f} vs simulated {result.mean_staleness:.3f}")
    text, png = write_report(result, output, stem=typed.name)
    (text.parent / f"{typed.name}.json").write_text(json.dumps(result.summary(), indent=2, default=str))
    print(f"wrote {text}, {png} and {text.with_suffix('.json')}")
    return EXIT_OK


def tune(pipeline: PipelineFile, bare: Bare = None,
         gpus: Annotated[int, typer.Option(help="GPUs to split between rollout and training", show_default=False)] = ...,
         steps: Annotated[int, typer.Option(help="training steps simulated per confirmed candidate")] = 30,
         screen_steps: Annotated[int | None, typer.Option(
             show_default=False, help="training steps of the screening runs that pick the candidates worth a full "
                                      "run (default: a third of --steps, at least 5)")] = None,
         batch_sizes: Annotated[str | None, typer.Option(
             metavar="B1,B2,...", show_default=False,
             help="also search these batch sizes (groups per training step); default: the plan's only, since a batch "
                  "changes how many updates each sample gets, which the simulator cannot judge")] = None,
         jobs: Annotated[int | None, typer.Option(help="simulations run at once, one process each (default: the CPU "
                                                       "count)", show_default=False)] = None,
         profile: Annotated[str | None, typer.Option(help=PROFILE_HELP, show_default=False)] = None,
         gpus_per_instance: Annotated[int | None, typer.Option(
             help="GPUs per rollout instance (default: the profile's)", show_default=False)] = None,
         train_tokens_per_gpu: Annotated[float | None, typer.Option(
             help="trainer tokens/s per GPU (default: balances an even split, an assumption it prints)",
             show_default=False)] = None,
         sets: Sets = None) -> int:
    """recommend the rollout/train GPU split and staleness setting (closed form + simulator)"""
    from rlflow import api
    from rlflow.errors import Problem
    from rlflow.tune import knob_name
    from rlflow.tune_report import table

    given = overrides_of(bare, sets)
    try:
        batches = [int(b) for b in batch_sizes.split(",")] if batch_sizes else None
    except ValueError:
        raise PipelineInvalid(pipeline, [Problem(("--batch-sizes",), f"not comma-separated integers: {batch_sizes!r}",
                                                 "bad-tune", "e.g. --batch-sizes 64,128,256")]) from None
    advice = api.tune(pipeline, gpus=gpus, overrides=given, steps=steps, profile=profile, per_instance=gpus_per_instance,
                      train_tokens_per_gpu=train_tokens_per_gpu, screen_steps=screen_steps,
                      jobs=jobs or os.cpu_count() or 1, batch_sizes=batches)
    plan, candidates, best, notes = advice.plan, advice.candidates, advice.best, advice.notes
    for note in notes:
        print(f"note: {note}")
    print("\n".join(table(candidates, knob_name(plan.staleness.kind))))
    shipped = next((c for c in candidates if c.shipped and c.result), None)
    print(f"\nrecommended: {best.rollout_gpus} rollout GPUs"
          + (f" ({' + '.join(str(k * best.rollout_gpus // best.instances) for k in best.stages)} per rollout stage)"
             if best.stages else "") + f", {best.train_gpus} training GPUs"
          + (f", {knob_name(plan.staleness.kind)} {best.knob}" if best.knob is not None else "")
          + f": {best.result['tokens_per_s']:,.0f} trained tokens/s, mean staleness {best.result['mean_staleness']:.2f}"
          + (f" ({best.result['tokens_per_s'] / shipped.result['tokens_per_s']:.2f}x the shipped setting at an even split, "
             f"max staleness within its {shipped.result['max_staleness']})" if shipped else ""))
    if best.batch is not None:
        print(f"note: the recommendation changes the batch from {plan.staleness.batch_size} to "
              f"{best.batch} groups per step: each sample gets a different share of the updates, which the simulator "
              "does not judge; check learning before keeping it")
    line = " ".join(f"--set {o}" for o in advice.overrides)
    print(f"rlflow compile {pipeline} {line}")
    return EXIT_OK


def profile(pipeline: Annotated[str | None, typer.Argument(
                metavar="[PIPELINE]", show_default=False,
                help="measure everything the simulator needs in a short run of this pipeline (engine in the run, "
                     "trainer, control costs, group filter, lengths); without it, time the engine alone")] = None,
            steps: Annotated[int, typer.Option(help="training steps of the calibration run (with PIPELINE)")] = 16,
            sets: Sets = None,
            model: Annotated[str, typer.Option(help="builtin:tiny-llama or a local HF directory")] = "builtin:tiny-llama",
            task: Annotated[str, typer.Option(help="built-in task the tiny model is warm-started on")] = "repeat",
            engine: Annotated[str, typer.Option(help="engine name")] = "hf",
            prompt: Annotated[str, typer.Option(help="prompt to generate from (long answers give clean steps)")] = "abc*16=",
            batch_sizes: Annotated[str, typer.Option(help="comma-separated running-set sizes")] = "1,2,4,8,16,32",
            output: Annotated[str, typer.Option("-o", "--output", help="profile JSON to write")]
            = "configs/profiles/tiny-llama-hf.json") -> int:
    """measure a profile for the simulator: a pipeline's calibration run, or an engine's decode steps alone"""
    if pipeline is not None:
        return profile_pipeline(pipeline, steps=steps, overrides=sets or [],
                                output=None if output == "configs/profiles/tiny-llama-hf.json" else output)
    from rlflow import registry
    from rlflow.profile import fit_profile, machine, measure_engine, measure_pull, write_profile

    sizes = [int(x) for x in batch_sizes.split(",")]
    built = registry.resolve("model", model)(task=task) if model.startswith("builtin:") else model
    extra = {"chunk_size": 2} if engine == "hf" else {}  # short chunks: more steps with no trajectory finishing
    running = registry.resolve("engine", engine)(str(built), max_running=max(sizes), max_new_tokens=64, **extra)
    ids = running.tokenizer(prompt)["input_ids"]
    try:
        fit = fit_profile(measure_engine(running, ids, batch_sizes=sizes))
    except ValueError as e:
        from rlflow.errors import Problem

        raise PipelineInvalid("rlflow profile", [Problem(("--batch-sizes",), str(e), "too-few-samples",
                                                          "pass more batch sizes, or a prompt with longer answers")]) from None
    pull_s = measure_pull(running, built)
    if hasattr(running, "close"):
        running.close()
    command = (f"rlflow profile --engine {engine} --model {model} --task {task} "
               f"--prompt {shlex.quote(prompt)} --batch-sizes {batch_sizes} -o {output}")
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    path = write_profile(fit, output, name=f"{engine}-{built.name if hasattr(built, 'name') else built}",
                         engine=engine, model=model,
                         source=f"measured {when} by `{command}` on {machine()}; fit R^2 = {fit['r2']:.3f}",
                         max_running=max(sizes), kv_budget=max(sizes) * 512, pull_s=pull_s)
    print("  ".join(f"{k}={v:.3g}" for k, v in fit.items()) + f"  pull_s={pull_s:.3g}")
    print(f"wrote {path}")
    return EXIT_OK


def profile_pipeline(pipeline: str, *, steps: int, overrides: list[str], output: str | None) -> int:
    """`rlflow profile PIPELINE`: a calibration run of the pipeline (no checkpoints, no export), then the fit."""
    from rlflow import api
    from rlflow.errors import Problem
    from rlflow.profile_run import ProfileRunError, describe, fit_run, profile_doc, write
    from rlflow.runtime.sim_inputs import FILE

    train = _train_stages(pipeline)
    calibration = [f"stages.{name}.{key}" for name in train for key in (f"steps={steps}", "checkpoint_every=0")]
    plan = api.as_plan(pipeline, [*overrides, *calibration])
    rollouts = plan.rollout_stages()
    if len(rollouts) != 1:
        raise PipelineInvalid(plan.source, [Problem(("stages",), f"rlflow profile measures one rollout stage; this plan "
                                                    f"has {len(rollouts)} ({', '.join(rollouts)})", "profile-one-stage",
                                                    "profile a pipeline with one of them, e.g. --set to drop the others")])
    output = output or f"profiles/{plan.name}.json"
    print(f"profile: a calibration run of '{plan.name}', {steps} steps; then the fit, written to {output}", flush=True)
    result = api.run(plan)
    if result.run_dir is None or not (result.run_dir / FILE).exists():
        raise PipelineInvalid(plan.source, [Problem(("profile",), "the calibration run left no measurements "
                                                    f"({FILE}); it stopped early?", "profile-run-incomplete",
                                                    "run it again to its last step")])
    inputs = json.loads((result.run_dir / FILE).read_text())
    try:
        fit = fit_run(inputs, result.summary)
    except ProfileRunError as e:
        raise PipelineInvalid(plan.source, [Problem(("profile",), str(e), "profile-too-short",
                                                    "rlflow profile PIPELINE --steps N with a larger N")]) from None
    rollout = plan.pipeline["stages"][rollouts[0]]
    command = f"rlflow profile {pipeline} --steps {steps}" + "".join(f" --set {o}" for o in overrides) + f" -o {output}"
    path = write(profile_doc(fit, plan=plan, command=command, engine=rollout["engine"],
                             model=str(plan.model.get("path") or plan.model.get("name") or ""),
                             max_running=rollout["max_running"]), output)
    for line in describe(fit):
        print(line)
    print(f"wrote {path}; name it in the rollout stage (coordinator: {{profile: {path}}}) and rlflow run, simulate "
          "and tune predict this pipeline from it")
    return EXIT_OK


def _train_stages(pipeline: str) -> list[str]:
    """The train stages' names (their steps and checkpoints are the calibration run's)."""
    from rlflow import api

    plan = api.as_plan(pipeline, [])
    return [n for n, st in plan.pipeline["stages"].items() if st.get("kind") == "train"]
