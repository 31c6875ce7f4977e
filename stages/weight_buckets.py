"""Weights in buckets: how a version leaves the trainer, a few hundred MB at a time, in the training dtype.

A version is a list of buckets; a bucket is a run of consecutive state-dict tensors (module order, so a
bucket is a few layers) whose bytes sum to about `bucket_bytes`. Its `BucketLayout` (names, dtypes, shapes,
byte offsets) travels ahead of the data, so a receiver can allocate, unpack and check without asking.

Nothing here holds the whole model in one copy: `module_buckets` gathers (ZeRO-3) and yields one bucket's
tensors at a time, as the trainer holds them (bf16 stays bf16: no fp32 conversion), and the tensors are
valid only until the next bucket is asked for. The same layout serves every transport (rlflow/runtime/
parameter_server.py): the object store puts one bucket per object; the collective link sends one packed buffer
per bucket.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

#: default bucket size: large enough that per-bucket overheads vanish, small enough to bound the extra memory
BUCKET_BYTES = 256 * 2**20
_ALIGN = 64  # byte offset of every tensor in a packed bucket: any dtype's view (and the checksum's int64 words) fits


@dataclass(frozen=True)
class Slot:
    """One tensor of a bucket: its state-dict name, dtype ("bfloat16"), shape, and place in the packed buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BucketLayout:
    """The tensors of one bucket, in order, and the size of its packed buffer."""

    slots: tuple[Slot, ...]
    nbytes: int

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.slots]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plan_buckets(entries: Iterable[tuple[str, tuple[int, ...], torch.dtype]], bucket_bytes: int = BUCKET_BYTES) -> list[BucketLayout]:
    """Cut (name, shape, dtype) entries, in order, into buckets of at most `bucket_bytes` (a larger tensor gets
    a bucket of its own)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets, slots, offset = [], [], 0
    for name, shape, dtype in entries:
        nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        if slots and offset + nbytes > bucket_bytes:
            buckets.append(BucketLayout(tuple(slots), offset))
            slots, offset = [], 0
        slots.append(Slot(name, dtype_name(dtype), tuple(int(d) for d in shape), offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    if slots:
        buckets.append(BucketLayout(tuple(slots), offset))
    return buckets


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def pack(layout: BucketLayout, tensors: Iterable[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """The bucket's tensors copied into one flat uint8 buffer (`out`, or a new one on the first tensor's
    device); the one copy a collective send needs."""
    tensors = list(tensors)
    if out is None:
        out = torch.empty(layout.nbytes, dtype=torch.uint8, device=tensors[0].device if tensors else "cpu")
    for slot, t in zip(layout.slots, tensors, strict=True):
        out[slot.offset : slot.offset + slot.nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return out


def unpack(layout: BucketLayout, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """name -> tensor views into a packed buffer (no copy; valid while `flat` is)."""
    return {s.name: flat[s.offset : s.offset + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape) for s in layout.slots}


def as_bytes(t: torch.Tensor):
    """A CPU tensor's bytes as a flat numpy uint8 view (bf16 has no numpy dtype; its bytes do)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def from_bytes(slot: Slot, data) -> torch.Tensor:
    """The tensor a slot describes, viewing numpy uint8 bytes (`as_bytes`) without a copy."""
    return as_tensor(data).view(getattr(torch, slot.dtype)).view(slot.shape)


def stored_bucket(layout: BucketLayout, stored) -> dict[str, torch.Tensor]:
    """A bucket as the object store holds it (one `as_bytes` array per tensor, in layout order) as name -> tensor
    views (no copy; valid while `stored` is)."""
    return {slot.name: from_bytes(slot, data) for slot, data in zip(layout.slots, stored, strict=True)}


def as_tensor(value) -> torch.Tensor:
    """A bucket's value as a torch tensor: a tensor as it is, a numpy array (also a read-only zero-copy view from the
    object store, which readers only read) without a copy unless it is not C-contiguous."""
    if isinstance(value, torch.Tensor):
        return value
    import warnings

    import numpy as np

    array = np.asarray(value)
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns about read-only arrays
        return torch.from_numpy(array)


def state_buckets(state: Mapping[str, torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> Iterator[tuple[BucketLayout, list[torch.Tensor]]]:
    """A plain name -> tensor state (tests, benchmarks, a model outside DeepSpeed) as buckets."""
    layouts = plan_buckets(((n, tuple(t.shape), t.dtype) for n, t in state.items()), bucket_bytes)
    for layout in layouts:
        yield layout, [state[n] for n in layout.names]


def module_layouts(module: torch.nn.Module, bucket_bytes: int = BUCKET_BYTES, *, keep=None) -> list[BucketLayout]:
    """The buckets of a module's state dict, in module order; under ZeRO-3 from the full (`ds_shape`) shapes.
    keep: name -> whether the tensor is published (None: all; LoRA publishes its adapters alone, stages/lora.py)."""
    return plan_buckets(((n, tuple(getattr(t, "ds_shape", t.shape)), t.dtype)
                         for n, t in module.state_dict(keep_vars=True).items() if keep is None or keep(n)), bucket_bytes)


def module_buckets(module: torch.nn.Module, bucket_bytes: int = BUCKET_BYTES, *, gather: bool = False, keep=None
                   ) -> Iterator[tuple[BucketLayout, list[torch.Tensor]]]:
    """The module's state dict as (layout, tensors) a bucket at a time, tensors as the module holds them (its
    device, its dtype). gather: ZeRO-3, where every rank must iterate in step (each bucket's parameters are
    gathered on entry and released when the next bucket is asked for). Tied weights appear under each name. keep: as
    `module_layouts`'s."""
    entries = module.state_dict(keep_vars=True)
    for layout in module_layouts(module, bucket_bytes, keep=keep):
        tensors = [entries[n] for n in layout.names]
        sharded = list({id(t): t for t in tensors if hasattr(t, "ds_id")}.values())
        ctx = contextlib.nullcontext()
        if gather and sharded:
            import deepspeed

            ctx = deepspeed.zero.GatheredParameters(sharded, modifier_rank=None)
        with ctx, torch.no_grad():
            yield layout, [t.detach() for t in tensors]
