"""StreamRL skew-aware dispatch inside `rlflow run` (StreamRL §5.2-5.3, Algorithm 2).

A length ranker predicts each waiting prompt's output length; Algorithm 2 (operators/skew_dispatch.py)
marks the predicted-longest alpha of them long-tail and picks the split of the alive instances into
N_l long-tail and N_r regular ones that minimises the estimated generation time (Eq. 2, with P90 and
P50 of the recently completed lengths). Long-tail groups are then routed only to the first N_l alive
instances and regular groups only to the rest, longest predicted first (LPT, §5.3 "Scheduling Order").

Two deviations, both because `rlflow run` admits work continuously instead of once per batch:

- StreamRL dispatches a whole batch of prompts once and hands every instance a fixed list. Here the
  driver keeps one batch of groups drawn ahead (B groups, like the coordinator's TS and the
  simulator, StaleFlow §5.1) and re-runs Algorithm 2 over every waiting group whenever new ones
  are drawn; the lanes replace the fixed lists, and least-loaded routing (or the coordinator's
  routing strategy) spreads a lane's groups over its instances, as "evenly distributed" asks.
- The long-tail instances' "smaller batch sizes" (§5.3) become a cap: a long-tail instance holds at
  most M_l running trajectories, Algorithm 2's per-instance share of the long tail (Eq. 2's BS =
  min(M, max_batch)), and at least one group. Regular instances keep the engine's cap, "grouped into
  large batches to fully utilise" the hardware. The coordinator path leaves the cap to its cost model.

A group's lane is fixed when it is routed; a partial trajectory returned to the coordinator's TS stays
in its group's lane. The ranker learns from each completed group: (prompt, mean completion length).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable

from rlflow.operators.length_ranker import OnlineLengthRanker, recall_at_top
from rlflow.operators.policy import InvariantViolation
from rlflow.operators.skew_dispatch import percentile, skew_aware_dispatch

RECENT = 4096  # completed lengths kept: the distribution D whose P50 / P90 Algorithm 2 reads
RECALL_WINDOW = 256  # completed groups the reported recall@20% is measured over
RECALL_MIN = 10  # fewer completed groups than this: no recall reported yet


class DispatchLanes:
    """Lanes for the driver: which waiting group goes next, to which instances, with what cap."""

    def __init__(self, ranker, *, alpha: float, members: int, max_running: int, ptl: Callable[[int], float],
                 counts: dict, log=print):
        self.ranker, self.alpha, self.members, self.max_running, self.ptl = ranker, alpha, members, max_running, ptl
        self.counts, self.log = counts, log
        self.long: set = set()  # waiting or routed groups in the long-tail lane
        self.n_long = 0
        self.long_cap = max_running
        self.rank: dict = {}  # waiting gid -> position in LPT order (0 = longest predicted)
        self.info: OrderedDict = OrderedDict()  # gid -> (prompt, predicted length) until the group completes
        self.recent: deque = deque(maxlen=RECENT)
        self.scored: deque = deque(maxlen=RECALL_WINDOW)  # (predicted, actual) of completed groups
        self._cache: dict = {}  # gid -> predicted length under the ranker's current fit
        self._said_unfit = False
        self.dirty = False  # the ranker or D changed since the last plan: re-plan before the next route
        for k in ("dispatch_plans", "dispatch_long_groups", "dispatch_long_instances", "ranker_observed"):
            counts.setdefault(k, 0)

    @classmethod
    def for_stage(cls, pc, rollout: dict, *, batch_groups: int, max_model_len: int, counts: dict,
                  log=print) -> DispatchLanes | None:
        """The stage's data -> rollout dispatch, or None when it is round robin. The ranker is `learned` or
        an import string (the compiler rejects `oracle`, which needs lengths before generation); the profile
        (required by the compiler) shapes PTL(BS), the per-token latency Algorithm 2 weighs."""
        if not pc.skew_aware:
            return None
        from rlflow.plan_read import named_profile
        from rlflow.registry import resolve

        ref = pc.dispatch.get("ranker", "learned")
        if ref == "learned":
            ranker = OnlineLengthRanker(refit_every=batch_groups)  # refit once per batch's worth of completed groups
        else:
            ranker = resolve("ranker", ref)()
        prof = named_profile(pc.profile)
        prompt_tokens = max_model_len - rollout["max_new_tokens"]

        def ptl(bs: int, held: float = 0.0) -> float:  # Eq. 1's per-token latency at batch size bs
            return prof.step_latency(prof.k5 * bs * (prompt_tokens + held), bs)

        members = rollout["group_size"] + rollout["group_redundancy"]
        return cls(ranker, alpha=pc.dispatch.get("long_tail_fraction", 0.2), members=members,
                   max_running=rollout["max_running"], ptl=ptl, counts=counts, log=log)

    def describe(self) -> str:
        return (f"skew-aware dispatch (streamrl §5.3): the predicted-longest {self.alpha:.0%} of waiting prompts "
                f"go to dedicated long-tail instances; ranker {type(self.ranker).__name__}")

    # ------------------------------------------------------------------ Algorithm 2
    def plan(self, waiting: dict, n_alive: int) -> None:
        """Re-run Algorithm 2 over the waiting groups (gid -> prompt text) on `n_alive` instances."""
        self.dirty = False
        gids = list(waiting)
        missing = [g for g in gids if g not in self._cache]
        if missing:
            self._cache.update(zip(missing, self.ranker.predict([waiting[g] for g in missing])))
        predicted = [self._cache[g] for g in gids]
        self.long.difference_update(gids)
        informed = len(set(predicted)) > 1 and self.recent
        for g, p in zip(gids, predicted):  # kept to score the ranker when the group completes
            self.info[g] = (waiting[g], p if informed else None)
        if not informed:
            # the ranker has nothing to rank with yet (not fitted, or one prompt): no split, input order
            if not self._said_unfit:
                self.log("skew-aware dispatch: no split until the ranker has learned from completed groups")
                self._said_unfit = True
            self.n_long, self.long_cap, self.rank = 0, self.max_running, {g: j for j, g in enumerate(gids)}
            return
        recent = list(self.recent)
        half = 0.5 * percentile(recent, 50)  # a trajectory holds its prompt plus, on average, half its output
        # Algorithm 2 counts prompts; here a prompt is a group of `members` trajectories kept on one
        # instance, so its batch size BS (and the engine's cap) is in groups and PTL sees trajectories
        d = skew_aware_dispatch(gids, predicted, n_alive, recent, lambda bs: self.ptl(bs * self.members, half),
                                alpha=self.alpha, max_batch=max(1, self.max_running // self.members))
        self.long.update(d.long_tail)
        self.n_long = d.n_long
        share = math.ceil(len(d.long_tail) / d.n_long) if d.n_long else 0
        self.long_cap = min(self.max_running, max(1, share) * self.members)
        self.rank = {g: j for j, g in enumerate(d.long_tail + d.regular)}
        self.counts["dispatch_plans"] += 1
        self.counts["dispatch_long_instances"] = d.n_long

    def lanes(self, alive: list[int]) -> list[tuple[str, frozenset, int]]:
        """(lane, its instance indices, cap on running trajectories per instance), long-tail lane first.

        With no split (nothing learned yet, or one instance left after failures) both lanes use every
        alive instance, so groups marked long-tail earlier, and their partial trajectories, still run.
        """
        n_long = min(self.n_long, len(alive) - 1) if len(alive) > 1 else 0
        if not n_long:
            everyone = frozenset(alive)
            return [("long", everyone, self.max_running), ("regular", everyone, self.max_running)]
        long_insts, regular = frozenset(alive[:n_long]), frozenset(alive[n_long:])
        return [("long", long_insts, self.long_cap), ("regular", regular, self.max_running)]

    def lane(self, gid) -> str:
        return "long" if gid in self.long and self.n_long else "regular"

    def head(self, waiting, lane: str):
        """The longest-predicted waiting group of `lane` (LPT), or None."""
        mine = [g for g in waiting if self.lane(g) == lane]
        return min(mine, key=lambda g: self.rank.get(g, len(self.rank))) if mine else None

    def routed(self, gid) -> None:
        """A group is reserved (its first member routed)."""
        if self.lane(gid) == "long":
            self.counts["dispatch_long_groups"] += 1

    def check_lane(self, gid, inst: int, lanes: list) -> None:
        """Run-time check: a trajectory of `gid` placed on `inst` must be inside its group's lane.

        `lanes` is what lanes() returned for the routing decision being checked (computed once per decision)."""
        lane = self.lane(gid)
        insts = next(members for name, members, _ in lanes if name == lane)
        if inst not in insts:
            raise InvariantViolation(f"skew-aware dispatch: group {gid} ({lane} lane, instances {sorted(insts)}) "
                                     f"was routed to instance {inst}")

    # ------------------------------------------------------------------ learning from completions
    def completed(self, gid, lengths: list[int]) -> None:
        """A group finished: its members' completion lengths train the ranker and update D."""
        prompt, predicted = self.info.pop(gid, (None, None))
        self.long.discard(gid)
        self._cache.pop(gid, None)
        if not lengths:
            return
        self.recent.extend(lengths)
        self.dirty = True
        if prompt is None:
            return
        actual = sum(lengths) / len(lengths)
        if predicted is not None:
            self.scored.append((predicted, actual))
        fits = getattr(self.ranker, "fits", None)
        self.ranker.observe([prompt], [actual])
        self.counts["ranker_observed"] += 1
        if fits is None or self.ranker.fits != fits:  # refit (or a ranker that does not say): predict afresh
            self._cache.clear()

    def forget(self, gid) -> None:
        """A group evicted or aborted before it completed."""
        self.info.pop(gid, None)
        self.long.discard(gid)
        self._cache.pop(gid, None)

    def recall(self) -> float | None:
        """Recall of the longest 20% among recently completed groups (§7.2, Table 4); None while too few.

        StreamRL measures it within a batch; here over the last RECALL_WINDOW completed groups that were
        dispatched with a fitted ranker, so it follows the ranker as it refits.
        """
        if len(self.scored) < RECALL_MIN:
            return None
        pred, actual = zip(*self.scored)
        return recall_at_top(pred, actual, 0.2)
