"""What the coordinator sees (StaleFlow §5.2, Figure 11): per-instance snapshots, TS trajectories, PS version."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrajView:
    """A trajectory as the coordinator sees it; executors may pass their own objects with these attributes."""

    tid: object
    gid: object = None  # group id; the staleness policy reserves per group
    v_traj: int | None = None  # oldest weights version tolerated; None while initial (never routed)
    tokens: float = 0.0  # KV tokens it holds or brings: prompt + generated so far
    predicted: float | None = None  # ranker's predicted response length (skew-aware dispatch)


@dataclass
class InstanceSnapshot:
    """The five fields of Figure 11, plus the previous kv_cache (Laminar's ramp-down test)."""

    idx: int
    kv_cache: float = 0.0  # KV units held
    run_trajs: list = field(default_factory=list)
    wait_trajs: list = field(default_factory=list)
    complete_trajs: int = 0  # completed since the last pull; only |complete_trajs| enters Eq. 1, so a count
    inst_version: int = 0
    kv_prev: float | None = None  # kv_cache at the previous snapshot (Laminar §5.2, Algorithm 1 line 3)
    # Multi-turn episodes between turns, on their environment (rlflow/runtime/episodes.py). Not in Figure 11:
    # StaleFlow's trajectories are single-turn. They count in accum_traj_num (routed here, not complete), but hold
    # no engine slot or KV, so routing's load and migration (which moves wait_trajs) leave them out: moving one
    # would only wait for its environment step elsewhere.
    env_trajs: list = field(default_factory=list)
    shared: bool = False  # the trajectory lists are another snapshot's (see shallow): copy them before changing them

    def clone(self) -> InstanceSnapshot:
        return InstanceSnapshot(self.idx, self.kv_cache, list(self.run_trajs), list(self.wait_trajs),
                                self.complete_trajs, self.inst_version, self.kv_prev, list(self.env_trajs))

    def shallow(self) -> InstanceSnapshot:
        """A copy that shares the trajectory lists until it changes them (routing's `place` copies first). The
        throughput-aware sync's tentative pass routes on a copy of every instance per candidate, and reaches few of
        them: copying every list up front was a seventh of a 1,024-GPU staleflow.yaml run."""
        return InstanceSnapshot(self.idx, self.kv_cache, self.run_trajs, self.wait_trajs, self.complete_trajs,
                                self.inst_version, self.kv_prev, self.env_trajs, shared=True)

    def discard(self, trajs, k5: float = 1.0) -> None:
        """Remove trajectories (interrupted or aborted) from run/wait; their KV is released."""
        gone = {id(t) for t in trajs}
        freed = k5 * sum(getattr(t, "tokens", 0.0) for t in self.run_trajs if id(t) in gone)
        self.run_trajs = [t for t in self.run_trajs if id(t) not in gone]
        self.wait_trajs = [t for t in self.wait_trajs if id(t) not in gone]
        self.env_trajs = [t for t in self.env_trajs if id(t) not in gone]
        self.kv_cache = 0.0 if not self.run_trajs else max(0.0, self.kv_cache - freed)

    @property
    def accum_traj_num(self) -> int:
        """|run ∪ wait ∪ complete| of Eq. 1 (plus episodes on their environment)."""
        return len(self.run_trajs) + len(self.wait_trajs) + len(self.env_trajs) + self.complete_trajs


@dataclass
class Snapshot:
    """S of Algorithm 1: all instances, the TS's waiting trajectories, and the PS's latest version."""

    instances: list[InstanceSnapshot]
    ts_trajs: list = field(default_factory=list)
    ps_version: int = 0

    def clone(self) -> Snapshot:
        return Snapshot([i.clone() for i in self.instances], list(self.ts_trajs), self.ps_version)
