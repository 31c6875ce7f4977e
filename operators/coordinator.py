"""The rollout coordinator's snapshot -> command cycle (StaleFlow §5.2, Algorithm 1; Table 1).

Pure control-plane code: a Coordinator holds the strategies and the speculative state P; cycle() takes a
snapshot, rejects it unless every issued command has taken effect (Eq. 1), and otherwise applies
synchronization, migration and routing in sequence, each on the state the previous one left, returning
the commands in the order they must be executed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from .commands import Abort, Command, Interrupt, Pull, Route
from .migration import MIGRATION, RepackMove
from .routing import MLQ, ROUTING, CostModel
from .snapshot import InstanceSnapshot, Snapshot
from .sync import SYNC


class SpeculativeState:
    """P: each instance's expected inst_version and accum_traj_num once issued commands take effect (Table 1)."""

    def __init__(self, n_instances: int, version: int = 0):
        self.inst_version = [version] * n_instances
        self.accum_traj_num = [0] * n_instances

    def add(self, version: int) -> int:
        """An instance joins (elastic rollout, operators/elastic_rule.py) holding `version` and no work; its index."""
        self.inst_version.append(version)
        self.accum_traj_num.append(0)
        return len(self.inst_version) - 1

    def issue(self, cmd: Command, ps_version: int | None = None) -> None:
        """Table 1: a command's effect on P right after issuance."""
        if isinstance(cmd, Pull):
            self.inst_version[cmd.inst] = cmd.version if ps_version is None else ps_version
            self.accum_traj_num[cmd.inst] = 0
        elif isinstance(cmd, Route):
            self.accum_traj_num[cmd.inst] += len(cmd.trajs)
        elif isinstance(cmd, (Interrupt, Abort)):
            self.accum_traj_num[cmd.inst] -= len(cmd.trajs)

    def accepts(self, snapshot: Snapshot) -> bool:
        """Eq. 1 for every instance: versions and |run ∪ wait ∪ complete| match P."""
        return all(
            self.inst_version[s.idx] == s.inst_version and self.accum_traj_num[s.idx] == s.accum_traj_num
            for s in snapshot.instances
        )


@dataclass(frozen=True)
class CoordinationConfig:
    """Which strategies run, and their knobs (defaults: StaleFlow §6.1 mu, phi; Laminar §5.2 C_max)."""

    routing: str = "least_loaded"  # least_loaded | cost_model
    sync: str = "greedy"  # greedy | throughput_aware | global | per_instance
    migration: str = "none"  # none | threshold | repack
    partial_rollout: bool = True  # global sync: pull mid-flight (interrupt, resume) instead of a barrier
    mu: float = 0.3
    phi_wait: int = 3
    phi_throughput: float = 5.0
    c_max_frac: float = 0.99  # Laminar C_max as a fraction of the KV budget
    batch_limit: int | None = None  # Laminar roofline batch B; default k2 / k3 (the decode crossover)

    def __post_init__(self):
        for name, table in (("routing", ROUTING), ("sync", SYNC), ("migration", MIGRATION)):
            if getattr(self, name) not in table:
                raise ValueError(f"{name}: unknown {getattr(self, name)!r}; use one of {sorted(table)}")


class Coordinator:
    """Algorithm 1 with snapshot validation; `cost` is needed by cost_model routing, threshold and repack."""

    def __init__(self, n_instances: int, config: CoordinationConfig = CoordinationConfig(),
                 cost: CostModel | None = None, validate: bool = True):
        if cost is None and (config.routing == "cost_model" or config.migration != "none"):
            raise ValueError(f"routing={config.routing!r} / migration={config.migration!r} need a cost model profile")
        self.cfg = config
        self.cost = cost
        self.P = SpeculativeState(n_instances)
        self.validate = validate
        self.rejected = 0
        self.cycles = 0

    # -- strategies bound to this coordinator's knobs -------------------------------------------
    def _route_fn(self, verify, reserve=None, hold=frozenset()):
        if self.cfg.routing == "cost_model":
            return partial(ROUTING["cost_model"], cost=self.cost, verify=verify, mu=self.cfg.mu, reserve=reserve, hold=hold)
        return partial(ROUTING["least_loaded"], cost=self.cost, verify=verify, reserve=reserve, hold=hold)

    def _migrate(self, instances):
        cfg = self.cfg
        if cfg.migration == "repack":
            batch = cfg.batch_limit or max(1, round(self.cost.k2 / self.cost.k3))
            return MIGRATION["repack"](instances, c_max=cfg.c_max_frac * self.cost.kv_budget, batch_limit=batch)
        return MIGRATION[cfg.migration](instances, cost=self.cost, phi_wait=cfg.phi_wait, phi_throughput=cfg.phi_throughput)

    # -- the cycle -------------------------------------------------------------------------------
    def issue(self, cmd: Command, ps_version: int | None = None) -> Command:
        self.P.issue(cmd, ps_version)
        return cmd

    def note_abort(self, inst: int, trajs) -> None:
        """The staleness manager aborted trajectories on `inst` (§4.3): P loses them too (Table 1)."""
        self.P.issue(Abort(inst, tuple(trajs)))

    def cycle(self, snapshot: Snapshot, verify: Callable[[int], bool],
              reserve: Callable[[object, int], None] | None = None,
              lanes: list[tuple[Callable[[object], bool], frozenset]] | None = None,
              owned: bool = False) -> list[Command] | None:
        """One pass of Algorithm 1; None if the snapshot is outdated (Eq. 1) and must be discarded.

        `lanes` (skew-aware dispatch): (which trajectories, instances they may use) pairs; routing runs
        once per lane, so long-tail trajectories only reach the long-tail instances (StreamRL §5.3).
        `owned`: the caller lets the cycle update the snapshot in place instead of on a copy; it changes only the
        instances it issues commands to (the simulator keeps every other instance's snapshot for the next cycle).
        A TS handed over as an `MLQ` keeps its queue order through the cycle (no sort per routing pass).
        """
        if self.validate and not self.P.accepts(snapshot):
            self.rejected += 1
            return None
        self.cycles += 1
        S = snapshot.instances if owned else [i.clone() for i in snapshot.instances]
        by_idx: dict[int, InstanceSnapshot] = {i.idx: i for i in S}
        ts = snapshot.ts_trajs if isinstance(snapshot.ts_trajs, MLQ) else list(snapshot.ts_trajs)
        back: list = []  # trajectories this cycle returns to the TS (interrupted)
        ps = snapshot.ps_version
        k5 = self.cost.k5 if self.cost else 1.0
        cmds: list[Command] = []
        # lines 4-9: synchronization; a pulled instance's work is interrupted back to the TS
        decision = SYNC[self.cfg.sync](S, ts, ps, verify=verify, route=self._route_fn(verify),
                                       partial_rollout=self.cfg.partial_rollout, cost=self.cost, mu=self.cfg.mu)
        for idx in decision.pull:
            inst = by_idx[idx]
            trajs = inst.run_trajs + inst.wait_trajs
            if trajs:
                cmds.append(self.issue(Interrupt(idx, tuple(trajs))))
            cmds.append(self.issue(Pull(idx, ps)))
            self._keep_env(inst)
            inst.discard(trajs, k5)
            inst.complete_trajs = 0
            inst.inst_version = ps
            back.extend(trajs)
        # lines 11-14: migration
        for move in self._migrate(S):
            if isinstance(move, RepackMove):
                cmds.extend(self._repack(by_idx[move.src], by_idx[move.dst], ps, k5))
                continue
            idx, trajs = move
            if trajs:
                cmds.append(self.issue(Interrupt(idx, tuple(trajs))))
                by_idx[idx].discard(trajs, k5)
                back.extend(trajs)
        ts = ts.merged(back) if isinstance(ts, MLQ) else ts + back
        # lines 16-17: routing
        all_idx = frozenset(by_idx)
        for member, insts in lanes or [(None, all_idx)]:
            hold = decision.hold | (all_idx - insts)
            lane = ts if member is None else ts.only(member) if isinstance(ts, MLQ) else [t for t in ts if member(t)]
            for route in self._route_fn(verify, reserve, hold)(S, lane):
                cmds.append(self.issue(route))
        return cmds

    def _keep_env(self, inst: InstanceSnapshot) -> None:
        """A Pull interrupts run and wait only: episodes between turns stay on the instance (they come back to its
        engine), so P counts them after the pull, where Table 1 resets accum_traj_num to 0."""
        self.P.accum_traj_num[inst.idx] += len(inst.env_trajs)

    def _repack(self, src: InstanceSnapshot, dst: InstanceSnapshot, ps: int, k5: float) -> list[Command]:
        """Laminar §5.1 step 3: move the source's work onto the destination; the released source pulls the latest."""
        trajs = src.run_trajs + src.wait_trajs
        out: list[Command] = [self.issue(Interrupt(src.idx, tuple(trajs))), self.issue(Route(dst.idx, tuple(trajs)))]
        src.discard(trajs, k5)
        dst.run_trajs.extend(trajs)
        dst.kv_cache += k5 * sum(t.tokens for t in trajs)
        if src.inst_version < ps:
            out.append(self.issue(Pull(src.idx, ps)))
            self._keep_env(src)
            src.complete_trajs = 0
            src.inst_version = ps
        return out
