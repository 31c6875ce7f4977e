"""rlflow against TRL's GRPOTrainer: the same tiny model, task, reward and budget, end to end.

    python benchmarks/vs_trl.py [--steps 30] [--batch-prompts 8] [--group-size 8] [--max-new-tokens 8] [--lr 3e-4]
                                [--trl-threads N] [--sides trl,sync,async] [--skip-install]

TRL is installed in a virtualenv of its own (default ~/.cache/rlflow/bench-trl-venv; `torch==2.13.0` first, so pip
keeps the local CPU build, then `trl`), never as a dependency of rlflow; --skip-install uses that venv as it is.
Three runs, one after another so each has the machine to itself:

- TRL: a script this benchmark writes to a scratch directory, run with the venv's python: `GRPOTrainer` on the CPU
  (`use_cpu`, fp32, no vLLM, no gradient checkpointing), one optimizer step per generation batch of
  batch-prompts x group-size completions, constant learning rate, DAPO token-level loss, clip 0.2 / 0.28, no KL,
  rewards scaled by the group's std: rlflow's GRPO defaults. Its model is saved with `trainer.save_model`.
- rlflow sync: `rlflow compile p.yaml && rlflow run` in a scratch directory, buffer->train a barrier (eta = 0); its
  DeepSpeed config is configs/deepspeed/zero1.json with the whole batch as one micro-batch, as TRL's is.
- rlflow async: the same with a staleness bound eta = 1 (the quickstart's), no group filter on either.

Same everywhere: `builtin:tiny-llama` built for `arith` (cached under ~/.cache/rlflow/models), the `arith` rows
(`rlflow.stages.tasks.arith`, seed 0, as many as rlflow generates) minus a held-out 10% picked by rlflow's hash of the
prompt (rlflow: `data.eval: 0.1`, which skips them in training and scores them once at the end on its evaluator actor;
TRL: the remaining rows written to a JSON file and loaded with `datasets`), the reward `exact_match` (completion
stripped == answer), temperature 1.0, steps, prompts per step, group size, max new tokens and learning rate.

Measured per run:
- wall: process start to exit (rlflow: `rlflow compile` plus `rlflow run`; TRL: the script, imports included);
  to first step: from process start to the end of the first optimizer step.
- steady tokens/s: completion tokens (counted up to and including EOS) of the steps after the first --warmup
  steps, over the time between the end of step --warmup and the end of the last step. rlflow: per-step `tokens`
  and timestamps from the run's MLflow store; TRL: token counts of the completions its reward function receives,
  and a callback's timestamp at each step end.
- e2e tokens/s: all completion tokens trained on over the wall time.
- CPU: user+sys CPU seconds of the whole process tree (every descendant of this benchmark: the TRL process, or
  rlflow's driver, its Ray processes and workers), sampled from /proc every second, over wall, in cores (this
  machine has os.cpu_count()); machine: the whole machine's busy share from /proc/stat over the run (includes
  anything else running). driver: the `rlflow run` process's own CPU in the steady-state window, in % of a core.
- accuracy before / after: held-out greedy accuracy of the initial and the final model, both scored by
  `rlflow eval MODEL --data heldout.jsonl --n 128 --k 1 --max-new-tokens 8 --reward exact_match` in rlflow's
  environment (rlflow's model: the run's `export/`; TRL's: its saved directory); heldout.jsonl holds the first 128
  held-out rows exactly as rlflow's own held-out split has them.

Prints one table, with each rlflow run's figures as ratios to TRL's, and writes it to benchmarks/results/vs_trl.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from run_output import run_summary

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "vs_trl.md"
VENV = Path.home() / ".cache" / "rlflow" / "bench-trl-venv"
TORCH = "torch==2.13.0"  # resolves to the local CPU build here; installed first so nothing pulls a CUDA torch
TRL = "trl==1.16.0"  # the version whose GRPOConfig fields the script below uses
HOLDOUT = 0.1  # share of prompts held out (rlflow's data.eval)
EVAL_N = 128
TASK = "arith"

# The TRL side: written to the scratch directory and run with the TRL venv's python. Its only argument is a JSON
# file of settings; it appends one JSON line per event to the settings' "events" file.
TRL_SCRIPT = r'''
import json, sys, time

cfg = json.load(open(sys.argv[1]))
events = open(cfg["events"], "a", buffering=1)


def event(kind, **kw):
    events.write(json.dumps({"event": kind, "t": time.time(), **kw}) + "\n")


import torch  # noqa: E402
from datasets import load_dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

event("imported", trl=__import__("trl").__version__, transformers=__import__("transformers").__version__,
      torch=torch.__version__, threads=torch.get_num_threads())
counted = {"tokens": 0, "completions": 0, "rewards": []}


def exact_match(prompts, completions, completion_ids, answer, **kwargs):
    """rlflow.stages.rewards.exact_match; also counts the completion tokens (EOS included) generated this step."""
    counted["tokens"] += sum(len(ids) for ids in completion_ids)
    counted["completions"] += len(completion_ids)
    rewards = [1.0 if c.strip() == str(a).strip() else 0.0 for c, a in zip(completions, answer)]
    counted["rewards"] += rewards
    return rewards


class StepClock(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        rewards = counted["rewards"]
        event("step", step=state.global_step, tokens=counted["tokens"], completions=counted["completions"],
              reward_mean=sum(rewards) / len(rewards) if rewards else None)
        counted.update(tokens=0, completions=0, rewards=[])


dataset = load_dataset("json", data_files=cfg["train_file"], split="train")
config = GRPOConfig(
    output_dir=cfg["output_dir"], use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
    max_steps=cfg["steps"], per_device_train_batch_size=cfg["batch_prompts"] * cfg["group_size"],
    gradient_accumulation_steps=1, num_generations=cfg["group_size"], max_completion_length=cfg["max_new_tokens"],
    temperature=1.0, top_p=1.0, top_k=0, learning_rate=cfg["lr"], lr_scheduler_type="constant", warmup_steps=0,
    optim="adamw_torch", weight_decay=0.0, max_grad_norm=1.0, beta=0.0, num_iterations=1, epsilon=0.2,
    epsilon_high=0.28, loss_type="dapo", scale_rewards="group", seed=0, logging_steps=1, save_strategy="no",
    report_to="none", disable_tqdm=True, dataloader_num_workers=0,
)
trainer = GRPOTrainer(model=cfg["model"], reward_funcs=exact_match, args=config, train_dataset=dataset,
                      callbacks=[StepClock()])
event("ready")
trainer.train()
event("trained")
trainer.save_model(cfg["save_dir"])
trainer.processing_class.save_pretrained(cfg["save_dir"])
event("saved")
'''


# ------------------------------------------------------------------------------------------- CPU accounting
CLK_TCK = os.sysconf("SC_CLK_TCK")


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine since boot, from /proc/stat (idle and iowait are not busy)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    return total - fields[3] - fields[4], total


class TreeCPU:
    """CPU seconds of every descendant of this process, sampled from /proc/<pid>/stat while a run goes on.

    A process's cumulative utime+stime is kept at its last sample, so one that exits is still counted (up to one
    interval short). Ray's workers are children of the raylet, a child of `rlflow run`: all are descendants."""

    def __init__(self, interval: float = 1.0):
        self.interval, self.me = interval, os.getpid()
        self.cpu: dict[tuple[int, int], float] = {}  # (pid, start time) -> CPU seconds at the last sample
        self.series: dict[int, list[tuple[float, float]]] = {}  # pids to follow -> [(time, CPU seconds)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def follow(self, pid: int) -> None:
        self.series.setdefault(pid, [])

    def _sample(self) -> None:
        now, stats = time.time(), {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                text = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:
                continue
            rest = text[text.rindex(")") + 2:].split()
            stats[int(entry.name)] = (int(rest[1]), int(rest[19]), (int(rest[11]) + int(rest[12])) / CLK_TCK)
        children: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in stats.items():
            children.setdefault(ppid, []).append(pid)
        todo = list(children.get(self.me, []))
        while todo:
            pid = todo.pop()
            _, start, cpu = stats[pid]
            self.cpu[(pid, start)] = cpu
            if pid in self.series:
                self.series[pid].append((now, cpu))
            todo += children.get(pid, [])

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self):
        self.t0, self.machine0, self.rusage0 = time.time(), machine_busy(), _children_rusage()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        (b0, t0), (b1, t1) = self.machine0, machine_busy()
        self.wall = time.time() - self.t0
        self.tree_s = sum(self.cpu.values())
        self.machine = (b1 - b0) / max(t1 - t0, 1)
        self.reaped_s = _children_rusage() - self.rusage0  # exact for waited-for children only (not Ray's workers)

    def window_share(self, pid: int, start: float, end: float) -> float | None:
        """`pid`'s CPU between two wall-clock times, as a share of one core."""
        points = [(t, c) for t, c in self.series.get(pid, []) if start <= t <= end]
        if len(points) < 2 or points[-1][0] <= points[0][0]:
            return None
        return (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])


def _children_rusage() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


# ------------------------------------------------------------------------------------------------ the runs
def trl_python(skip_install: bool) -> Path:
    """The TRL venv's python; the venv is created and filled unless it already imports trl."""
    python = VENV / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import trl"], capture_output=True).returncode == 0:
        return python
    if skip_install:
        sys.exit(f"--skip-install: no TRL in {VENV}; run once without --skip-install")
    print(f"installing TRL into {VENV} ({TORCH} first, then {TRL}) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", VENV], check=True)
    for spec in (TORCH, TRL):
        subprocess.run([python, "-m", "pip", "install", "-q", spec], check=True)
    return python


def write_data(scratch: Path) -> tuple[Path, Path]:
    """train.json (the task's rows rlflow trains on) and heldout.jsonl (the first EVAL_N held-out rows)."""
    from rlflow.prompt_rows import BUILTIN_TASK_ROWS, held_out
    from rlflow.runtime.evaluation import held_out_rows
    from rlflow.stages.tasks import arith

    rows = arith(seed=0, count=BUILTIN_TASK_ROWS)
    train = [r for r in rows if not held_out(r["prompt"], HOLDOUT)]
    held = held_out_rows({"source": f"builtin:{TASK}", "holdout": HOLDOUT, "limit": None}, size=EVAL_N, seed=0)
    (scratch / "train.json").write_text(json.dumps(train))
    (scratch / "heldout.jsonl").write_text("".join(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n"
                                                   for r in held))
    return scratch / "train.json", scratch / "heldout.jsonl"


def steady(step_ends: list[tuple[int, float, int]], warmup: int) -> float | None:
    """Tokens/s of the steps after the first `warmup` (>= 1), from (step, end time, tokens) rows: their tokens over
    the time from the end of step `warmup` to the end of the last step."""
    rows = sorted(step_ends)
    if len(rows) < warmup + 2:
        return None
    span = rows[-1][1] - rows[warmup - 1][1]
    return sum(tok for _, _, tok in rows[warmup:]) / span if span > 0 else None


def run_trl(python: Path, model: str, train_file: Path, args, scratch: Path) -> dict:
    work = scratch / "trl"
    work.mkdir()
    (work / "grpo.py").write_text(TRL_SCRIPT)
    cfg = {"model": model, "train_file": str(train_file), "output_dir": str(work / "out"), "save_dir": str(work / "model"),
           "events": str(work / "events.jsonl"), "steps": args.steps, "batch_prompts": args.batch_prompts,
           "group_size": args.group_size, "max_new_tokens": args.max_new_tokens, "lr": args.lr}
    (work / "cfg.json").write_text(json.dumps(cfg))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(work / "hf-datasets"), "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": str(args.trl_threads), "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    log = work / "run.log"
    with log.open("w") as out, TreeCPU() as cpu:
        start = time.time()
        rc = subprocess.run([python, work / "grpo.py", work / "cfg.json"], cwd=work, env=env, stdout=out,
                            stderr=subprocess.STDOUT).returncode
        end = time.time()
    if rc != 0:
        sys.exit(f"TRL exited {rc}; see {log}\n" + "\n".join(log.read_text().splitlines()[-20:]))
    events = [json.loads(line) for line in (work / "events.jsonl").read_text().splitlines()]
    steps = [(e["step"], e["t"], e["tokens"]) for e in events if e["event"] == "step"]
    at = {e["event"]: e["t"] for e in events if e["event"] != "step"}
    info = next(e for e in events if e["event"] == "imported")
    tokens = sum(tok for _, _, tok in steps)
    return {"label": "TRL GRPOTrainer", "wall_s": end - start, "first_step_s": steps[0][1] - start,
            "startup": {"imports": at["imported"] - start, "trainer": at["ready"] - at["imported"],
                        "save": at["saved"] - at["trained"]},
            "steady_tps": steady(steps, args.warmup), "e2e_tps": tokens / (end - start), "tokens": tokens,
            "steps": len(steps), "cpu_cores": cpu.tree_s / cpu.wall, "cpu_reaped_cores": cpu.reaped_s / cpu.wall,
            "machine": cpu.machine, "driver": None, "model_dir": cfg["save_dir"],
            "versions": {k: info[k] for k in ("trl", "transformers", "torch")}, "threads": info["threads"]}


def pipeline_yaml(mode: str, args) -> str:
    policy = "{kind: barrier}" if mode == "sync" else f"{{kind: staleness_bound, eta: {args.eta}}}"
    return f"""# written by benchmarks/vs_trl.py
name: vs-trl-{mode}
model: {{path: "builtin:tiny-llama", max_model_len: 128}}
data: {{source: "builtin:{TASK}", eval: {HOLDOUT}, eval_size: {EVAL_N}, eval_k: 1}}
stages:
  rollout: {{kind: rollout, engine: hf, replicas: 1, group_size: {args.group_size}, max_new_tokens: {args.max_new_tokens}, max_running: 128, temperature: 1.0}}
  score:   {{kind: reward, fn: exact_match}}
  buffer:  {{kind: buffer, batch_groups: {args.batch_prompts}}}
  train:   {{kind: train, deepspeed: ds.json, steps: {args.steps}, lr: {args.lr}, eval_every: 0, checkpoint_every: 0}}
edges:
  - {{from: data,    to: rollout, policy: {{kind: streaming}}}}
  - {{from: rollout, to: score,   policy: {{kind: streaming}}}}
  - {{from: score,   to: buffer,  policy: {{kind: streaming}}}}
  - {{from: buffer,  to: train,   policy: {policy}}}
  - {{from: train,   to: rollout, policy: {{kind: weight_sync, mode: global}}}}
tracking: {{mlflow: {{experiment: vs-trl}}}}
"""


def run_rlflow(mode: str, args, scratch: Path) -> dict:
    work = scratch / f"rlflow-{mode}"
    work.mkdir()
    (work / "p.yaml").write_text(pipeline_yaml(mode, args))
    os.symlink(ROOT / "configs", work / "configs")
    # one forward/backward pass per step on both sides: TRL's per_device_train_batch_size is the whole batch, so is
    # rlflow's micro-batch (zero1.json's 8 rows would run 8 passes where TRL runs one)
    ds = json.loads((ROOT / "configs" / "deepspeed" / "zero1.json").read_text())
    ds["train_micro_batch_size_per_gpu"] = args.batch_prompts * args.group_size
    (work / "ds.json").write_text(json.dumps(ds, indent=2))
    log = work / "run.log"
    rlflow = [sys.executable, "-m", "rlflow.cli"]
    with log.open("w") as out, TreeCPU() as cpu:
        start = time.time()
        rc = subprocess.run([*rlflow, "compile", "p.yaml"], cwd=work, stdout=out, stderr=subprocess.STDOUT).returncode
        if rc == 0:
            proc = subprocess.Popen([*rlflow, "run"], cwd=work, stdout=out, stderr=subprocess.STDOUT)
            cpu.follow(proc.pid)
            rc = proc.wait()
        end = time.time()
    text = log.read_text()
    if rc != 0:
        sys.exit(f"rlflow {mode}: exited {rc}; see {log}\n" + "\n".join(text.splitlines()[-20:]))
    summary = run_summary(work, f"rlflow {mode}")
    steps = step_rows(work / "mlflow.db", summary["mlflow_run_id"])
    tokens = sum(tok for _, _, tok in steps)
    ordered = sorted(steps)
    window = (ordered[args.warmup - 1][1], ordered[-1][1])
    exports = sorted(work.glob(".rlflow/runs/*/*/export/config.json"))
    if not exports:
        sys.exit(f"rlflow {mode}: no export under {work}/.rlflow/runs")
    return {"label": f"rlflow {'sync (barrier)' if mode == 'sync' else f'async (eta = {args.eta})'}",
            "wall_s": end - start, "first_step_s": ordered[0][1] - start,
            "steady_tps": steady(steps, args.warmup), "e2e_tps": tokens / (end - start), "tokens": tokens,
            "steps": len(steps), "cpu_cores": cpu.tree_s / cpu.wall, "cpu_reaped_cores": cpu.reaped_s / cpu.wall,
            "machine": cpu.machine, "driver": cpu.window_share(proc.pid, *window), "model_dir": str(exports[-1].parent),
            "staleness": (summary["staleness_mean"], summary["staleness_max"]),
            "in_run_eval": (summary.get("eval_last") or {}).get("eval/accuracy")}


def step_rows(db: Path, run_id: str) -> list[tuple[int, float, int]]:
    """(step, wall-clock time the step was logged, completion tokens trained) from the run's MLflow store."""
    from mlflow.tracking import MlflowClient

    from rlflow.runtime.metric_names import mlflow_key

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    return [(m.step, m.timestamp / 1000, int(m.value)) for m in client.get_metric_history(run_id, mlflow_key("tokens"))]


def accuracy(model_dir: str, heldout: Path, args) -> float:
    """Held-out greedy accuracy from `rlflow eval` (in this environment)."""
    cmd = [sys.executable, "-m", "rlflow.cli", "eval", model_dir, "--data", str(heldout), "--n", str(EVAL_N),
           "--k", "1", "--max-new-tokens", str(args.max_new_tokens), "--reward", "exact_match"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    line = next((ln for ln in res.stdout.splitlines() if ln.split()[:1] == ["accuracy"]), None)
    if res.returncode != 0 or line is None:
        sys.exit(f"rlflow eval {model_dir} failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    return float(line.split()[1])


# ------------------------------------------------------------------------------------------------ the table
COLUMNS = [  # (header, key, format, ratio meaning)
    ("wall (s)", "wall_s", "{:.0f}", "lower is better"),
    ("to first step (s)", "first_step_s", "{:.0f}", "lower is better"),
    ("steady tokens/s", "steady_tps", "{:.0f}", "higher is better"),
    ("e2e tokens/s", "e2e_tps", "{:.0f}", "higher is better"),
    ("tokens", "tokens", "{:,}", ""),
    ("CPU (cores)", "cpu_cores", "{:.2f}", ""),
    ("machine busy", "machine", "{:.0%}", ""),
    ("driver CPU, steady", "driver", "{:.0%}", ""),
    ("accuracy before", "acc_before", "{:.3f}", ""),
    ("accuracy after", "acc_after", "{:.3f}", ""),
]


def fmt(fmt_: str, value) -> str:
    return "–" if value is None else fmt_.format(value)


def table(results: list[dict]) -> list[str]:
    lines = ["| run | " + " | ".join(h for h, *_ in COLUMNS) + " |", "|---|" + "---:|" * len(COLUMNS)]
    for r in results:
        lines.append(f"| {r['label']} | " + " | ".join(fmt(f, r.get(k)) for _, k, f, _ in COLUMNS) + " |")
    base = next((r for r in results if r["label"].startswith("TRL")), None)
    for r in results:
        if base is None or r is base:
            continue
        cells = []
        for _, k, _, _ in COLUMNS:
            a, b = r.get(k), base.get(k)
            cells.append(f"{a / b:.2f}×" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "–")
        lines.append(f"| **{r['label'].split(' (')[0]} / TRL** | " + " | ".join(cells) + " |")
    return lines


def report(results: list[dict], args, seconds: float) -> list[str]:
    """The markdown: the command and settings, the table, what each column means."""
    command = " ".join(["python benchmarks/vs_trl.py", *sys.argv[1:]])
    trl = next((r for r in results if r["label"].startswith("TRL")), None)
    setting = (f"`{command}` on {platform.machine()}, {os.cpu_count()} shared CPUs, Python {platform.python_version()}: "
               f"{args.steps} steps of {args.batch_prompts} prompts × {args.group_size} completions, max_new_tokens "
               f"{args.max_new_tokens}, temperature 1.0, lr {args.lr:g}; builtin:tiny-llama built for {TASK}, task "
               f"builtin:{TASK}, reward exact_match; the runs one at a time; the whole benchmark took {seconds:.0f} s.")
    if trl:
        v = trl["versions"]
        setting += (f" TRL {v['trl']} (transformers {v['transformers']}, torch {v['torch']}, {trl['threads']} torch "
                    f"threads) in its own venv.")
    out = ["# rlflow vs TRL's GRPOTrainer: same model, task, reward and budget", "", setting, "", *table(results), "",
           ("Ratio rows: the rlflow run's value divided by TRL's (wall and time to first step: lower is better; "
            "tokens/s: higher is better). Goals (issue 15): async e2e ≥ 2×, async steady ≥ 3×, sync e2e ≥ 1×."), "",
           "- wall: process start to exit (rlflow: `rlflow compile` + `rlflow run`; TRL: its script, imports included).",
           "- to first step: process start to the end of the first optimizer step.",
           (f"- steady tokens/s: completion tokens (up to and including EOS) of steps {args.warmup + 1}..{args.steps} "
            f"over the time from the end of step {args.warmup} to the end of the last step."),
           "- e2e tokens/s: all completion tokens trained on, over the wall time; tokens: their number.",
           ("- CPU (cores): user+sys CPU seconds of the whole process tree (for rlflow its Ray processes and workers "
            "too), sampled from /proc every second, over wall; machine busy: the whole machine's busy share from "
            "/proc/stat over the run (includes any other work on the machine)."),
           "- driver CPU, steady: the `rlflow run` process alone in the steady-state window, share of one core.",
           (f"- accuracy: held-out greedy accuracy on {EVAL_N} prompts never trained on (`rlflow eval --k 1`), of "
            "the initial and the final model.")]
    runs = [r for r in results if "staleness" in r]
    if runs:
        out += ["", "rlflow runs: " + "; ".join(
            f"{r['label']}: staleness mean {r['staleness'][0]:.2f} max {r['staleness'][1]}, its own end-of-run "
            f"held-out accuracy {fmt('{:.3f}', r['in_run_eval'])}" for r in runs) + "."]
    if trl:
        s = trl["startup"]
        out += ["", (f"TRL: imports {s['imports']:.1f} s, trainer construction {s['trainer']:.1f} s, "
                     f"save_model {s['save']:.1f} s.")]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    ap.add_argument("--batch-prompts", type=int, default=8, help="prompts per step (default 8)")
    ap.add_argument("--group-size", type=int, default=8, help="completions per prompt (default 8)")
    ap.add_argument("--max-new-tokens", type=int, default=8, help="longest completion (default 8)")
    ap.add_argument("--lr", type=float, default=3e-4, help="learning rate (default 3e-4, the quickstart's)")
    ap.add_argument("--eta", type=int, default=1, help="staleness bound of the async run (default 1)")
    ap.add_argument("--warmup", type=int, default=3, help="first steps left out of the steady state (>= 1; default 3)")
    ap.add_argument("--trl-threads", type=int, default=2, help="torch threads of the TRL process (default 2)")
    ap.add_argument("--sides", default="trl,sync,async", help="which runs (default trl,sync,async)")
    ap.add_argument("--skip-install", action="store_true", help=f"use {VENV} as it is")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory (logs, MLflow stores, models)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    sides = args.sides.split(",")
    if args.warmup < 1 or args.steps < args.warmup + 2:
        sys.exit("--steps must exceed --warmup by at least 2")
    t_all = time.time()
    python = trl_python(args.skip_install) if "trl" in sides else None

    from rlflow.stages.tiny_model import build_tiny_llama

    model = str(build_tiny_llama(TASK))
    results = []
    scratch = Path(tempfile.mkdtemp(prefix="bench-vs-trl-"))
    try:
        train_file, heldout = write_data(scratch)
        before = accuracy(model, heldout, args)
        print(f"initial model {model}: held-out accuracy {before:.3f}", flush=True)
        for side in sides:
            print(f"running {side} ...", flush=True)
            r = run_trl(python, model, train_file, args, scratch) if side == "trl" else run_rlflow(side, args, scratch)
            r["acc_before"], r["acc_after"] = before, accuracy(r["model_dir"], heldout, args)
            print(f"  {r['label']}: wall {r['wall_s']:.0f} s, first step at {r['first_step_s']:.0f} s, "
                  f"steady {fmt('{:.0f}', r['steady_tps'])} tokens/s, e2e {r['e2e_tps']:.0f} tokens/s, "
                  f"CPU {r['cpu_cores']:.2f} cores, accuracy {before:.3f} -> {r['acc_after']:.3f}", flush=True)
            results.append(r)
    finally:
        if args.keep:
            print(f"kept {scratch} (logs, MLflow stores, models)")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    out = report(results, args, time.time() - t_all)
    print("\n".join(out))
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(out) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
