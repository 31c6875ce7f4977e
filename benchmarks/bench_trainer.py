"""Trainer step time on this machine's device (CPU, or the GPU when there is one): fp32 and bf16.

    python benchmarks/bench_trainer.py [--model 512x8] [--batch 64] [--steps 5] [--dtypes float32 bfloat16]

One DeepSpeedTrainer (ZeRO-1, one rank; no Ray) on a randomly initialised Llama of hidden size H and L
layers with the tiny model's tokenizer (bench_engines.model_for), trained on batches of groups of 8 with
long-tailed completion lengths (lognormal, capped at 128 tokens). The first step warms up and is not
counted. Prints a table of completion tokens/s per dtype, with the ratio to the first dtype, and writes
benchmarks/results/trainer_<device>.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

from results_table import publish_table

DEEPSPEED = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0, "zero_optimization": {"stage": 1},
             "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}, "steps_per_print": 10**6}
TRAINER = dict(lr=1e-5, clip_low=0.2, clip_high=0.28, loss_agg="token", kl_coef=0.0, max_importance_ratio=5.0)


def trainer_batch(prompts: list[list[int]], size: int, cap: int, vocab: int, seed: int) -> list[dict]:
    """`size` rewarded trajectories in groups of 8, completion lengths lognormal (median 20) capped at `cap`."""
    from rlflow.stages.trajectory import Trajectory

    rng = random.Random(seed)
    rows = []
    for i in range(size):
        n = min(cap, max(1, int(rng.lognormvariate(3.0, 0.8))))
        t = Trajectory(group_id=f"s{seed}-g{i // 8}", index=i % 8, prompt="", answer="", prompt_ids=prompts[i % len(prompts)],
                       completion_ids=[rng.randrange(3, vocab) for _ in range(n)], behaviour_logprobs=[-2.0] * n,
                       reward=float(rng.random() < 0.5))
        rows.append(t.as_dict())
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="512x8", help="HxL: a random Llama of hidden size H and L layers")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = ap.parse_args(argv)

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(Path(__file__).parent))
    import torch
    from bench_engines import model_for
    from transformers import AutoTokenizer

    from rlflow.stages import tasks
    from rlflow.stages.tiny_model import build_tiny_llama
    from rlflow.stages.trainer import DeepSpeedTrainer
    from rlflow.stages.trajectory import Trajectory

    torch.set_num_threads(1)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores, 1 thread)"
    tiny_dir = build_tiny_llama("repeat", progress=lambda line: print(line, flush=True))
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in tasks.repeat(0, 64)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, n_params = model_for(args.model, Path(tiny_dir), Path(tmp))
        batches = [[Trajectory.from_dict(r) for r in trainer_batch(prompts, args.batch, 128, tokenizer.vocab_size, s)]
                   for s in range(args.steps + 1)]
        for dtype in args.dtypes:
            trainer = DeepSpeedTrainer(model_dir, DEEPSPEED, dtype=dtype, **TRAINER)
            times = []
            for batch in batches:
                t0 = time.perf_counter()
                trainer.train_step(batch, 8)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            trainer.close()
            seconds = sum(times[1:]) / len(times[1:])
            tokens = sum(len(t.completion_ids) for t in batches[-1])
            rows.append((dtype, seconds, tokens / seconds))
            print(f"{dtype}: {seconds:.3f} s/step, {tokens / seconds:.0f} completion tok/s", flush=True)
    lines = [
        f"# Trainer step time on {device}\n",
        f"`python benchmarks/bench_trainer.py --model {args.model} --batch {args.batch} --steps {args.steps} "
        f"--dtypes {' '.join(args.dtypes)}`  ",
        f"{platform.machine()}, Python {sys.version.split()[0]}, torch {torch.__version__}; model {args.model} "
        f"({n_params / 1e6:.1f}M params), DeepSpeed ZeRO-1, one rank, batch {args.batch} trajectories.\n",
        f"| dtype | s/step | completion tokens/s | vs {args.dtypes[0]} |",
        "|---|---:|---:|---:|",
    ]
    for dtype, seconds, tps in rows:
        lines.append(f"| {dtype} | {seconds:.3f} | {tps:.0f} | {tps / rows[0][2]:.2f}x |")
    publish_table(Path(__file__).parent / "results" / f"trainer_{'gpu' if torch.cuda.is_available() else 'cpu'}.md", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
