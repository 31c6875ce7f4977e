"""Scaling on this machine: trainer throughput with 1 vs 2 ranks, rollout throughput with 1 vs 2 instances.

    python benchmarks/bench_scaling.py [--model 256x4] [--batch 64] [--steps 4] [--prompts 96] [--max-new-tokens 32]

Both sides run as `rlflow run` runs them, on a local Ray cluster: the trainer is launch_trainer's
TrainerWorker ranks (one DeepSpeed process group over gloo, ZeRO-1, the batch split by tokens,
stages/batch_shards.py), fed from a real PayloadStore; the rollout side is RolloutWorker actors
(engine `hf`) driven through their step() protocol until idle, the prompts split evenly between them.
Each rank or instance gets one CPU and one thread. The model is a randomly initialised Llama of
hidden size H and L layers with the tiny model's tokenizer (bench_engines.model_for), so the work is
large enough for the split to matter. Trainer batches have long-tailed completion lengths (lognormal,
capped at --max-new-tokens x 4). Prints a table of ratios against the 1-rank / 1-instance baseline
and writes benchmarks/results/scaling.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from results_table import publish_table

RESULTS = Path(__file__).parent / "results" / "scaling.md"
DEEPSPEED = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0, "zero_optimization": {"stage": 1},
             "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}, "steps_per_print": 10**6}
TRAINER = dict(lr=1e-5, clip_low=0.2, clip_high=0.28, loss_agg="token", kl_coef=0.0, max_importance_ratio=5.0)


def bench_trainer(ray, model_dir: str, world: int, batches: list[list[dict]]) -> tuple[float, int]:
    """Mean seconds per step over batches[1:] (batches[0] warms up) and completion tokens per step."""
    from ray.util.placement_group import remove_placement_group

    from rlflow.runtime.parameter_server import ParameterServer
    from rlflow.runtime.payload_store import PayloadStore
    from rlflow.runtime.trainer_worker import launch_trainer

    store, params = PayloadStore.remote(), ParameterServer.remote()
    leader, placement = launch_trainer(model_dir, DEEPSPEED, TRAINER, store, params, world_size=world,
                                       options={"num_cpus": 1, "num_gpus": 0}, source="bench", stage="train")
    try:
        ray.get(leader.ready.remote(), timeout=600)
        times = []
        for v, rows in enumerate(batches):
            ray.get(store.put.remote(rows))
            ids = [f"{r['group_id']}/{r['index']}" for r in rows]
            t0 = time.perf_counter()
            ray.get(leader.train.remote(ids, {i: r["reward"] for i, r in zip(ids, rows)}, 8, v), timeout=600)
            times.append(time.perf_counter() - t0)
        tokens = sum(len(r["completion_ids"]) for r in batches[-1])
        return sum(times[1:]) / len(times[1:]), tokens
    finally:
        for h in (leader, store, params):
            ray.kill(h)
        remove_placement_group(placement)


def bench_rollout(ray, model_dir: str, instances: int, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, int]:
    """Seconds for `instances` RolloutWorkers to generate one completion per prompt, and the tokens generated."""
    from rlflow.runtime.payload_store import PayloadStore
    from rlflow.runtime.rollout_worker import RolloutWorker
    from rlflow.stages.trajectory import Trajectory

    store = PayloadStore.remote()
    kwargs = dict(max_running=64, max_new_tokens=max_new_tokens, temperature=1.0, seed=0, max_model_len=256)
    workers = [RolloutWorker.options(num_cpus=1).remote("hf", model_dir, i, kwargs, store) for i in range(instances)]
    try:
        ray.get([w.ready.remote() for w in workers], timeout=600)
        shares = [[Trajectory(group_id=f"p{k}", index=0, prompt="", answer="", prompt_ids=p)
                   for k, p in enumerate(prompts) if k % instances == i] for i in range(instances)]
        t0 = time.perf_counter()
        pending = {w.step.remote(share, [], [], None): w for w, share in zip(workers, shares)}
        tokens = 0
        while pending:
            (ref,), _ = ray.wait(list(pending), num_returns=1, timeout=600)
            w = pending.pop(ref)
            out = ray.get(ref)
            tokens += sum(f.tokens for f in out.finished)
            if not out.idle:
                pending[w.step.remote([], [], [], None)] = w
        return time.perf_counter() - t0, tokens
    finally:
        for h in (*workers, store):
            ray.kill(h)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="256x4", help="HxL: a random Llama of hidden size H and L layers")
    ap.add_argument("--batch", type=int, default=64, help="trajectories per training step")
    ap.add_argument("--steps", type=int, default=4, help="timed training steps (after one warm-up step)")
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args(argv)

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(Path(__file__).parent))
    import ray
    import torch
    from bench_engines import model_for
    from bench_trainer import trainer_batch
    from transformers import AutoTokenizer

    from rlflow.stages import tasks
    from rlflow.stages.tiny_model import build_tiny_llama

    torch.set_num_threads(1)
    tiny_dir = build_tiny_llama("repeat", progress=lambda line: print(line, flush=True))
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in tasks.repeat(0, args.prompts)]
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    rows = []  # (side, n, seconds, tokens, tokens/s)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir, n_params = model_for(args.model, Path(tiny_dir), Path(tmp))
            vocab = tokenizer.vocab_size
            batches = [trainer_batch(prompts, args.batch, args.max_new_tokens * 4, vocab, s) for s in range(args.steps + 1)]
            for world in (1, 2):
                seconds, tokens = bench_trainer(ray, model_dir, world, batches)
                rows.append(("trainer", world, seconds, tokens, tokens / seconds))
                print(f"trainer {world} rank(s): {seconds:.2f} s/step, {tokens / seconds:.0f} completion tok/s", flush=True)
            for n in (1, 2):
                seconds, tokens = bench_rollout(ray, model_dir, n, prompts, args.max_new_tokens)
                rows.append(("rollout", n, seconds, tokens, tokens / seconds))
                print(f"rollout {n} instance(s): {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.0f} tok/s", flush=True)
    finally:
        ray.shutdown()

    base = {side: tps for side, n, _, _, tps in rows if n == 1}
    lines = [
        "# Scaling: trainer ranks and rollout instances on this machine\n",
        f"`python benchmarks/bench_scaling.py --model {args.model} --batch {args.batch} --steps {args.steps} "
        f"--prompts {args.prompts} --max-new-tokens {args.max_new_tokens}`  ",
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, "
        f"torch {torch.__version__}; model {args.model} ({n_params / 1e6:.1f}M params, fp32), one CPU and one thread "
        "per rank or instance.\n",
        "| side | ranks / instances | seconds | completion tokens | tokens/s | vs 1 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for side, n, seconds, tokens, tps in rows:
        what = "s/step" if side == "trainer" else "s"
        lines.append(f"| {side} | {n} | {seconds:.2f} {what} | {tokens} | {tps:.0f} | {tps / base[side]:.2f}x |")
    publish_table(RESULTS, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
