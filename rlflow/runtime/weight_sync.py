"""Weights from train to rollout: the parameter server (StaleFlow §5.1), publish, and verified delivery.

The parameter server holds the latest version as one object-store reference and the checksum of its
weights (stages/checksum.py): a push is atomic (the new version becomes visible only once its whole state
is in the store) and a pull sees one whole version. When each instance pulls is the coordinator's sync
strategy (operators/sync.py); the Pull command carries (version, Published) into the instance's next step
call (rollout_worker.py), the engine reports the version and checksum of what it loaded, and the rollout
fleet checks both against what was published (`verify_loaded`).

Cost on CPU: publish is one copy (ray.put of numpy views of the trainer's tensors into the object store)
plus one checksum pass; a pull is a zero-copy ray.get plus one copy into the engine's parameters plus one
checksum pass (benchmarks/bench_weight_sync.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import ray

from rlflow.stages.checksum import checksum as weights_checksum


@dataclass(frozen=True)
class Published:
    """One published version as a Pull carries it: the state's [ObjectRef] (wrapped so Ray does not resolve it
    when it is passed to an actor) and the checksum computed when it was published."""

    version: int
    ref: list
    checksum: str


@ray.remote(num_cpus=0)
class ParameterServer:
    """Latest weights version, as one object-store reference to a dict of numpy arrays, and its checksum."""

    def __init__(self):
        self._latest = Published(-1, None, "")

    def push(self, version: int, state_ref: list, checksum: str | None = None) -> int:
        """Publish `version`; `state_ref` is [ray.put(state)] (the put already completed), `checksum` that of
        the state (stages/checksum.py; `publish` computes it). None: computed here from the stored copy, for a
        pusher that does not checksum (costs this actor one pass over the weights)."""
        if version <= self._latest.version:
            raise ValueError(f"push of version {version} after version {self._latest.version}: versions only grow")
        if checksum is None:
            checksum = weights_checksum(ray.get(state_ref[0]))
        self._latest = Published(version, state_ref, checksum)  # one assignment, no await: atomic
        return version

    def latest(self) -> Published:
        """The newest whole version; version -1 (ref None) before the first push."""
        return self._latest


def state_views(module_state: dict) -> dict[str, np.ndarray]:
    """name -> numpy view of a CPU state dict's tensors, no copy (publish's ray.put is the one copy).

    Views alias the live tensors: publish them before the next optimizer step, and under ZeRO-3 inside the
    GatheredParameters context (the gathered storage is released when it exits)."""
    return {name: t.detach().cpu().contiguous().numpy() for name, t in module_state.items()}


def publish(params, version: int, state: dict[str, np.ndarray]) -> dict:
    """Put `state` into the object store (its one copy), checksum the stored copy and push it to the parameter
    server `params` as `version`. Returns {sync_s, put_s, checksum_s, bytes, checksum}.

    `state` may be zero-copy views of the trainer's tensors (state_views): once this returns, the store holds
    its own copy and the trainer may change its weights. The checksum is computed from the stored copy, so
    it also covers the put."""
    t0 = time.perf_counter()
    ref = ray.put(state)
    t1 = time.perf_counter()
    stored = ray.get(ref)  # zero-copy read-only views into the object store
    checksum = weights_checksum(stored)
    nbytes = sum(a.nbytes for a in stored.values())
    del stored
    t2 = time.perf_counter()
    ray.get(params.push.remote(version, [ref], checksum))
    return {"sync_s": time.perf_counter() - t0, "put_s": t1 - t0, "checksum_s": t2 - t1, "bytes": nbytes,
            "checksum": checksum}


def verify_loaded(stage: str, instance: int, sent: Published, loaded: dict | None) -> None:
    """RunFailed unless an engine reports it loaded exactly the version it was sent, with the published checksum."""
    from rlflow.errors import RunFailed

    where = f"rollout stage '{stage}' instance {instance}"
    if loaded is None:
        raise RunFailed(f"{where} was sent weights version {sent.version} and reported no load; its engine's "
                        "load_weights must return {'version', 'checksum'} (stages/engine.py)")
    if loaded.get("missing"):
        raise RunFailed(f"{where} loaded weights version {sent.version} but its engine did not load "
                        f"{len(loaded['missing'])} of its parameters, e.g. {loaded['missing'][:3]}; they keep older weights")
    if loaded["version"] != sent.version:
        raise RunFailed(f"{where} was sent weights version {sent.version} but reports it loaded version "
                        f"{loaded['version']} (checksum {loaded['checksum']}); a rollout engine must generate from "
                        "the version it was sent")
    if loaded["checksum"] != sent.checksum:
        raise RunFailed(f"{where} loaded weights version {sent.version} with checksum {loaded['checksum']}, but "
                        f"version {sent.version} was published with checksum {sent.checksum}: the engine holds "
                        "other weights than the trainer published (a tensor skipped, corrupted or converted on "
                        "load); its rollouts would be trained as that version")


class WeightSync:
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
        self.version, self.ref = latest.version, (latest if latest.ref is not None else None)
        return self.version
