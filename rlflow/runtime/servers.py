"""The two middleware data servers (StaleFlow §5.1) as Ray actors.

ParameterServer: versioned weights in the object store; a push is atomic (the new version becomes
visible only once its whole state is in the store) and a pull always sees one whole version.

TrajectoryServer: holds trajectory payloads between rollout and train, so token ids and log-probs
never pass through the driver: rollout workers put finished trajectories here, the Ray Data reward
stream pulls completed groups from here, and the trainer takes consumed groups from here.
"""

from __future__ import annotations

import asyncio
import time

import ray

from rlflow.stages.trajectory import member_id


@ray.remote(num_cpus=0)
class ParameterServer:
    """Latest weights version, as one object-store reference to a dict of numpy arrays."""

    def __init__(self):
        self._version = -1
        self._ref = None  # [ObjectRef]: wrapped so Ray does not resolve it on return

    def push(self, version: int, state_ref: list) -> int:
        """Publish `version`; `state_ref` is [ray.put(state)] (the put already completed)."""
        if version <= self._version:
            raise ValueError(f"push of version {version} after version {self._version}: versions only grow")
        self._version, self._ref = version, state_ref  # one assignment pair, no await in between: atomic
        return version

    def latest(self) -> tuple[int, list | None]:
        """(version, [ObjectRef]) of the newest whole version; (-1, None) before the first push."""
        return self._version, self._ref


@ray.remote(num_cpus=0)
class TrajectoryServer:
    """Payload store and the source queue of the reward stream."""

    def __init__(self):
        self._payload: dict[str, dict] = {}  # traj_id -> Trajectory.as_dict()
        self._stream: list[list[str]] = []  # complete groups (lists of traj ids) waiting for reward
        self._closed = False
        self._event = asyncio.Event()

    def put(self, trajectories: list[dict]) -> int:
        """Store finished trajectories (called by rollout workers before they report completion)."""
        for t in trajectories:
            self._payload[member_id(t["group_id"], t["index"])] = t
        return len(self._payload)

    def enqueue_group(self, traj_ids: list[str]) -> None:
        """A group is complete: send its members down the reward stream."""
        missing = [t for t in traj_ids if t not in self._payload]
        if missing:
            raise KeyError(f"trajectory server has no payload for {missing}; enqueue only stored trajectories")
        self._stream.append(list(traj_ids))
        self._event.set()

    async def next_rows(self, timeout_s: float = 5.0, max_groups: int = 64) -> list[dict]:
        """Rows for the reward stream: whole groups, light fields only. Waits up to timeout_s for one."""
        deadline = time.monotonic() + timeout_s
        while not self._stream and not self._closed:
            self._event.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return []
            try:
                await asyncio.wait_for(self._event.wait(), remaining)
            except asyncio.TimeoutError:
                return []
        groups, self._stream = self._stream[:max_groups], self._stream[max_groups:]
        rows = []
        for ids in groups:
            for tid in ids:
                t = self._payload[tid]
                rows.append({"traj_id": tid, "group_id": t["group_id"], "completion": t["completion"], "answer": t["answer"]})
        return rows

    def close(self) -> None:
        """End the reward stream: pending and future next_rows calls return at once."""
        self._closed = True
        self._event.set()

    def take(self, traj_ids: list[str]) -> list[dict]:
        """Hand payloads to the trainer and forget them."""
        return [self._payload.pop(t) for t in traj_ids]

    def discard(self, traj_ids: list[str]) -> int:
        """Forget payloads that will not be trained (aborted, filtered, dropped)."""
        return sum(self._payload.pop(t, None) is not None for t in traj_ids)
