"""The TRL side of benchmarks/vs_trl.py: TRL's GRPOTrainer in a virtualenv of its own, run as a script.

TRL is never a dependency of rlflow: `trl_python` creates ~/.cache/rlflow/bench-trl-venv (`torch==2.13.0` first, so
pip keeps the local CPU build, then `trl`) unless it already imports trl. `run_trl` writes TRL_SCRIPT and its
settings to a scratch directory, runs it with that venv's python under the benchmark's CPU accounting, and reads
back the events the script appends (one JSON line each: imported, prompt ids checked, ready, every step, trained,
saved).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from proc_cpu import TreeCPU

VENV = Path.home() / ".cache" / "rlflow" / "bench-trl-venv"
TORCH = "torch==2.13.0"  # resolves to the local CPU build here; installed first so nothing pulls a CUDA torch
TRL = "trl==1.16.0"  # the version whose GRPOConfig fields the script below uses

# Run with the TRL venv's python. Its only argument is a JSON file of settings; it appends one JSON line per event
# to the settings' "events" file.
TRL_SCRIPT = r'''
import json, re, sys, time

cfg = json.load(open(sys.argv[1]))
events = open(cfg["events"], "a", buffering=1)


def event(kind, **kw):
    events.write(json.dumps({"event": kind, "t": time.time(), **kw}) + "\n")


import torch  # noqa: E402
from datasets import load_dataset  # noqa: E402
from transformers import AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

torch.set_num_threads(cfg["threads"])
event("imported", trl=__import__("trl").__version__, transformers=__import__("transformers").__version__,
      torch=torch.__version__, threads=torch.get_num_threads())
counted = {"tokens": 0, "completions": 0, "rewards": []}
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def text(completion):
    """A completion as text: conversational completions are [{"role": "assistant", "content": ...}]."""
    return completion if isinstance(completion, str) else "".join(m["content"] for m in completion)


def exact_match(completion, answer):  # rlflow.stages.rewards.exact_match
    return 1.0 if completion.strip() == str(answer).strip() else 0.0


def final_number(completion, answer):  # rlflow.stages.rewards.final_number
    numbers = NUMBER.findall(completion)
    try:
        return 1.0 if numbers and float(numbers[-1]) == float(answer) else 0.0
    except ValueError:
        return 0.0


REWARD = {"exact_match": exact_match, "final_number": final_number}[cfg["reward"]]


def reward(prompts, completions, completion_ids, answer, **kwargs):
    """The reward rlflow's run uses; also counts the completion tokens (EOS included) generated this step."""
    counted["tokens"] += sum(len(ids) for ids in completion_ids)
    counted["completions"] += len(completion_ids)
    rewards = [REWARD(text(c), a) for c, a in zip(completions, answer)]
    counted["rewards"] += rewards
    return rewards


class StepClock(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        rewards = counted["rewards"]
        event("step", step=state.global_step, tokens=counted["tokens"], completions=counted["completions"],
              reward_mean=sum(rewards) / len(rewards) if rewards else None)
        counted.update(tokens=0, completions=0, rewards=[])


dataset = load_dataset("json", data_files=cfg["train_file"], split="train")
# the prompts as token ids, tokenized as TRL does, against the ids rlflow's run drew (same order, same text)
tokenizer = AutoTokenizer.from_pretrained(cfg["model"])
same = 0
for row in dataset.select(range(min(len(dataset), cfg["check_rows"]))):
    if cfg["chat"]:
        ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    else:
        ids = tokenizer(row["prompt"])["input_ids"]
    same += list(ids) == row["prompt_ids"]
event("prompt_ids", same=same, checked=min(len(dataset), cfg["check_rows"]))
config = GRPOConfig(
    output_dir=cfg["output_dir"], use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
    max_steps=cfg["steps"], per_device_train_batch_size=cfg["batch_prompts"] * cfg["group_size"],
    gradient_accumulation_steps=1, num_generations=cfg["group_size"], max_completion_length=cfg["max_new_tokens"],
    temperature=cfg["temperature"], top_p=1.0, top_k=0, learning_rate=cfg["lr"], lr_scheduler_type="constant",
    warmup_steps=0, optim="adamw_torch", weight_decay=0.0, max_grad_norm=1.0, beta=0.0, num_iterations=1,
    epsilon=0.2, epsilon_high=0.28, loss_type="dapo", scale_rewards="group", seed=0, logging_steps=1,
    save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
    shuffle_dataset=False,  # the rows are already in the order rlflow's run drew them
    use_transformers_paged=cfg["paged"],
)
trainer = GRPOTrainer(model=cfg["model"], reward_funcs=reward, args=config, train_dataset=dataset,
                      callbacks=[StepClock()])
event("ready")
trainer.train()
event("trained")
trainer.save_model(cfg["save_dir"])
trainer.processing_class.save_pretrained(cfg["save_dir"])
event("saved")
'''


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


def steady(step_ends: list[tuple[int, float, int]], warmup: int) -> float | None:
    """Tokens/s of the steps after the first `warmup` (>= 1), from (step, end time, tokens) rows: their tokens over
    the time from the end of step `warmup` to the end of the last step."""
    rows = sorted(step_ends)
    if len(rows) < warmup + 2:
        return None
    span = rows[-1][1] - rows[warmup - 1][1]
    return sum(tok for _, _, tok in rows[warmup:]) / span if span > 0 else None


def run_trl(python: Path, train_file: Path, settings: dict, scratch: Path, *, warmup: int, threads: int,
            paged: bool) -> dict:
    """One GRPOTrainer run with `settings` (model, chat, reward, temperature, steps, batch_prompts, group_size,
    max_new_tokens, lr); its figures as vs_trl.py's table reads them."""
    label = "TRL GRPOTrainer" + (" (paged generate)" if paged else "")
    work = scratch / ("trl-paged" if paged else "trl")
    work.mkdir()
    (work / "grpo.py").write_text(TRL_SCRIPT)
    cfg = {**settings, "train_file": str(train_file), "output_dir": str(work / "out"), "save_dir": str(work / "model"),
           "events": str(work / "events.jsonl"), "threads": threads, "paged": paged, "check_rows": 64}
    (work / "cfg.json").write_text(json.dumps(cfg))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(work / "hf-datasets"), "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
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
    at = {e["event"]: e for e in events if e["event"] != "step"}
    info, ids = at["imported"], at["prompt_ids"]
    tokens = sum(tok for _, _, tok in steps)
    return {"label": label, "wall_s": end - start, "first_step_s": steps[0][1] - start,
            "startup": {"imports": info["t"] - start, "trainer": at["ready"]["t"] - info["t"],
                        "save": at["saved"]["t"] - at["trained"]["t"]},
            "steady_tps": steady(steps, warmup), "e2e_tps": tokens / (end - start), "tokens": tokens,
            "steps": len(steps), "cpu_cores": cpu.tree_s / cpu.wall, "cpu_reaped_cores": cpu.reaped_s / cpu.wall,
            "machine": cpu.machine, "driver": None, "model_dir": cfg["save_dir"], "log": str(log),
            "prompt_ids": (ids["same"], ids["checked"]),
            "versions": {k: info[k] for k in ("trl", "transformers", "torch")}, "threads": info["threads"]}
