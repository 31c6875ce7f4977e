"""The model directory to every node through the object store, so a cluster needs no shared filesystem.

The driver puts each file of the model directory into the object store once (`ship_model`, one object per
file as a uint8 array: zero-copy on get, memory bounded by the largest file). An actor calls
`local_model_dir` at start: on its node the files are written once into a cache directory named by the
content hash (temp directory + rename, so a reader sees no copy or a whole one), and every later actor on
that node, in this run or the next, reuses it.

Always, also on one node: one code path, exercised by every run and test. The cost is a read, a hash and a
put on the driver and, once per node and model, a write: measured for a 537 MB directory, 2.5 s on the driver
and 0.7 s on the first actor of a node (the tiny model: well under 0.1 s each).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import ray

READ_CHUNK = 64 << 20  # bytes hashed at a time
_SHIPPED: dict[str, tuple[tuple, ShippedModel]] = {}  # driver: path -> (key, shipment), one per path


@dataclass(frozen=True)
class ShippedModel:
    """A model directory in the object store: what an actor on any node needs to rebuild it locally."""

    name: str  # the source directory's name (readable cache entries)
    digest: str  # sha256 over every file's relative path and content
    files: tuple  # ((relative path, size in bytes, ObjectRef of a uint8 array), ...)
    source: str  # the directory on the driver's node: for messages only, never read on a worker

    @property
    def size(self) -> int:
        return sum(size for _, size, _ in self.files)


def cache_root() -> Path:
    """Where a node keeps materialised models: $RLFLOW_CACHE/shipped, else ~/.cache/rlflow/shipped (per node)."""
    base = Path(os.environ["RLFLOW_CACHE"]) if os.environ.get("RLFLOW_CACHE") else Path.home() / ".cache" / "rlflow"
    return base / "shipped"


def _files(model_dir: Path) -> list[Path]:
    return sorted(p for p in model_dir.rglob("*") if p.is_file() and not p.name.startswith("."))


def ship_model(model_dir: str | Path) -> ShippedModel:
    """Put `model_dir`'s files into the object store (driver side). Shipped once per directory and Ray session:
    a second call with the files unchanged returns the same shipment (its objects live as long as it does)."""
    model_dir = Path(model_dir).resolve()
    files = _files(model_dir)
    ctx = ray.get_runtime_context()
    key = (ctx.get_job_id(), ctx.get_node_id(), tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files))
    cached = _SHIPPED.get(str(model_dir))
    if cached is not None and cached[0] == key:
        return cached[1]
    import numpy as np

    digest, shipped = hashlib.sha256(), []
    for path in files:
        rel = path.relative_to(model_dir).as_posix()
        data = np.fromfile(path, dtype=np.uint8)
        digest.update(rel.encode() + b"\0" + str(data.size).encode() + b"\0")
        view = memoryview(data)
        for start in range(0, data.size, READ_CHUNK):
            digest.update(view[start:start + READ_CHUNK])
        shipped.append((rel, int(data.size), ray.put(data)))
        del data, view
    shipment = ShippedModel(name=model_dir.name, digest=digest.hexdigest(), files=tuple(shipped), source=str(model_dir))
    _SHIPPED[str(model_dir)] = (key, shipment)
    return shipment


def local_model_dir(model: ShippedModel | str | Path, log=print) -> str:
    """The model as a directory on this node (actor side): a path is returned as is; a shipment is materialised
    into the node's cache (cache_root) unless a whole copy is already there."""
    if not isinstance(model, ShippedModel):
        return str(model)
    root = cache_root()
    final = root / f"{model.name}-{model.digest[:16]}"
    if final.is_dir():  # only whole copies are ever renamed into place
        log(f"model {model.name}: reusing {final} (node {ray.get_runtime_context().get_node_id()[:8]})")
        return str(final)
    t0 = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        for rel, size, ref in model.files:
            out = tmp / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            data = ray.get(ref)
            if data.size != size:
                raise RuntimeError(f"model file {rel} arrived with {data.size} bytes, not {size}")
            with open(out, "wb") as f:
                f.write(memoryview(data))
            del data
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the copy is for every process on the node
        try:
            os.rename(tmp, final)  # atomic: another actor sees no copy or a whole one
        except OSError:
            if not final.is_dir():
                raise
            log(f"model {model.name}: another actor on this node materialised {final} first; using it")
            return str(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"model {model.name}: materialised {len(model.files)} files ({model.size / 1e6:.1f} MB) from the object store "
        f"into {final} in {time.perf_counter() - t0:.2f} s (node {ray.get_runtime_context().get_node_id()[:8]})")
    return str(final)
