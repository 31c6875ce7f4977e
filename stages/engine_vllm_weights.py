"""Weights into vLLM's workers, in memory: the weight-transfer engine on the engine side.

The protocol is vLLM's own weight-transfer protocol (vllm.distributed.weight_transfer: init the transfer once;
per version start, update bucket by bucket, finish), written as methods vLLM mixes into every worker
(`worker_extension_cls`) and called through `collective_rpc`, so it runs in the process that holds the model:

- `rlflow_link_join(key, address, backend)`, once per relay: the worker joins a two-member torch.distributed
  group as rank 1 (rlflow/runtime/weight_link.py); gloo on CPU, NCCL on a GPU. Links are per relay, not one
  group over the whole fleet, so an instance that joins late or restarts opens its own link and nobody else
  stops (Laminar, "relay workers" §4.2; StaleFlow's per-instance pulls, §5.1).
- `rlflow_store_join(address, namespace)`, once per process: the worker connects to the Ray cluster (as vLLM's own
  Ray executor connects its engine process), to read a version's buckets from the object store itself.
- `rlflow_weights_start()`: vLLM's layerwise reload is set up (the kernel-format weights, oneDNN-packed on CPU
  and fused qkv/gate_up everywhere, are put back into checkpoint form as layers receive their tensors).
- `rlflow_weights_update(layouts=...)` receives the version's packed buckets over the link (`link_key`), or reads
  them from Ray's store (`loan`: the object-store backend; zero-copy on the same node, the references lent by the
  parameter server so they pass in-band), or takes one packed bucket handed in the call itself (`data`, carried by
  vLLM's IPC: a state dict handed to `load_weights` directly), or `ipc=...`, a CUDA IPC handle of
  one packed bucket on the same GPU (`cuda_ipc_handle`: trainer and engine sharing a GPU). Each bucket goes to
  the model's own `load_weights` as it arrives, and each tensor is checksummed here, from what arrived.
- `rlflow_weights_finish()`: the layerwise reload is finalised (each layer re-processed into kernel form), a
  tied lm_head re-packed on CPU; returns the checksum and the parameters the model did not report loading.

No weight file is written on any path. The backend is the only thing that differs between CPU and GPU.
"""

from __future__ import annotations

import logging
import time

from rlflow.stages.checksum import Checksum
from rlflow.stages.weight_buckets import BucketLayout, Slot, unpack

TIED_SOURCE = "model.embed_tokens.weight"  # what a tied lm_head is in Llama-style models


def layout_fields(layout: BucketLayout) -> list:
    """A BucketLayout as plain lists, which vLLM's IPC to its engine core carries (it refuses arbitrary objects)."""
    return [layout.nbytes, [[s.name, s.dtype, list(s.shape), s.offset, s.nbytes] for s in layout.slots]]


def cuda_ipc_handle(flat) -> tuple:
    """The sender's side of CUDA IPC: what another process on the same GPU needs to map the packed bucket `flat` (a
    CUDA uint8 tensor the sender keeps alive until the load returns): torch's own CUDA tensor sharing."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(flat)
    return tuple(args)


def layout_from_fields(fields: list) -> BucketLayout:
    nbytes, slots = fields
    return BucketLayout(tuple(Slot(n, d, tuple(shape), o, b) for n, d, shape, o, b in slots), nbytes)


class VLLMWorkerExtension:
    """Methods vLLM mixes into its GPU/CPU worker (`worker_extension_cls`), called with collective_rpc."""

    def rlflow_link_join(self, key: str, address: tuple[str, int], backend: str = "gloo") -> int:
        """Join link `key` (hosted at `address` by the rollout actor, the relay joining as rank 0) as rank 1.
        Returns the worker's process id (tests check the bytes land in the worker, not in the actor)."""
        import os

        from rlflow.runtime.weight_link import join

        links = self.__dict__.setdefault("_rlflow_links", {})
        device = None if backend == "gloo" else self.device
        links[key] = join(address, 1, key, backend=backend, device=device)
        return os.getpid()

    def rlflow_store_join(self, address: str, namespace: str) -> int:
        """Connect this worker's process to the Ray cluster at `address` (as vLLM's own Ray executor connects its
        engine process), so it reads a version's buckets from the object store itself: zero-copy views on the same
        node, the object manager's transfer from another. Once per process. Returns the worker's process id."""
        import os

        import ray

        if not ray.is_initialized():
            ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level=logging.ERROR,
                     configure_logging=False)
        return os.getpid()

    def rlflow_link_close(self, key: str) -> None:
        link = self.__dict__.get("_rlflow_links", {}).pop(key, None)
        if link is not None:
            link.close()

    def rlflow_device_free(self) -> int:
        """Free bytes of this worker's GPU (0 on CPU): what sleep frees is measured from it."""
        import torch

        return int(torch.cuda.mem_get_info()[0]) if torch.cuda.is_available() else 0

    def rlflow_weights_start(self) -> None:
        """Begin a version: vLLM's layerwise reload takes the checkpoint-format tensors that follow."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        # Rotary and other buffers are not in a checkpoint; the reloader warns about them on every pull.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        from vllm.config import set_current_vllm_config

        model = self.model_runner.get_model()
        self._rlflow_update = {"checksum": Checksum(), "reported": set(), "embed": None, "lm_head": None,
                               "recv_s": 0.0, "load_s": 0.0, "bytes": 0,
                               "tied": bool(getattr(model.config, "tie_word_embeddings", False))}
        with set_current_vllm_config(self.vllm_config):  # as vLLM's own reload_weights runs it
            initialize_layerwise_reload(model)

    def rlflow_weights_update(self, layouts: list[list] | None = None, link_key: str | None = None,
                              version: int | None = None, data: bytes | None = None, ipc: tuple | None = None,
                              loan: list | None = None) -> int:
        """One packed bucket handed in (`data`, its layout `layouts[0]`), or a version's buckets over link
        `link_key` (`layouts`): the relay first sends a header, the version it holds or -1 (no longer held), then
        the packed buckets; or (`loan`: [the parameter server's handle, pickled; a loan key]) the version's
        object-store buckets, whose references the server lends (`rlflow_store_join` first). Each bucket is
        checksummed and loaded as it arrives. Returns the bytes received."""
        import torch

        state = self._rlflow_update
        layouts = [layout_from_fields(f) for f in layouts]
        if loan is not None:
            return self._rlflow_load_loan(layouts, *loan)
        if data is not None:
            data = data if isinstance(data, bytearray) else bytearray(data)  # writable: torch views it, no warning
            self._rlflow_load(unpack(layouts[0], torch.frombuffer(data, dtype=torch.uint8)))
            return len(data)
        if ipc is not None:  # CUDA IPC: the sender's packed bucket, mapped here without a copy (same GPU)
            from torch.multiprocessing.reductions import rebuild_cuda_tensor

            args = list(ipc)
            args[6] = self.device.index if self.device.index is not None else torch.cuda.current_device()
            self._rlflow_load(unpack(layouts[0], rebuild_cuda_tensor(*args)))
            return layouts[0].nbytes
        link = self._rlflow_links[link_key]
        t0 = time.perf_counter()
        header = torch.empty(1, dtype=torch.int64, device=link.device)
        link.recv(header)
        if int(header.item()) != version:
            raise LookupError(f"the relay no longer holds weights version {version} (it answered {int(header.item())})")
        state["recv_s"] += time.perf_counter() - t0
        for layout, flat in _received(link, layouts, state):
            self._rlflow_load(unpack(layout, flat))
        return sum(lay.nbytes for lay in layouts)

    def _rlflow_load_loan(self, layouts: list[BucketLayout], server: bytes, key: str) -> int:
        """The object-store backend: each bucket read from Ray's store in this process (zero-copy on the same node)
        and loaded; the references come from the parameter server's loan `key`, in-band, so Ray counts them."""
        import ray

        from rlflow.runtime.weight_link import LINK_TIMEOUT
        from rlflow.stages.weight_buckets import stored_bucket

        timeout = LINK_TIMEOUT.total_seconds()
        refs = ray.get(ray.cloudpickle.loads(server).lent.remote(key), timeout=timeout)
        for layout, ref in zip(layouts, refs, strict=True):
            t0 = time.perf_counter()
            stored = ray.get(ref, timeout=timeout)
            self._rlflow_update["recv_s"] += time.perf_counter() - t0
            self._rlflow_load(stored_bucket(layout, stored))
            del stored
        return sum(lay.nbytes for lay in layouts)

    def _rlflow_load(self, bucket: dict) -> None:
        """Checksum a bucket's tensors as received, then hand them to the model's load_weights. A tied lm_head is
        not loaded (vLLM uses the embedding in its place) and is checksummed at finish as that embedding."""
        state = self._rlflow_update
        t0 = time.perf_counter()
        if state["tied"] and "lm_head.weight" in bucket:
            state["lm_head"] = bucket.pop("lm_head.weight").detach().cpu().clone()
        if state["tied"] and TIED_SOURCE in bucket:
            state["embed"] = bucket[TIED_SOURCE].detach().cpu().clone()
        for name, t in bucket.items():
            state["checksum"].add(name, t)
            state["bytes"] += t.numel() * t.element_size()
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            names = self.model_runner.get_model().load_weights(list(bucket.items()))
        state["reported"].update(names or ())
        state["load_s"] += time.perf_counter() - t0

    def rlflow_weights_finish(self) -> dict:
        """End a version: finalise the layerwise reload, re-pack a tied lm_head on CPU. Returns {"checksum" (of what
        arrived here), "missing" (parameters not reported loaded), "tied", "recv_s", "load_s", "bytes"}."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        from vllm.platforms import current_platform

        state = self._rlflow_update
        model = self.model_runner.get_model()
        t0 = time.perf_counter()
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(model, self.model_runner.model_config)
            if state["tied"] and current_platform.is_cpu():
                # PLATFORM-NOTES: with tied embeddings the reload updates embed_tokens but not the oneDNN handle
                # packed for lm_head, and log-probs drift by up to 0.9 unless it is re-packed.
                from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

                dispatch_cpu_unquantized_gemm(model.lm_head, remove_weight=False)
        if current_platform.is_cuda_alike():
            import torch

            torch.accelerator.synchronize()
        checksum = state["checksum"]
        if state["lm_head"] is not None:
            # a sent lm_head counts as the embedding vLLM uses for it (the one sent with this version, else the sent
            # lm_head itself): an lm_head that differs from the embedding fails the driver's comparison
            # (parameter_server.verify_loaded), as it would generate from other weights than the trainer's
            checksum.add("lm_head.weight", state["embed"] if state["embed"] is not None else state["lm_head"])
        expected = {name for name, _ in model.named_parameters()}
        self.__dict__.pop("_rlflow_update", None)
        return {"checksum": checksum.hexdigest(), "missing": sorted(expected - state["reported"]), "tied": state["tied"],
                "recv_s": state["recv_s"], "load_s": state["load_s"] + time.perf_counter() - t0, "bytes": state["bytes"]}


def _received(link, layouts: list[BucketLayout], state: dict):
    """The buckets of a version as they arrive over `link`, received one ahead on a thread of their own while the
    caller loads the one before (gloo and NCCL waits release the GIL), so receiving and loading overlap. A buffer per
    bucket, not one reused: vLLM's layerwise reload holds a layer's tensors until the layer is complete, which may
    be buckets later. Yields (layout, packed buffer)."""
    import queue
    import threading

    import torch

    ready: queue.Queue = queue.Queue(maxsize=1)

    def receive() -> None:
        try:
            for layout in layouts:
                flat = torch.empty(layout.nbytes, dtype=torch.uint8, device=link.device)
                t0 = time.perf_counter()
                link.recv(flat)
                state["recv_s"] += time.perf_counter() - t0
                ready.put((layout, flat))
        except BaseException as err:  # noqa: BLE001 -- handed to the loading side, which raises it
            ready.put(err)

    thread = threading.Thread(target=receive, name="rlflow-weights-recv", daemon=True)
    thread.start()
    for _ in layouts:
        item = ready.get()
        if isinstance(item, BaseException):
            raise item
        yield item
    thread.join()
