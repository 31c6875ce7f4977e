"""Weights to rollout: publish and pull time per MB next to this machine's memcpy bandwidth.

    python benchmarks/bench_weight_sync.py [--states tiny 135m] [--repeat 3]

States: `tiny` is the quickstart's tiny Llama; `135m` a randomly initialised Llama shaped like
SmolLM2-135M (hidden 576, 30 layers, tied embeddings; fp32). The trainer's side runs in this process,
the rollout side in a Ray actor holding a real HFEngine, as in a run. Steps:

- memcpy: np.copyto of one buffer the size of the state (the baseline every ratio is against);
- publish: weight_sync.publish of zero-copy views of the model's tensors (one ray.put, the checksum of
  the stored copy, the push), and its two parts;
- pull: ray.get in the rollout actor (zero-copy views), HFEngine.load_weights (copy into the parameters
  plus the read-back checksum), the copy alone, and get + load together (the goal: >= 50% of memcpy);
- before: the old publish (a numpy copy of every tensor, then ray.put), torch tensors through the store
  (no zero-copy: copied on get), and vLLM's hand-off (safetensors written to /dev/shm; its reload not counted).

Best of --repeat rounds each. Prints a table and writes benchmarks/results/weight_sync.md.
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

RESULTS = Path(__file__).parent / "results" / "weight_sync.md"
SMOLLM2_135M = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True,
                "max_position_embeddings": 2048}


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def model_dir_for(spec: str, tiny_dir: Path, tmp: Path) -> Path:
    """The tiny model's directory, or a random SmolLM2-135M-shaped Llama saved beside its tokenizer."""
    if spec == "tiny":
        return tiny_dir
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(tiny_dir).to_dict() | SMOLLM2_135M
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    out = tmp / spec
    model.save_pretrained(out)
    for f in tiny_dir.glob("tokenizer*"):
        shutil.copy(f, out)
    return out


def rollout_actor():
    import ray

    @ray.remote(num_cpus=0)
    class Rollout:
        """The rollout side: an HFEngine, timed inside the actor like RolloutWorker.step's pull."""

        def __init__(self, model_dir: str):
            import torch

            torch.set_num_threads(1)
            from rlflow.stages.engine_hf import HFEngine

            self.engine = HFEngine(model_dir, max_model_len=128)
            self.version = 0

        def pull(self, wrapped: list, repeat: int) -> dict:
            import torch

            (ref,) = wrapped
            t = {"get": best(lambda: ray.get(ref), repeat)}
            state = ray.get(ref)
            assert not next(iter(state.values())).flags.writeable  # zero-copy views into the object store
            params = self.engine.model.state_dict()

            def copy_only():
                import warnings

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    for name, view in state.items():
                        params[name].copy_(torch.from_numpy(view))

            def load():
                self.version += 1
                self.loaded = self.engine.load_weights(state, self.version)

            t["copy"] = best(copy_only, repeat)
            t["load"] = best(load, repeat)

            def get_and_load():
                self.version += 1
                self.loaded = self.engine.load_weights(ray.get(ref), self.version)

            t["get+load"] = best(get_and_load, repeat)
            t["checksum"] = self.loaded["checksum"]
            state = None  # drop the views before the next version is put
            return t

        def get_torch(self, wrapped: list, repeat: int) -> float:
            return best(lambda: ray.get(wrapped[0]), repeat)

    return Rollout


def measure(spec: str, model_dir: Path, repeat: int) -> list[tuple[str, float, int]]:
    """[(step, seconds, bytes)] for one state."""
    import numpy as np
    import ray
    import transformers

    from rlflow.runtime.weight_sync import ParameterServer, publish, state_views
    from rlflow.stages.checksum import checksum

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    tensors = model.state_dict()
    views = state_views(tensors)
    nbytes = sum(a.nbytes for a in views.values())
    rows = []

    src = np.random.default_rng(0).standard_normal(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    rows.append(("memcpy (np.copyto, one buffer)", best(lambda: np.copyto(dst, src), repeat), nbytes))
    src = dst = None  # free 2 x the state before the object store fills

    server = ParameterServer.remote()
    version = iter(range(1, 1000))
    out = {}

    def do_publish():
        out.update(publish(server, next(version), views))

    rows.append(("publish: weight_sync.publish (put + checksum + push)", best(do_publish, repeat), nbytes))
    rows.append(("  of which ray.put of zero-copy views", out["put_s"], nbytes))
    rows.append(("  of which checksum of the stored copy", out["checksum_s"], nbytes))
    assert out["checksum"] == checksum(tensors)
    ref = ray.get(server.latest.remote()).ref

    actor = rollout_actor().remote(str(model_dir))
    t = ray.get(actor.pull.remote(ref, repeat))
    assert t["checksum"] == out["checksum"], "the engine's read-back checksum differs from the published one"
    rows.append(("pull: ray.get in the rollout actor (zero-copy)", t["get"], nbytes))
    rows.append(("pull: copy into hf params (copy_ only)", t["copy"], nbytes))
    rows.append(("pull: HFEngine.load_weights (copy + read-back checksum)", t["load"], nbytes))
    rows.append(("pull: ray.get + load_weights (what a pull costs)", t["get+load"], nbytes))
    del ref

    def old_publish():  # state_numpy(): a contiguous numpy copy of every tensor, then ray.put copies again
        ray.put({k: v.detach().cpu().numpy().copy(order="C") for k, v in tensors.items()})

    rows.append(("before: publish = numpy copy + ray.put", best(old_publish, repeat), nbytes))
    torch_ref = ray.put({k: v.detach().clone() for k, v in tensors.items()})
    rows.append(("before: torch tensors, ray.get (copied, no zero-copy)", ray.get(actor.get_torch.remote([torch_ref], repeat)), nbytes))
    del torch_ref

    def shm_handoff():
        from safetensors.numpy import save_file

        with tempfile.TemporaryDirectory(dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None) as d:
            save_file({k: v for k, v in views.items() if k != "lm_head.weight" or not model.config.tie_word_embeddings},
                      os.path.join(d, "model.safetensors"))

    rows.append(("before: vLLM hand-off, safetensors to /dev/shm", best(shm_handoff, repeat), nbytes))
    ray.kill(actor)
    ray.kill(server)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--states", nargs="+", default=["tiny", "135m"], choices=["tiny", "135m"])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import ray
    import torch

    torch.set_num_threads(1)  # PLATFORM-NOTES: one thread per process
    from rlflow.stages.tiny_model import build_tiny_llama

    tiny_dir = build_tiny_llama("repeat", progress=lambda line: print(line, flush=True))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}})
    tables = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for spec in args.states:
                repeat = args.repeat if spec != "tiny" else max(args.repeat, 20)  # milliseconds: more rounds
                rows = measure(spec, model_dir_for(spec, tiny_dir, Path(tmp)), repeat)
                tables.append((spec, rows))
                print(f"{spec}: done", flush=True)
    finally:
        ray.shutdown()

    lines = [
        "# Weights to rollout: publish and pull against memcpy\n",
        f"`python benchmarks/bench_weight_sync.py --states {' '.join(args.states)} --repeat {args.repeat}`  ",
        (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, "
         f"torch {torch.__version__}, ray {ray.__version__}; one thread per process; fp32; best of {args.repeat} rounds "
         "(20 for tiny). MB/s is the state's size over the step's seconds; vs memcpy is that over memcpy's MB/s.\n"),
    ]
    for spec, rows in tables:
        nbytes = rows[0][2]
        base = nbytes / rows[0][1]
        lines += [f"\n## {spec}: {nbytes / 2**20:.1f} MB\n", "| step | seconds | MB/s | vs memcpy |", "|---|---:|---:|---:|"]
        for step, seconds, n in rows:
            rate = n / seconds if seconds > 0 else float("inf")
            lines.append(f"| {step} | {seconds:.4f} | {rate / 2**20:.0f} | {rate / base:.2f}x |")
    table = "\n".join(lines) + "\n"
    print("\n" + table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(table)
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
