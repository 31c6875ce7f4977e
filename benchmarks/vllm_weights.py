"""bench_scale.py's vLLM rows: one weight version from a trainer actor into a vLLM engine in a rollout actor.

Three paths, each verified (the checksum of what the engine loaded is the trainer's), best of `repeat`:
- before: the file reload rlflow had (each bucket from the object store written as a safetensors shard into
  /dev/shm, then vLLM's `reload_weights` on the directory), re-created here as it was, for the ratio;
- object_store: vLLM's workers read the buckets from Ray's object store themselves (zero-copy on one node), their
  references lent by the parameter server, and load them in memory as they come (stages/engine_vllm.py
  load_from_store);
- collective: the workers themselves receive the buckets over a gloo link from the parameter server's relay
  (stages/engine_vllm_weights.py, runtime/parameter_server.py pull_into).

The model is fp32 (vLLM's fast dtype on CPU; bf16 with --device cuda, the engine then on the GPU) with random
weights in the Qwen2 shapes of bench_scale.py.
"""

from __future__ import annotations

import time
from pathlib import Path


def instance_actor():
    import ray

    @ray.remote(num_cpus=0)
    class VLLMInstance:
        """A rollout instance's vLLM engine and the three ways a version reaches it."""

        def __init__(self, model_dir: str, dtype: str):
            import torch

            from rlflow.stages.engine_vllm import VLLMEngine

            torch.set_num_threads(1)
            self.engine = VLLMEngine(model_dir, max_running=4, max_new_tokens=8, max_model_len=128, dtype=dtype,
                                     gpu_memory_utilization=0.4, enforce_eager=True)

        def pull(self, published) -> tuple[str, float, dict]:
            from rlflow.runtime.parameter_server import pull_into

            t0 = time.perf_counter()
            loaded = pull_into(self.engine, published, published.version)
            return loaded.checksum, time.perf_counter() - t0, dict(self.engine.last_transfer)

        def pull_before(self, published) -> tuple[str, float, dict]:
            """The file reload this replaced: safetensors shards in /dev/shm, then reload_weights (checksummed, as it
            was, from what was handed to the reload)."""
            import tempfile

            from safetensors.torch import save_file

            from rlflow.runtime.parameter_server import fetch_buckets
            from rlflow.stages.checksum import Checksum

            t0 = time.perf_counter()
            total, write_s = Checksum(), 0.0
            with tempfile.TemporaryDirectory(prefix="rlflow-bench-vllm-", dir="/dev/shm") as d:
                for k, bucket in enumerate(fetch_buckets(published)):
                    t1 = time.perf_counter()
                    handed = {n: t for n, t in bucket.items() if n in self.engine._shapes}  # a tied lm_head is not
                    for name, t in bucket.items():
                        total.add(name, t)
                    save_file({n: t.contiguous() for n, t in handed.items()}, f"{d}/model-{k:05d}.safetensors")
                    write_s += time.perf_counter() - t1
                t2 = time.perf_counter()
                self.engine._call(self._reload(d))
                reload_s = time.perf_counter() - t2
            return total.hexdigest(), time.perf_counter() - t0, {"write_s": write_s, "reload_s": reload_s}

        async def _reload(self, d: str) -> None:
            llm = self.engine.llm
            await llm.pause_generation(mode="keep", clear_cache=False)
            try:
                await llm.collective_rpc("reload_weights", kwargs={"weights_path": d})
                await llm.reset_prefix_cache(reset_running_requests=True)
            finally:
                await llm.resume_generation()

        def close(self) -> None:
            self.engine.close()

    return VLLMInstance


def save_model(size: str, out: Path, build_model, dtype: str) -> Path:
    """The model as a Hugging Face directory vLLM loads, with the tiny model's tokenizer (vLLM needs one; only its
    decode is used here)."""
    import shutil

    from rlflow.stages.tiny_model import build_tiny_llama

    if not (out / "config.json").exists():
        build_model(size, dtype).save_pretrained(out)
        for f in Path(build_tiny_llama("repeat", progress=lambda line: None)).glob("tokenizer*"):
            shutil.copy(f, out)
    return out


def measure(size: str, repeat: int, tmp: Path, trainer_cls, build_model, dtype: str = "float32") -> list[dict]:
    """Rows for one size: publish and pull seconds per path, and what the pull spent where."""
    import ray

    from rlflow.runtime.parameter_server import ParameterServer

    model_dir = save_model(size, tmp / f"vllm-{size}", build_model, dtype)
    trainer = trainer_cls.remote(size, dtype)
    opts = {"num_gpus": 0.5} if dtype == "bfloat16" else {}  # on a GPU host: the engine on the GPU
    instance = instance_actor().options(**opts).remote(str(model_dir), dtype)
    rows, version = [], 0
    for path in ("before", "object_store", "collective"):
        server = ParameterServer.remote()
        transport = "object_store" if path == "before" else path
        samples = []
        for _ in range(repeat):
            version += 1
            out = ray.get(trainer.publish.remote(server, version, transport))
            published = ray.get(server.latest.remote())
            pull = instance.pull_before if path == "before" else instance.pull
            loaded, pull_s, parts = ray.get(pull.remote(published), timeout=1800)
            if loaded != out["checksum"]:
                raise AssertionError(f"{path}: vLLM loaded checksum {loaded}, the trainer published {out['checksum']}")
            samples.append({"path": path, "bytes": out["bytes"], "publish_s": out["sync_s"], "pull_s": pull_s,
                            "total_s": out["sync_s"] + pull_s, "buckets": out["buckets"], "parts": parts})
            del published
        rows.append(min(samples, key=lambda r: r["total_s"]))
        ray.kill(server)
    ray.get(instance.close.remote())
    for actor in (trainer, instance):
        ray.kill(actor)
    return rows


LABELS = {"before": "before: safetensors in /dev/shm + reload_weights",
          "object_store": "object_store: vLLM's workers read Ray's store, loaded in memory",
          "collective": "collective: gloo link into vLLM's worker, loaded in memory"}


def table(size: str, rows: list[dict], step_s: float | None = None, source: str | None = None) -> list[str]:
    """The rows as markdown; with a train step's seconds at this size (`step_s`, measured in `source`), each path's
    seconds per version as a share of a step (a synchronous run waits that long for its weights each step)."""
    before = next(r for r in rows if r["path"] == "before")
    share = step_s is not None
    lines = [f"\n### vLLM, {size}: {rows[0]['bytes'] / 2**30:.2f} GiB of weights per version (tied lm_head sent "
             "once more), verified by checksum\n",
             "| path | buckets | publish s | pull s | publish + pull s | vs before |"
             + (" share of a step |" if share else "") + " in the pull |",
             "|---|---:|---:|---:|---:|---:|" + ("---:|" if share else "") + "---|"]
    for r in rows:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in r["parts"].items() if k.endswith("_s"))
        lines.append(f"| {LABELS[r['path']]} | {r['buckets']} | {r['publish_s']:.2f} | {r['pull_s']:.2f} | "
                     f"{r['total_s']:.2f} | {before['total_s'] / r['total_s']:.2f}x | "
                     + (f"{r['total_s'] / step_s:.1%} | " if share else "") + f"{parts} |")
    if share:
        lines.append(f"\nShare of a step: publish + pull over one {size} train step, {step_s:.2f} s (packed, "
                     f"activation checkpointing off; {source}).")
    return lines
