"""A point-to-point link for weights between two Ray actors: a two-member torch.distributed process group.

The `collective` weight transport (parameter_server.py) moves buckets over these links instead of the object
store: the trainer's rank 0 sends each version once to the parameter server, which relays it to each
rollout instance when that instance pulls (Laminar, "relay workers" §4.2: the trainer hands a version off
once and goes on training; instances pull from the relay whenever the sync strategy says). Gloo carries CPU
tensors (on CPU, or staged through host memory on GPU); a link is a pair so that instances can come and go
(elastic stages, a dead instance) without rebuilding a group, and so that each instance pulls when its
own sync command says, as StaleFlow's parameter server allows (§5.1).

Set-up handshake: the side that opens the link hosts a TCPStore on a free port, asks the peer (an actor
method that joins as rank 0, running on a thread of its own) to join, and joins as rank 1 itself, or has
another process join as rank 1 in its place (a vLLM worker, through collective_rpc: stages/engine_vllm_weights.py);
both block until the other is there, bounded by LINK_TIMEOUT.

Backends: gloo (CPU tensors; on CPU machines, and wherever an end holds weights in host memory) or nccl (CUDA
tensors, both ends on GPUs of their own: NCCL refuses two ranks on one device, where CUDA IPC is the way).
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import torch

#: longest one send or receive of a bucket (or the handshake) may wait for the other side
LINK_TIMEOUT = timedelta(seconds=120)


class Link:
    """One end of a two-member gloo or NCCL group: send and receive whole buffers to and from the other end."""

    def __init__(self, group, rank: int, key: str, device: torch.device | str = "cpu"):
        self.group, self.rank, self.key, self.device = group, rank, key, torch.device(device)
        self._buffers = [torch.empty(0, dtype=torch.uint8, device=self.device) for _ in range(2)]

    def staging(self, nbytes: int, which: int = 0) -> torch.Tensor:
        """A buffer of `nbytes` kept for the link's life (two: `which` 0 or 1, so one can be filled while the other
        is sent): a fresh one per version would fault its pages in again (about as costly as the copy itself on a
        fresh VM)."""
        if self._buffers[which].numel() < nbytes:
            self._buffers[which] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._buffers[which][:nbytes]

    @property
    def peer(self) -> int:
        return 1 - self.rank

    def send(self, t: torch.Tensor) -> None:
        self.group.send([t], self.peer, 0).wait()

    def send_async(self, t: torch.Tensor):
        """Start sending `t` (left untouched until the returned work's `wait()`)."""
        return self.group.send([t], self.peer, 0)

    def recv_async(self, t: torch.Tensor):
        """Start receiving into `t`; complete at the returned work's `wait()`."""
        return self.group.recv([t], self.peer, 0)

    def recv(self, t: torch.Tensor) -> None:
        """Receive into `t` (a contiguous tensor on the link's device, of the size the sender sends)."""
        self.group.recv([t], self.peer, 0).wait()

    def close(self) -> None:
        try:
            self.group.shutdown()
        except Exception:  # noqa: BLE001 -- a link whose peer died may fail to shut down; it is dropped either way
            pass


BACKENDS = ("gloo", "nccl")


def join(address: tuple[str, int], rank: int, key: str, store=None, *, backend: str = "gloo", device=None) -> Link:
    """Join link `key`, whose rendezvous store is at `address`, as `rank` over `backend` (nccl: on `device`)."""
    from torch.distributed import PrefixStore, TCPStore

    if backend not in BACKENDS:
        raise ValueError(f"link backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    host, port = address
    if store is None:
        store = TCPStore(host, port, 2, False, timeout=LINK_TIMEOUT)
    if backend == "nccl":
        from torch.distributed import ProcessGroupNCCL

        device = torch.device(device if device is not None else "cuda")
        torch.cuda.set_device(device)
        options = ProcessGroupNCCL.Options()
        options._timeout = LINK_TIMEOUT
        return Link(ProcessGroupNCCL(PrefixStore(key, store), rank, 2, options), rank, key, device)
    from torch.distributed import ProcessGroupGloo

    options = ProcessGroupGloo._Options()
    options._timeout = LINK_TIMEOUT
    options._devices = [ProcessGroupGloo.create_device(hostname=host)]
    return Link(ProcessGroupGloo(PrefixStore(key, store), rank, 2, options), rank, key)


def accept(address: tuple[str, int], key: str, backend: str = "gloo", device=None) -> Link:
    """The peer's side of `open_link`: join the link `key` as rank 0 (call from a thread that may block)."""
    return join(address, 0, key, backend=backend, device=device)


class Hosted:
    """The opening side's record of a link that another process joined in its place (`open_link(join_here=...)`): its key,
    and the rendezvous store, which lives as long as the link."""

    def __init__(self, key: str, store):
        self.key, self._store = key, store


def open_link(peer, method: str = "connect", *, join_here=None) -> Link | Hosted:
    """Open a link to actor `peer`: host the rendezvous here, have `peer.<method>(key, address)` join it as
    rank 0, and join as rank 1 here, or, given `join_here(key, address)`, have that join as rank 1 (another
    process: it returns once joined) and return a `Hosted`. The key is new per call, so a process that opens
    several links keeps them apart."""
    import ray
    from torch.distributed import TCPStore

    host = ray.util.get_node_ip_address()
    store = TCPStore(host, 0, 2, True, timeout=LINK_TIMEOUT, wait_for_workers=False)
    key = f"link-{uuid.uuid4().hex[:12]}"
    ref = getattr(peer, method).remote(key, (host, store.port))
    if join_here is not None:
        join_here(key, (host, store.port))
        ray.get(ref, timeout=LINK_TIMEOUT.total_seconds())
        return Hosted(key, store)
    link = join((host, store.port), 1, key, store=store)
    ray.get(ref, timeout=LINK_TIMEOUT.total_seconds())
    link._store = store  # the rendezvous store lives as long as the link
    return link
