"""Rollout tokens/s of the two engines on the same model and prompts: `hf` (transformers) vs `vllm`.

    python benchmarks/bench_engines.py [--models tiny 512x8] [--prompts 128] [--max-new-tokens 48] [--max-running 32 64]

Each engine is driven through the rollout-engine interface exactly as a RolloutWorker drives it
(start every trajectory, then step until idle), outside Ray so only the engine is timed. Models:
`tiny` is the quickstart's warm-started tiny Llama (builtin:tiny-llama on builtin:repeat, 0.6M
parameters); `HxL` is a randomly initialised Llama of hidden size H and L layers with the same
tokenizer (built in a temp dir; random weights rarely emit eos, so completions run to the limit).
Prompts: the first --prompts rows of builtin:repeat; sampling at temperature 1, one CPU thread per
engine. Start-up
(model load, vLLM's engine-core process) is reported separately and not counted in tokens/s; each
figure is the best of --repeat rounds. Prints a table and writes benchmarks/results/engines.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

from results_table import publish_table

RESULTS = Path(__file__).parent / "results" / "engines.md"


def make_engine(name: str, model_dir: str, max_running: int, max_new_tokens: int):
    from rlflow import registry

    kwargs = dict(max_running=max_running, max_new_tokens=max_new_tokens, temperature=1.0, seed=0, max_model_len=128)
    return registry.resolve("engine", name)(model_dir, **kwargs)


def model_for(spec: str, tiny_dir: Path, tmp: Path) -> tuple[str, int]:
    """(directory, parameter count) of `tiny` or a random `HxL` Llama sharing the tiny model's tokenizer."""
    import torch
    import transformers

    if spec == "tiny":
        model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir)
        return str(tiny_dir), sum(p.numel() for p in model.parameters())
    try:
        hidden, layers = (int(x) for x in spec.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--models: {spec!r} is neither 'tiny' nor HxL (e.g. 512x8)") from None
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "512x8"], help="tiny, or HxL for a random Llama")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--max-running", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--engines", nargs="+", default=["hf", "vllm"])
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)  # PLATFORM-NOTES: one thread per process
    from transformers import AutoTokenizer

    from rlflow.stages import tasks
    from rlflow.stages.tiny_model import build_tiny_llama

    tiny_dir = build_tiny_llama("repeat", progress=lambda line: print(line, flush=True))
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in tasks.repeat(0, args.prompts)]

    rows = []  # (model, params, engine, max_running, startup s, tokens, tok/s)
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            model_dir, params = model_for(model, tiny_dir, Path(tmp))
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
                    rows.append((model, params, name, cap, startup, best[0], best[0] / best[1]))
                    print(f"{model} {name:5s} max_running {cap:3d}: start-up {startup:5.1f} s, {best[0]} tokens in "
                          f"{best[1]:.2f} s = {best[0] / best[1]:7.0f} tok/s", flush=True)
                    if hasattr(engine, "close"):
                        engine.close()
                    del engine

    base = {(model, cap): tps for model, _, name, cap, _, _, tps in rows if name == args.engines[0]}
    lines = [
        "# Rollout engines: tokens/s on the same model and prompts\n",
        f"`python benchmarks/bench_engines.py --models {' '.join(args.models)} --prompts {args.prompts} --max-new-tokens {args.max_new_tokens} "
        f"--max-running {' '.join(map(str, args.max_running))} --repeat {args.repeat}`  ",
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, "
        f"torch {torch.__version__}; one CPU thread per engine; prompts from builtin:repeat, "
        f"temperature 1, {args.prompts} prompts x 1 sample, at most {args.max_new_tokens} new tokens.\n",
        f"| model | params | engine | max_running | start-up (s) | completion tokens | tokens/s | vs {args.engines[0]} |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for model, params, name, cap, startup, tokens, tps in rows:
        ratio = tps / base[(model, cap)] if (model, cap) in base else float("nan")
        lines.append(f"| {model} | {params / 1e6:.1f}M | {name} | {cap} | {startup:.1f} | {tokens} | {tps:.0f} | {ratio:.2f}x |")
    publish_table(RESULTS, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
