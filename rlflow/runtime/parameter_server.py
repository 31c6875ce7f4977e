"""Weights from train to rollout: the parameter server (StaleFlow §5.1), publish, pull, and verified delivery.

A version moves in buckets (stages/weight_buckets.py), in the trainer's dtype, over the transport the plan
names (`weight_sync.transport`, chosen at compile time):
- `object_store`: the trainer puts one object per bucket (zero-copy numpy views of its tensors: the put is
  the one copy) and the parameter server holds the references; a pull is a zero-copy `ray.get` per bucket
  plus the engine's copy into its parameters. Works everywhere Ray does. vLLM's workers read the buckets from
  the store themselves: the server lends them the references for the pull (`lend`, `_pull_lent`).
- `collective`: the trainer's rank 0 sends each bucket once over a gloo link (weight_link.py) to the
  parameter server, which keeps the version in its memory and relays it to each instance over that
  instance's own link when the instance pulls (Laminar's relay, §4.2). No object store, no pickling. An engine
  whose weights live in other processes (vLLM's workers) has them join the link themselves (`pull_into`), so
  the bytes go from the relay into the process that loads them.

Either way a push is atomic (the version becomes visible once all of it is held) and a pull sees one whole
version. The checksum of the version (stages/checksum.py) is computed bucket by bucket as the bytes go by
at publish, and again by every engine from what it loaded; the rollout fleet compares them (`verify_loaded`).
When each instance pulls is the coordinator's sync strategy (operators/sync.py).
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import ray
import torch

from rlflow.runtime.weight_link import LINK_TIMEOUT, accept, open_link
from rlflow.stages.checksum import Checksum
from rlflow.stages.engine import WeightsLoaded
from rlflow.stages.weight_buckets import BucketLayout, as_bytes, pack, stored_bucket, unpack

TRANSPORTS = ("object_store", "collective")
#: versions the relay keeps (the newest and the one before: a pull sent just before a publish still finds its own)
RELAY_KEEPS = 2


@dataclass(frozen=True)
class Published:
    """One published version as a Pull carries it. object_store: `ref` is one ObjectRef per bucket (in a list, so
    Ray does not resolve them when the record is passed to an actor); `relay` is the parameter server it was pushed
    to (collective: which holds the buckets; object_store: which lends the references to vLLM's workers).
    `layouts` describe the buckets; `checksum` was computed at publish."""

    version: int
    ref: list | None
    checksum: str
    layouts: tuple[BucketLayout, ...] = ()
    transport: str = "object_store"
    relay: object = None

    @property
    def nbytes(self) -> int:
        return sum(layout.nbytes for layout in self.layouts)


@ray.remote(num_cpus=0, concurrency_groups={"links": 64})
class ParameterServer:
    """The latest version's record; for the collective transport also its buckets (the relay's copy) and a link
    per peer. Link methods run on threads of their own ("links"), so a pull in progress blocks nothing else."""

    def __init__(self):
        self._latest = Published(-1, None, "")
        self._held: dict[int, list[torch.Tensor]] = {}  # collective: version -> packed buckets
        self._spare: list[torch.Tensor] = []  # buckets of evicted versions, reused (no fresh pages per version)
        self._sending: Counter = Counter()  # version -> relays in progress (not evicted meanwhile)
        self._links: dict = {}
        self._loans: dict[str, tuple[int, list]] = {}  # object_store: loan key -> (version, its references)
        self._lock = threading.Lock()

    def push(self, published: Published) -> int:
        """Make `published` the latest version. An object-store record without a checksum gets one computed here
        from the stored buckets (a pusher that does not checksum; costs this actor one pass over the weights)."""
        if published.version <= self._latest.version:
            raise ValueError(f"push of version {published.version} after version {self._latest.version}: versions only grow")
        if published.transport == "collective" and published.version not in self._held:
            raise ValueError(f"push of version {published.version} over the collective transport before its buckets arrived")
        if not published.checksum:
            total = Checksum()
            for layout, bucket in zip(published.layouts, fetch_buckets(published)):
                for name in layout.names:
                    total.add(name, bucket[name])
            published = replace(published, checksum=total.hexdigest())
        self._latest = published  # one assignment: atomic
        with self._lock:  # a loan its puller never ended (the actor died mid-pull) goes once the relay's would
            for key, (lent, _) in list(self._loans.items()):
                if lent <= published.version - RELAY_KEEPS:
                    del self._loans[key]
        return published.version

    def latest(self) -> Published:
        """The newest whole version; version -1 before the first push."""
        return self._latest

    def lend(self, key: str, published: Published) -> None:
        """Hold `published`'s object-store references under `key` until `end_loan(key)`: a reader that Ray cannot
        hand them to in a call (vLLM's workers, reached through vLLM's own IPC) asks for them with `lent`, so
        they pass in-band and Ray keeps counting them (an ObjectRef pickled out of band is pinned for good). A loan
        not ended is dropped when the version falls RELAY_KEEPS behind (by then its reader holds its own refs)."""
        with self._lock:
            self._loans[key] = (published.version, published.ref)

    def lent(self, key: str) -> list:
        with self._lock:
            loan = self._loans.get(key)
        if loan is None:
            raise LookupError(f"no weights are lent under {key!r} (the pull that lent them has ended, or its version "
                              f"fell {RELAY_KEEPS} behind)")
        return loan[1]

    def end_loan(self, key: str) -> None:
        with self._lock:
            self._loans.pop(key, None)

    def loaned(self) -> list[str]:
        """The keys of loans not yet ended (a pull in progress, or one that leaked)."""
        with self._lock:
            return sorted(self._loans)

    @ray.method(concurrency_group="links")
    def connect(self, key: str, address: tuple[str, int]) -> None:
        """Join the link a peer opened (weight_link.open_link)."""
        link = accept(address, key)
        with self._lock:
            self._links[key] = link

    @ray.method(concurrency_group="links")
    def receive(self, key: str, version: int, layouts: tuple[BucketLayout, ...]) -> int:
        """Receive `version`'s buckets from the trainer over link `key` and hold them; returns the bytes held."""
        buffers = []
        for layout in layouts:
            with self._lock:
                spare = next((i for i, b in enumerate(self._spare) if b.numel() == layout.nbytes), None)
                buf = self._spare.pop(spare) if spare is not None else torch.empty(layout.nbytes, dtype=torch.uint8)
            buffers.append(buf)
        for work in [self._links[key].recv_async(buf) for buf in buffers]:  # all posted: gloo fills them in order
            work.wait()
        with self._lock:
            self._held[version] = buffers
            for old in sorted(self._held)[:-RELAY_KEEPS]:
                if not self._sending[old]:
                    self._spare.extend(self._held.pop(old))
        return sum(b.numel() for b in buffers)

    @ray.method(concurrency_group="links")
    def send(self, key: str, version: int) -> int:
        """Relay `version` to the peer of link `key`: a header (the version, or -1 if it is no longer held), then
        the buckets. Returns the bytes sent."""
        with self._lock:
            buffers = self._held.get(version)
            held = sorted(self._held)
            if buffers is not None:
                self._sending[version] += 1
        link = self._links[key]
        try:
            link.send(torch.tensor([version if buffers is not None else -1], dtype=torch.int64))
            if buffers is None:
                raise LookupError(f"weights version {version} is no longer held by the parameter server (it holds "
                                  f"{held}); a pull must follow its publish within {RELAY_KEEPS} versions")
            for work in [link.send_async(buf) for buf in buffers]:  # held until the version is evicted: all at once
                work.wait()
        except RuntimeError:
            with self._lock:  # a broken link (the peer died or timed out): drop it; the peer opens a new one
                self._links.pop(key, None)
            link.close()
            raise
        finally:
            with self._lock:
                self._sending[version] -= int(buffers is not None)
        return sum(b.numel() for b in buffers)

    @ray.method(concurrency_group="links")
    def put_version(self, version: int) -> list:
        """A held version's buckets as object-store references, for readers without a link (evaluator, export)."""
        with self._lock:
            buffers = self._held.get(version)
        if buffers is None:
            raise LookupError(f"weights version {version} is no longer held by the parameter server")
        return [ray.put(buf.numpy()) for buf in buffers]



def publish(params, version: int, layouts: Iterable[BucketLayout], buckets: Iterable[tuple[BucketLayout, list]], *,
            transport: str = "object_store", link=None) -> dict:
    """Publish `version` to the parameter server `params`: `buckets` yields (layout, tensors) in the order of
    `layouts` (stages/weight_buckets.py); tensors may be views of the trainer's weights, valid only until the next
    bucket. object_store: one ray.put per bucket (the one copy), checksummed from the stored copy, so the checksum
    also covers the put. collective: packed and sent over `link` (rank 0's link to the parameter server).
    Returns {sync_s, put_s, checksum_s, bytes, buckets, checksum}."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}; got {transport!r}")
    layouts = tuple(layouts)
    t0 = time.perf_counter()
    total, refs, move_s, checksum_s = Checksum(), [], 0.0, 0.0
    receiving, sending = None, [None, None]  # collective: the send in flight from each of the two staging buffers
    if transport == "collective":
        receiving = params.receive.remote(link.key, version, layouts)
        largest = max((lay.nbytes for lay in layouts), default=0)
    for k, ((layout, tensors), expected) in enumerate(zip(buckets, layouts, strict=True)):
        if layout != expected:
            raise ValueError("publish: the buckets do not follow the layouts announced for them")
        t1 = time.perf_counter()
        if transport == "object_store":
            refs.append(ray.put([as_bytes(t.cpu()) for t in tensors]))
            stored = ray.get(refs[-1])  # zero-copy read-only views into the object store
            t2 = time.perf_counter()
            for name, t in stored_bucket(layout, stored).items():
                total.add(name, t)
            del stored
            move_s, checksum_s = move_s + (t2 - t1), checksum_s + (time.perf_counter() - t2)
        else:  # bucket k is packed and checksummed while bucket k-1 is still on the wire
            for slot, t in zip(layout.slots, tensors):
                total.add(slot.name, t)
            t2 = time.perf_counter()
            if sending[k % 2] is not None:
                sending[k % 2].wait()
            sending[k % 2] = link.send_async(pack(layout, tensors, out=link.staging(largest, k % 2)[: layout.nbytes]))
            checksum_s, move_s = checksum_s + (t2 - t1), move_s + (time.perf_counter() - t2)
    for work in sending:
        if work is not None:
            work.wait()
    if receiving is not None:
        ray.get(receiving, timeout=LINK_TIMEOUT.total_seconds())
    published = Published(version, refs if transport == "object_store" else None, total.hexdigest(), layouts, transport,
                          params)
    ray.get(params.push.remote(published))
    return {"sync_s": time.perf_counter() - t0, "put_s": move_s, "checksum_s": checksum_s, "bytes": published.nbytes,
            "buckets": len(layouts), "checksum": published.checksum}


def fetch_buckets(published: Published) -> Iterator[dict[str, torch.Tensor]]:
    """A published version's buckets from the object store, one at a time, as name -> tensor views (zero-copy,
    read-only). A collective version is first put into the store by its relay (the evaluator and export read
    it this way; rollout instances use `pull_buckets`)."""
    if published.transport == "collective":
        refs = ray.get(published.relay.put_version.remote(published.version), timeout=LINK_TIMEOUT.total_seconds())
        for layout, ref in zip(published.layouts, refs):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only object-store views: readers only read
                flat = torch.from_numpy(ray.get(ref))
            yield unpack(layout, flat)
        return
    for layout, ref in zip(published.layouts, published.ref):
        stored = ray.get(ref)
        yield stored_bucket(layout, stored)
        del stored


def fetch_state(published: Published) -> dict[str, torch.Tensor]:
    """The whole version as name -> tensor copies (export, tests): one copy of the model, on purpose."""
    return {name: t.clone() for bucket in fetch_buckets(published) for name, t in bucket.items()}


_RELAY_LINKS: dict[str, object] = {}  # this process's links, by the relay's actor id


def pull_buckets(published: Published) -> Iterator[dict[str, torch.Tensor]]:
    """The buckets of `published` for a rollout instance, one at a time (each valid until the next is asked for):
    over this process's link to the relay (opened on first use) for the collective transport, else from the
    object store."""
    if published.transport != "collective":
        yield from fetch_buckets(published)
        return
    relay_id = published.relay._actor_id.hex()
    link = _RELAY_LINKS.get(relay_id)
    if link is None:
        link = _RELAY_LINKS[relay_id] = open_link(published.relay)
    sending = published.relay.send.remote(link.key, published.version)
    try:
        header = torch.empty(1, dtype=torch.int64)
        link.recv(header)
        if int(header) != published.version:
            ray.get(sending, timeout=LINK_TIMEOUT.total_seconds())  # raises the relay's LookupError
        staging = link.staging(max(lay.nbytes for lay in published.layouts))
        for layout in published.layouts:
            flat = staging[: layout.nbytes]
            link.recv(flat)
            yield unpack(layout, flat)
        ray.get(sending, timeout=LINK_TIMEOUT.total_seconds())
    except BaseException:  # a broken link, or a reader that stopped half-way: drop it, the next pull opens a new one
        _RELAY_LINKS.pop(relay_id, None)
        link.close()
        raise


_ENGINE_LINKS: dict[tuple[int, str], object] = {}  # (id of the engine, the relay's actor id) -> weight_link.Hosted


def pull_into(engine, published: Published, version: int) -> WeightsLoaded:
    """Load `published` into `engine` as `version`. An engine that `joins_links` (vLLM: its workers hold the model)
    receives it in its own processes: over the collective transport through a link to the relay that they joined
    (opened on first use, per relay), over the object store by reading the buckets there themselves (the server
    lends them the references for the pull). Any other engine is given the buckets (`pull_buckets`)."""
    if not getattr(engine, "joins_links", False) or published.relay is None:
        return engine.load_weights(pull_buckets(published), version)
    if published.transport == "object_store":
        return _pull_lent(engine, published, version)
    slot = (id(engine), published.relay._actor_id.hex())
    hosted = _ENGINE_LINKS.get(slot)
    if hosted is None:
        hosted = _ENGINE_LINKS[slot] = open_link(published.relay, join_here=engine.join_link)
    sending = published.relay.send.remote(hosted.key, published.version)
    try:
        loaded = engine.load_over_link(hosted.key, published.layouts, version)
    except BaseException:  # a broken link, a version no longer held: drop it (the next pull opens a new one)
        _ENGINE_LINKS.pop(slot, None)
        engine.drop_link(hosted.key)
        try:
            ray.get(sending, timeout=LINK_TIMEOUT.total_seconds())
        except LookupError:  # the relay no longer holds the version: its message names what it holds
            raise
        except Exception:  # noqa: BLE001 -- the relay's side of the broken link; the engine's error says more
            pass
        raise
    ray.get(sending, timeout=LINK_TIMEOUT.total_seconds())
    return loaded


def _pull_lent(engine, published: Published, version: int) -> WeightsLoaded:
    """The object-store backend of an engine's in-process load: the server holds the version's references for
    the duration under a fresh key, and the engine's workers read the buckets from the store themselves."""
    import uuid

    key = f"{published.version}-{uuid.uuid4().hex[:12]}"
    server = published.relay
    ray.get(server.lend.remote(key, published), timeout=LINK_TIMEOUT.total_seconds())
    try:
        loaded = engine.load_from_store(server, key, published.layouts, version)
    except BaseException:
        server.end_loan.remote(key)  # not waited for: the engine's error is the one to see
        raise
    ray.get(server.end_loan.remote(key), timeout=LINK_TIMEOUT.total_seconds())
    return loaded


def verify_loaded(stage: str, instance: int, sent: Published, loaded: WeightsLoaded | None) -> None:
    """RunFailed unless an engine reports it loaded exactly the version it was sent, with the published checksum."""
    from rlflow.errors import RunFailed

    where = f"rollout stage '{stage}' instance {instance}"
    if loaded is None:
        raise RunFailed(f"{where} was sent weights version {sent.version} and reported no load; its engine's "
                        "load_weights must return a WeightsLoaded (stages/engine.py)")
    if loaded.missing:
        raise RunFailed(f"{where} loaded weights version {sent.version} but its engine did not load "
                        f"{len(loaded.missing)} of its parameters, e.g. {loaded.missing[:3]}; they keep older weights")
    if loaded.version != sent.version:
        raise RunFailed(f"{where} was sent weights version {sent.version} but reports it loaded version "
                        f"{loaded.version} (checksum {loaded.checksum}); a rollout engine must generate from "
                        "the version it was sent")
    if loaded.checksum != sent.checksum:
        raise RunFailed(f"{where} loaded weights version {sent.version} with checksum {loaded.checksum}, but "
                        f"version {sent.version} was published with checksum {sent.checksum}: the engine holds "
                        "other weights than the trainer published (a tensor skipped, corrupted or converted on "
                        "load); its rollouts would be trained as that version")


class ParameterServerHandle:
    """The driver's handle on the parameter server: the latest published version, its reference and checksum."""

    def __init__(self, actor: dict, timeout_s: float):
        self.server = ParameterServer.options(num_cpus=actor["num_cpus"], name=None).remote()
        self.timeout_s = timeout_s
        self.version, self.ref = -1, None  # ref: the Published record a Pull carries (None before the first push)

    @property
    def checksum(self) -> str | None:
        return None if self.ref is None else self.ref.checksum

    def refresh(self) -> int:
        """Read the newest version (after the trainer published one)."""
        from rlflow.errors import RunFailed

        try:
            latest = ray.get(self.server.latest.remote(), timeout=self.timeout_s)
        except ray.exceptions.RayActorError as err:
            raise RunFailed(f"the parameter server died ({type(err).__name__}); rlflow run --resume continues from "
                            "the last checkpoint") from None
        except ray.exceptions.GetTimeoutError:
            raise RunFailed(f"the parameter server did not answer within {self.timeout_s:.0f} s") from None
        self.version, self.ref = latest.version, (latest if latest.version >= 0 else None)
        return self.version
