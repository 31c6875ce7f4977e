"""A point-to-point link for weights between two Ray actors: a two-member torch.distributed process group.

The `collective` weight transport (parameter_server.py) moves buckets over these links instead of the object
store: the trainer's rank 0 sends each version once to the parameter server, which relays it to each
rollout instance when that instance pulls (Laminar, "relay workers" §4.2: the trainer hands a version off
once and goes on training; instances pull from the relay whenever the sync strategy says). Gloo carries CPU
tensors (on CPU, or staged through host memory on GPU); a link is a pair so that instances can come and go
(elastic stages, a dead instance) without rebuilding a group, and so that each instance pulls when its
own sync command says, as StaleFlow's parameter server allows (§5.1).

Set-up handshake: the side that opens the link hosts a TCPStore on a free port, asks the peer (an actor
method that joins as rank 0, running on a thread of its own) to join, and joins as rank 1 itself; both
block until the other is there, bounded by LINK_TIMEOUT.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import ray
import torch

#: longest one send or receive of a bucket (or the handshake) may wait for the other side
LINK_TIMEOUT = timedelta(seconds=120)


class Link:
    """One end of a two-member gloo group: send and receive whole buffers to and from the other end."""

    def __init__(self, group, rank: int, key: str):
        self.group, self.rank, self.key = group, rank, key
        self._staging = torch.empty(0, dtype=torch.uint8)

    def staging(self, nbytes: int) -> torch.Tensor:
        """A buffer of `nbytes` kept for the link's life: a fresh one per version would fault its pages in again
        (about as costly as the copy itself on a fresh VM)."""
        if self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8)
        return self._staging[:nbytes]

    @property
    def peer(self) -> int:
        return 1 - self.rank

    def send(self, t: torch.Tensor) -> None:
        self.group.send([t], self.peer, 0).wait()

    def recv(self, t: torch.Tensor) -> None:
        """Receive into `t` (a contiguous CPU tensor of the size the sender sends)."""
        self.group.recv([t], self.peer, 0).wait()

    def close(self) -> None:
        try:
            self.group.shutdown()
        except Exception:  # noqa: BLE001 -- a link whose peer died may fail to shut down; it is dropped either way
            pass


def _join(address: tuple[str, int], rank: int, key: str, store=None) -> Link:
    from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

    host, port = address
    if store is None:
        store = TCPStore(host, port, 2, False, timeout=LINK_TIMEOUT)
    options = ProcessGroupGloo._Options()
    options._timeout = LINK_TIMEOUT
    options._devices = [ProcessGroupGloo.create_device(hostname=host)]
    return Link(ProcessGroupGloo(PrefixStore(key, store), rank, 2, options), rank, key)


def accept(address: tuple[str, int], key: str) -> Link:
    """The peer's side of `open_link`: join the link `key` as rank 0 (call from a thread that may block)."""
    return _join(address, 0, key)


def open_link(peer, method: str = "connect") -> Link:
    """Open a link to actor `peer`: host the rendezvous here, have `peer.<method>(key, address)` join it as
    rank 0, join as rank 1. The key is new per call, so a process that opens several links keeps them apart."""
    from torch.distributed import TCPStore

    host = ray.util.get_node_ip_address()
    store = TCPStore(host, 0, 2, True, timeout=LINK_TIMEOUT, wait_for_workers=False)
    key = f"link-{uuid.uuid4().hex[:12]}"
    ref = getattr(peer, method).remote(key, (host, store.port))
    link = _join((host, store.port), 1, key, store=store)
    ray.get(ref, timeout=LINK_TIMEOUT.total_seconds())
    link._store = store  # the rendezvous store lives as long as the link
    return link
