"""The weights checksum both ends of a pull compute: the trainer at publish, every engine after its load.

Exact and order-sensitive, yet near memory speed (it is paid twice on every pull). Per tensor, in name
order: the bytes as int64 words, in rows of 1,024, times a fixed vector of odd random int64s
(`torch.mv`, wrapping mod 2^64: exact, so any summation order gives the same result), then BLAKE2b over
the name, dtype, shape, that 1/1,024-sized product and the tail bytes. A changed word always changes its
row's product (its weight is odd); swapped words, rows or tensors change it with overwhelming
probability. Measured here (one thread, 256 MB): about 10 GB/s, against zlib.crc32's 3.5 GB/s and
memcpy's 13 GB/s (benchmarks/bench_weight_sync.py).

Equal bytes give equal checksums whatever holds them (numpy array, read-only object-store view, torch
tensor), so a checksum compares what was published with what an engine holds, not how it got there.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

_ROW = 1024  # int64 words per row of the product
_ROW_BYTES = 8 * _ROW
_WEIGHTS = np.random.default_rng(0x5EED).integers(-(2**62), 2**62, size=_ROW, dtype=np.int64) | 1  # fixed, odd
PREFIX = "b2m1:"  # names the scheme: a checksum computed differently never compares equal


def checksum(state: Mapping[str, Any]) -> str:
    """Checksum of name -> numpy array or torch tensor (any dtype, any device), over names in sorted order."""
    import torch

    weights = torch.from_numpy(_WEIGHTS)
    h = hashlib.blake2b(digest_size=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only numpy views (zero-copy from Ray): we only read
        for name in sorted(state):
            value = state[name]
            t = torch.from_numpy(np.ascontiguousarray(value)) if isinstance(value, (np.ndarray, np.generic)) else value.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{tuple(value.shape)}|".encode())
            _update(h, t, weights)
    return PREFIX + h.hexdigest()


def _update(h, t, weights) -> None:
    """Fold one tensor's bytes into `h`."""
    import torch

    raw = t.contiguous().reshape(-1).view(torch.uint8)
    main = raw.numel() - raw.numel() % _ROW_BYTES
    if main:
        try:
            words = raw[:main].view(torch.int64)
        except RuntimeError:  # storage offset not a multiple of 8 bytes (a slice of a bigger buffer)
            words = raw[:main].clone().view(torch.int64)
        h.update(torch.mv(words.view(-1, _ROW), weights).numpy().tobytes())
    h.update(raw[main:].numpy().tobytes())
