"""The buffer stage: where a rewarded group waits to be trained (docs/internals/architecture.md, the staleness manager).

One staleness policy (operators/, chosen by the plan's `control.staleness`) serves every rollout fleet:
a fleet asks `verify` / `reserve` when it routes a group's first member (StaleFlow Algorithm 2), tells
`completed` when the whole group has finished generating, and the reward streams hand the scored
group to `rewarded`, which occupies it (or filters it) and writes its payload to the ledger with its
`buffered` state, so a resumed run can `restore` it. `consume` takes the next batch for the trainer and checks
the invariants of §5 on it: no group above the bound, none trained twice, conservation.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from rlflow.errors import RunFailed
from rlflow.operators.policy import InvariantViolation
from rlflow.operators.policy_kinds import make_policy
from rlflow.operators.staleness_buffer import auto_redundancy
from rlflow.runtime.messages import ScoredBatch, TrainBatch

PAYLOAD_TIMEOUT_S = 120.0  # the payload store hands over a batch of buffered groups' payloads for the ledger
AUTO_WINDOW_BATCHES = 4  # batch_redundancy auto: the filter's drop rate over this many batches' scored groups


class Buffer:
    """The staleness policy plus the groups between reservation and training."""

    def __init__(self, control: dict, store, ledger, counts: dict, abort_group: Callable[[str], None], log=print):
        # batch_redundancy auto: the policy starts with none and follows the group filter's drops (_scored)
        self.auto_redundancy = control.get("batch_redundancy") == "auto"
        self.policy = make_policy(**control)
        self.recent: deque[bool] = deque(maxlen=AUTO_WINDOW_BATCHES * control["batch_size"])  # kept or dropped
        self.ledger = ledger
        self.eta = control["eta"]
        self.store, self.counts, self.abort_group, self.log = store, counts, abort_group, log
        self.generating: set[str] = set()  # reserved, members still generating
        self.group_version: dict[str, int] = {}  # generated group -> V_traj, until its reward arrives
        self.kept: dict[str, dict[str, float]] = {}  # occupied group -> {traj_id: reward}
        self.evicted: set[str] = set()  # evicted by the policy before their reward arrived
        for k in ("reward_failed", "filtered_groups", "dropped_groups"):
            counts.setdefault(k, 0)

    # ------------------------------------------------------------------ from the rollout fleets
    def verify(self, version: int) -> bool:
        return self.policy.verify(version)

    def reserve(self, gid: str, version: int) -> None:
        self.policy.reserve(gid, version)
        self.generating.add(gid)

    def completed(self, gid: str, version: int) -> None:
        """Every kept member finished; the group goes to its reward stage with V_traj `version`."""
        self.generating.discard(gid)
        self.group_version[gid] = version

    # ------------------------------------------------------------------ from the reward streams
    def rewarded_batch(self, batch: ScoredBatch) -> list[tuple[str, list[float]]]:
        """A reward stream's output (one row per trajectory, whole groups): each group to `rewarded`.
        Returns (task, rewards scored) per group, for the metrics."""
        groups: dict[str, list[tuple]] = {}
        tasks: dict[str, str] = {}
        for t in batch.rows:
            groups.setdefault(str(t.group_id), []).append((str(t.traj_id), float(t.reward), str(t.reward_error or ""),
                                                           bool(t.kept)))
            tasks[str(t.group_id)] = str(t.task)
        spans = {str(t.traj_id): (int(t.v_min), int(t.v_max)) for t in batch.rows if t.v_min is not None}
        if spans:  # the store's record of each member's version span
            self.ledger.spans(spans)
        out, fresh = [], []
        for gid, rows in groups.items():
            if gid not in self.group_version and gid not in self.evicted:
                # a reward batch delivered twice (Ray Data retried it after its worker died): scored once already
                self.counts["duplicate_rewards"] = self.counts.get("duplicate_rewards", 0) + 1
                self.log(f"group {gid}: its reward arrived again; the first one counts")
                continue
            out.append((tasks[gid], self.rewarded(gid, rows)))
            fresh.append(gid)
        self._persist([gid for gid in fresh if gid in self.kept])
        return out

    def _persist(self, gids: list[str]) -> None:
        """The payloads of groups that just entered the buffer, into the ledger with their `buffered` state (the
        driver commits both at once): a resumed run puts them back instead of generating them again."""
        if not gids:
            return
        import ray

        tids = [t for gid in gids for t in self.kept[gid]]
        try:
            rows = ray.get(self.store.peek.remote(tids), timeout=PAYLOAD_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RunFailed(f"the payload store did not hand over {len(tids)} buffered payloads in "
                            f"{PAYLOAD_TIMEOUT_S:.0f} s; rlflow run --resume continues from the last checkpoint") from None
        except ray.exceptions.RayActorError as err:
            raise RunFailed(f"the payload store died ({type(err).__name__}); rlflow run --resume continues from "
                            "the last checkpoint (the ledger generates again what it lost)") from None
        by_gid: dict[str, list] = {}  # gid -> its members' Trajectory objects
        for t in rows:
            by_gid.setdefault(t.group_id, []).append(t)
        for gid in gids:
            if len(by_gid.get(gid, ())) == len(self.kept[gid]):  # else (never seen) a resume generates it again
                self.ledger.buffered(gid, by_gid[gid], self.kept[gid])

    def rewarded(self, gid: str, rows: list[tuple[str, float, str, bool]]) -> list[float]:
        """A scored group: rows of (traj_id, reward, error, kept). Returns the rewards scored (for metrics)."""
        if gid in self.evicted:  # the policy gave up on it while it was being rewarded
            self.evicted.discard(gid)
            self.group_version.pop(gid, None)
            self.store.discard.remote([tid for tid, *_ in rows])
            return []
        failed = [(tid, err) for tid, _, err, _ in rows if err]
        if failed:
            self.ledger.trajectories([tid for tid, _ in failed], "failed")
            self.counts["reward_failed"] += len(failed)
            self.log(f"reward failed for {len(failed)} trajectory(ies) of group {gid}: {failed[0][1]}")
        good = {tid: r for tid, r, err, kept in rows if not err and kept}
        self._scored(bool(good))
        if not good:  # filtered (e.g. uniform rewards) or every reward failed
            self._evict(self.policy.filter(gid))  # may abort batch-redundancy surplus
            self.group_version.pop(gid, None)
            self.ledger.state(gid, "filtered")
            self.counts["filtered_groups"] += 1
            self.store.discard.remote([tid for tid, *_ in rows])
        else:
            self.store.discard.remote([tid for tid, _ in failed])
            self.kept[gid] = good
            self.ledger.state(gid, "buffered")  # its payload follows in _persist, in the same commit
            self._evict(self.policy.occupy(gid, self.group_version.pop(gid)))
        return [r for _, r, err, _ in rows if not err]

    def _scored(self, kept: bool) -> None:
        """batch_redundancy auto: admit as many extra groups per batch as the filter is dropping, B p / (1 - p) for
        a drop rate p, so a barrier's batch fills in about one round of generation instead of refilling dropped
        groups a round each (benchmarks/results/step_latency.md); at most 2 B, and none until a batch's worth of
        groups was scored."""
        if not self.auto_redundancy:
            return
        self.recent.append(kept)
        b = self.policy.batch_size
        if len(self.recent) < b:
            return
        self.policy.set_batch_redundancy(auto_redundancy(b, 1.0 - sum(self.recent) / len(self.recent)))

    def restore(self, gid: str, version: int, rewards: dict[str, float]) -> str:
        """A group buffered before a resume (its payloads already back in the store), into the policy with its
        original V_traj, so its staleness counts from the restored trainer version as before. Returns 'restored';
        'dropped' when it is now above the bound (recorded, never trained); 'regenerate' when the policy has no
        room for it (the caller generates it again)."""
        if self.eta is not None and self.policy.version - version > self.eta:
            self.ledger.state(gid, "dropped")
            self.counts["dropped_groups"] += 1
            return "dropped"
        if not self.policy.verify(version):
            return "regenerate"
        self.policy.reserve(gid, version)
        self.kept[gid] = dict(rewards)
        self._evict(self.policy.occupy(gid, version))
        return "restored"

    def _evict(self, entries) -> None:
        """Clean up after groups the policy evicted (it already counted them dropped or aborted): still
        generating (abort its members), waiting for its reward (forget it then), or occupied (drop it)."""
        for e in entries:
            if e.gid in self.generating:
                self.generating.discard(e.gid)
                self.abort_group(e.gid)
            elif e.gid in self.kept:
                self.store.discard.remote(list(self.kept.pop(e.gid)))
                self.ledger.state(e.gid, "dropped")
                self.counts["dropped_groups"] += 1
            else:
                self.evicted.add(e.gid)
                self.ledger.state(e.gid, "dropped")

    # ------------------------------------------------------------------ to the trainer
    def ready(self) -> bool:
        return self.policy.ready()

    def consume(self) -> TrainBatch:
        """The next batch for the trainer, its invariants checked."""
        batch = self.policy.consume()
        self._evict(batch.dropped)
        staleness = batch.staleness()
        if self.eta is not None and staleness and max(staleness) > self.eta:
            raise InvariantViolation(f"a batch at version {batch.version} has staleness {max(staleness)} > eta {self.eta}")
        self.policy.check_invariants()
        rewards, groups = {}, {}
        for e in batch.entries:
            group = self.kept.pop(e.gid)
            if set(group) & set(rewards):
                raise InvariantViolation(f"group {e.gid} would be trained twice")
            rewards |= group
            groups[e.gid] = list(group)
        return TrainBatch(batch, rewards, groups)

    @property
    def counters(self):
        return self.policy.counters
