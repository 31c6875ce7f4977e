"""Finished trajectories' payloads between rollout and train, and the source queues of the reward streams.

A Ray actor (the plan's `payload_store` actor). Token ids and log-probs
pass through the driver only once, into the ledger, when a group is buffered (so a resumed run can restore it);
otherwise they stay here, out of the driver. (Trajectories still to be routed wait in StaleFlow's trajectory
server, trajectory_server.py.) Rollout workers `put` finished trajectories, the rollout fleet `enqueue_group`s a
complete group on its task's reward stage, that stage's reward stream pulls whole groups with `next_groups` (light
fields, and each member's version span) and reports them `delivered` once the driver has them, the buffer `peek`s
at what it buffers (for the ledger), and the trainer `take`s what it trains. Pulled-but-not-delivered groups are
capped per stage (`max_in_flight`): that cap is the reward stream's back-pressure; the rest wait here.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque

import ray

from rlflow.runtime.messages import GroupToScore
from rlflow.stages.trajectory import Trajectory


@ray.remote(num_cpus=0)
class PayloadStore:
    """Payloads by trajectory id, plus one queue of complete groups per reward stage."""

    def __init__(self):
        self._payload: dict[str, Trajectory] = {}  # traj_id -> its finished Trajectory
        self._queues: dict[str, deque[list[str]]] = {}  # reward stage -> complete groups (traj ids) waiting
        self._events: dict[str, asyncio.Event] = {}  # set when a stage's queue or credit changes
        self._ended: set[str] = set()  # stages whose stream was ended by end_stage()
        self._closed = False
        self._pulled: Counter = Counter()  # reward stage -> groups handed to its stream
        self._delivered: Counter = Counter()  # reward stage -> groups its stream delivered to the driver
        self._readers: dict[str, list[int]] = {}  # reward stage -> pids of the read tasks that attached, in order

    def _event(self, stage: str) -> asyncio.Event:
        return self._events.setdefault(stage, asyncio.Event())

    def put(self, trajectories: list[Trajectory]) -> int:
        """Store finished trajectories (rollout workers call this before they report completion)."""
        for t in trajectories:
            self._payload[t.traj_id] = t
        return len(self._payload)

    def enqueue_group(self, stage: str, traj_ids: list[str]) -> None:
        """A group is complete: send it down reward stage `stage`'s stream."""
        self.enqueue_groups(stage, [traj_ids])

    def enqueue_groups(self, stage: str, groups: list[list[str]]) -> None:
        """Groups completed together (one rollout step's report) go down `stage`'s stream together: the stream's
        source wakes once and pulls them as one bundle, rather than the first alone and the rest a Ray Data turn
        later (benchmarks/results/step_latency.md)."""
        missing = [t for ids in groups for t in ids if t not in self._payload]
        if missing:
            raise KeyError(f"payload store has no payload for {missing}; enqueue only stored trajectories")
        self._queues.setdefault(stage, deque()).extend(list(ids) for ids in groups)
        self._event(stage).set()

    async def next_groups(self, stage: str, timeout_s: float = 5.0, max_groups: int = 64,
                          max_in_flight: int | None = None, tick_s: float | None = None) -> list[GroupToScore] | None:
        """Up to max_groups whole groups for `stage` (light fields only: no token ids), keeping at most
        max_in_flight pulled but not delivered. Waits up to timeout_s, or only tick_s while groups it handed out
        are not delivered yet (reward_stream.py's tick); [] on timeout; None once the stage ended."""
        deadline = time.monotonic() + timeout_s
        if tick_s is not None and self._in_flight(stage) > 0:
            deadline = min(deadline, time.monotonic() + tick_s)
        q = self._queues.setdefault(stage, deque())
        while not self._ended_(stage) and (not q or self._credit(stage, max_in_flight) <= 0):
            event = self._event(stage)
            event.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return []
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except TimeoutError:
                return []
        if self._ended_(stage):
            return None
        groups = [q.popleft() for _ in range(min(max_groups, len(q), self._credit(stage, max_in_flight)))]
        # a group discarded after it was enqueued (aborted by the buffer) is not scored
        groups = [ids for ids in groups if all(t in self._payload for t in ids)]
        self._pulled[stage] += len(groups)
        return [GroupToScore.of([self._payload[t] for t in ids]) for ids in groups]

    def _ended_(self, stage: str) -> bool:
        return self._closed or stage in self._ended

    def _credit(self, stage: str, max_in_flight: int | None) -> int:
        if max_in_flight is None:
            return len(self._queues[stage])
        return max_in_flight - self._in_flight(stage)

    def _in_flight(self, stage: str) -> int:
        """Groups handed to `stage`'s stream and not yet delivered to the driver."""
        return self._pulled[stage] - self._delivered[stage]

    def delivered(self, stage: str, n_groups: int) -> None:
        """`stage`'s stream handed n_groups scored groups to the driver: that much credit returns."""
        self._delivered[stage] += n_groups
        self._event(stage).set()

    def attach(self, stage: str, pid: int) -> int:
        """A reward stream's read task starts on `stage`; returns how many have attached to it (a retry is > 1)."""
        self._readers.setdefault(stage, []).append(pid)
        return len(self._readers[stage])

    def readers(self, stage: str) -> list[int]:
        """Process ids of the read tasks that attached to `stage` (for diagnostics and tests)."""
        return list(self._readers.get(stage, []))

    def counts(self, stage: str) -> dict[str, int]:
        """Groups of `stage`: waiting here, pulled by its stream, delivered to the driver."""
        return {"pending": len(self._queues.get(stage, ())), "pulled": self._pulled[stage],
                "delivered": self._delivered[stage]}

    def end_stage(self, stage: str) -> None:
        """End one reward stage's stream: its pending and future next_groups calls return None at once."""
        self._ended.add(stage)
        self._event(stage).set()

    def close(self) -> None:
        """End every reward stream."""
        self._closed = True
        for event in self._events.values():
            event.set()

    def peek(self, traj_ids: list[str]) -> list[Trajectory]:
        """Copies of the payloads of `traj_ids` that are here (the buffer writes them to the ledger)."""
        return [self._payload[t] for t in traj_ids if t in self._payload]

    def take(self, traj_ids: list[str]) -> list[Trajectory]:
        """Hand payloads to the trainer and forget them."""
        return [self._payload.pop(t) for t in traj_ids]

    def discard(self, traj_ids: list[str]) -> int:
        """Forget payloads that will not be trained (aborted, filtered, dropped)."""
        return sum(self._payload.pop(t, None) is not None for t in traj_ids)
