"""What one simulation run is: engines, lengths, trainer, policy, weight sync (typed, validated)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from rlflow.operators.cost_profile import CostProfile

MODES = ("slots", "cost_model")
LENGTH_KINDS = ("fixed", "lognormal", "file")
WEIGHT_SYNC = ("global", "per_instance", "greedy", "throughput_aware")
ROUTING = ("least_loaded", "cost_model")
MIGRATION = ("none", "threshold", "repack")
DISPATCH = ("none", "skew_aware")
ENV_LATENCY = ("fixed", "exponential")


class SimConfigError(ValueError):
    """A simulation config that cannot describe a run; the message says which field and why."""


@dataclass(frozen=True)
class LengthSpec:
    """Response-length distribution, in tokens."""

    kind: str = "fixed"  # "fixed" | "lognormal" | "file"
    mean: float = 1024.0  # E[L] before capping (fixed: every length; lognormal: E[L] of the uncapped law)
    tailness: float = 0.0  # lognormal: sigma = 1.3 * tailness / 100 (docs/concepts/staleness.md)
    cap: int | None = None  # lognormal: max_new_tokens; lengths are rounded then capped
    path: str | None = None  # file: one integer per line, or a JSON list of integers
    prompt_share: float = 0.0  # lognormal: share of log-length variance a group's samples share (lengths.py)

    def __post_init__(self):
        if self.kind not in LENGTH_KINDS:
            raise SimConfigError(f"lengths.kind: unknown {self.kind!r}; use one of {LENGTH_KINDS}")
        if self.kind == "file" and not self.path:
            raise SimConfigError("lengths.path: a 'file' length distribution needs the path of recorded lengths")
        if self.kind != "file" and self.mean < 1:
            raise SimConfigError(f"lengths.mean: must be >= 1 token, got {self.mean}")
        if self.tailness < 0:
            raise SimConfigError(f"lengths.tailness: must be >= 0, got {self.tailness}")
        if self.cap is not None and self.cap < 1:
            raise SimConfigError(f"lengths.cap: must be >= 1 token, got {self.cap}")
        if not 0 <= self.prompt_share <= 1:
            raise SimConfigError(f"lengths.prompt_share: must be in [0, 1], got {self.prompt_share}")
        if self.prompt_share and self.kind == "file":
            raise SimConfigError("lengths.prompt_share: recorded lengths carry no prompt; use kind lognormal, or 0")


#: a forward's share of a forward and backward pass (the backward costs about two forwards)
FORWARD_SHARE = 1 / 3


@dataclass(frozen=True)
class TrainerModel:
    """Train-step time: fixed t_step, or base_s + passes x (s_per_token * batch tokens (prompt + response)
    + s_per_micro_batch * the micro-batches each rank runs); passes is 1 unless train.epochs / train.mini_batches
    make a batch several optimizer steps (the extra optimizer updates themselves are not charged: base_s holds one).

    Micro-batches (rlflow run's stages/batch_shards.py): a rank's share of the rows, micro_rows at a time
    (DeepSpeed's train_micro_batch_size_per_gpu), and with packing at most micro_tokens tokens each where the plan
    bounds them; every rank runs as many as the one that needs most."""

    t_step: float | None = None
    base_s: float = 0.0
    s_per_token: float = 0.0
    s_per_micro_batch: float = 0.0
    ranks: int = 1
    micro_rows: int = 8
    micro_tokens: int | None = None
    epochs: int = 1  # train.epochs: passes over each batch
    mini_batches: int = 1  # train.mini_batches: optimizer steps per pass

    def __post_init__(self):
        if self.t_step is None and self.base_s <= 0 and self.s_per_token <= 0 and self.s_per_micro_batch <= 0:
            raise SimConfigError("trainer: give t_step, or base_s / s_per_token / s_per_micro_batch > 0 (a step cannot "
                                 "take no time)")
        if self.t_step is not None and self.t_step <= 0:
            raise SimConfigError(f"trainer.t_step: must be > 0 s, got {self.t_step}")
        if self.ranks < 1 or self.micro_rows < 1:
            raise SimConfigError(f"trainer: ranks and micro_rows must be >= 1, got {self.ranks} and {self.micro_rows}")

    def micro_batches(self, rows: int, tokens: float) -> int:
        by_rows = math.ceil(math.ceil(rows / self.ranks) / self.micro_rows)
        if self.micro_tokens is None:
            return max(1, by_rows)
        return max(1, by_rows, math.ceil(tokens / self.ranks / self.micro_tokens))

    @property
    def passes(self) -> float:
        """Forward-and-backward passes over a batch, in units of one: `epochs`, plus with several optimizer steps
        the no-grad forward that takes pi_old's log-probs first (FORWARD_SHARE of a pass; with one step they come
        from the training forward itself)."""
        return self.epochs + (FORWARD_SHARE if self.epochs * self.mini_batches > 1 else 0.0)

    def step_time(self, tokens: float, rows: int = 0) -> float:
        if self.t_step is not None:
            return self.t_step
        micro = self.micro_batches(rows, tokens) if self.s_per_micro_batch else 0
        micro = math.ceil(micro / self.mini_batches) * self.mini_batches  # as stages/batch_shards.py rounds it
        return self.base_s + self.passes * (self.s_per_token * tokens + self.s_per_micro_batch * micro)


@dataclass(frozen=True)
class StageSim:
    """A rollout stage after the first: its own fleet of instances, response lengths and group size."""

    name: str
    instances: int = 1
    lengths: LengthSpec = field(default_factory=LengthSpec)
    group_size: int = 8
    max_running: int | None = None  # replaces the profile's max_running for this stage's instances; None: keep it


@dataclass(frozen=True)
class SimConfig:
    """One simulated run. Batch and capacity count groups; concurrency `slots` counts samples."""

    mode: str = "slots"  # "slots": closed-form model's C slots; "cost_model": StaleFlow Appendix B instances
    instances: int = 1  # rollout instances (slots mode: slots are spread over them, for the load timeline)
    slots: int = 64  # slots mode: C, samples generating at once
    speed: float = 100.0  # slots mode: s_R, tokens/s per slot
    stagger: bool = True  # slots mode: slots come up spread over one mean generation time, not in lockstep
    profile: CostProfile | None = None  # cost_model mode: per-instance cost model
    lengths: LengthSpec = field(default_factory=LengthSpec)
    prompt_tokens: int = 0  # prompt length, prefilled and held in KV (cost_model), counted in batch tokens
    group_size: int = 8  # S, samples per group
    batch_groups: int = 16  # G, groups per train step
    policy: str = "queue_drop"  # make_policy kind
    eta: int | None = None  # staleness bound (policies that take one)
    capacity: int | None = None  # queue capacity in groups (queue_drop / queue_max)
    batch_redundancy: int = 0  # extra groups admitted per batch (staleflow)
    weight_sync: str = "global"  # "global" | "per_instance" (cost_model mode)
    partial_rollout: bool = True  # global sync: True pulls mid-flight (V_traj kept); False drains all, then pulls
    # rollout coordination (StaleFlow Algorithm 1); defaults keep the event-driven least-loaded fleet
    coordinator: bool = False  # True: a snapshot -> command cycle every coordinator_interval_s drives routing
    routing: str = "least_loaded"  # "least_loaded" | "cost_model" (StaleFlow waterfall)
    migration: str = "none"  # "none" | "threshold" (phi_wait / phi_throughput) | "repack" (Laminar)
    dispatch: str = "none"  # "none" | "skew_aware" (StreamRL Algorithm 2)
    ranker: str = "oracle"  # skew_aware: "oracle" (true lengths) | "noisy" (oracle * lognormal noise, ranker_noise)
    ranker_noise: float = 0.5  # sigma of the noisy ranker's multiplicative error
    long_tail_fraction: float = 0.2  # skew_aware: alpha
    coordinator_interval_s: float = 0.5  # seconds between snapshots
    mu: float = 0.3  # waterfall threshold (StaleFlow §6.1)
    phi_wait: int = 3
    phi_throughput: float = 5.0
    # multi-turn episodes: a sample's length is split evenly over its turns; between turns it leaves the engine
    turns: int = 1  # generation turns per episode
    env_latency_s: float = 0.0  # mean seconds of one environment step (turns - 1 steps per episode)
    env_latency: str = "fixed"  # "fixed" | "exponential" (drawn from a stream seeded by `seed`)
    # elastic rollout (operators/elastic_rule.py): instances join or leave during the run; coordinated cost_model only
    scale: tuple = ()  # ((after_step, instances), ...): resize when that many train steps have ended (`rlflow scale`)
    elastic_min: int | None = None  # automatic scaling (streamrl §4.3) within [elastic_min, elastic_max]
    elastic_max: int | None = None
    elastic_window: int = 3  # train steps measured per automatic decision
    instance_start_s: float = 0.0  # seconds an added instance takes to start before it loads weights
    trainer: TrainerModel = field(default_factory=lambda: TrainerModel(t_step=1.0))
    # control costs: the hops between actors that `rlflow run` pays on top of compute, measured per hop by
    # benchmarks/bench_step_latency.py (configs/control_costs/); 0 keeps the closed form's instant hand-offs
    reward_latency_s: float = 0.0  # a group's last sample finished -> the group in the buffer (store, reward, queue)
    step_control_s: float = 0.0  # per train step outside trainer compute: call, payload take, publish, weight load
    route_s: float = 0.0  # an idle instance's work arrives this long after it could have (the driver's round trip)
    # the group filter (e.g. drop_uniform_groups): each scored group is dropped with this probability and generated
    # again, as the runtime's buffer does; a barrier's batch_redundancy auto admits B p / (1 - p) extra groups
    filter_drop_rate: float = 0.0
    steps: int = 100  # train steps to simulate
    warmup_steps: int = 10  # steps excluded from steady-state statistics
    seed: int = 0
    timeline_points: int = 400  # load timeline is resampled to this many instants
    max_events: int = 50_000_000  # guard against a run that can never finish its steps
    # several rollout stages (one fleet each, one policy, trainer and weights version): the first stage is described by
    # the top-level fields (instances, lengths, group_size, profile); `stages` are the rollout stages after the first,
    # in the order `rlflow run` serves their fleets
    stage_name: str = "rollout"  # the first rollout stage's name
    stages: tuple[StageSim, ...] = ()

    def __post_init__(self):
        errors = []
        if self.mode not in MODES:
            errors.append(f"mode: unknown {self.mode!r}; use one of {MODES}")
        if self.weight_sync not in WEIGHT_SYNC:
            errors.append(f"weight_sync: unknown {self.weight_sync!r}; use one of {WEIGHT_SYNC}")
        for name, table in (("routing", ROUTING), ("migration", MIGRATION), ("dispatch", DISPATCH)):
            if getattr(self, name) not in table:
                errors.append(f"{name}: unknown {getattr(self, name)!r}; use one of {table}")
        if self.ranker not in ("oracle", "noisy"):
            errors.append(f"ranker: the simulator has no prompt text; use 'oracle' or 'noisy', got {self.ranker!r}")
        if self.coordinated and self.mode != "cost_model":
            errors.append("coordinator: routing / migration / dispatch strategies and greedy / throughput_aware sync need mode 'cost_model'")
        if self.coordinator_interval_s <= 0:
            errors.append(f"coordinator_interval_s: must be > 0, got {self.coordinator_interval_s}")
        if self.mode == "slots" and self.weight_sync != "global":
            errors.append("weight_sync: slots mode models the closed form's instant in-flight sync; use 'global'")
        if self.mode == "cost_model" and self.profile is None:
            errors.append("profile: cost_model mode needs a CostProfile (e.g. CostProfile.load('staleflow-table4-qwen3-30b-a3b'))")
        if self.env_latency not in ENV_LATENCY:
            errors.append(f"env_latency: unknown {self.env_latency!r}; use one of {ENV_LATENCY}")
        if self.env_latency_s < 0:
            errors.append(f"env_latency_s: must be >= 0 s, got {self.env_latency_s}")
        for name in ("reward_latency_s", "step_control_s", "route_s"):
            if getattr(self, name) < 0:
                errors.append(f"{name}: a control cost must be >= 0 s, got {getattr(self, name)}")
        if not 0 <= self.filter_drop_rate < 1:
            errors.append(f"filter_drop_rate: a probability in [0, 1), got {self.filter_drop_rate}")
        for name in ("instances", "slots", "group_size", "batch_groups", "steps", "turns"):
            if getattr(self, name) < 1:
                errors.append(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.speed <= 0:
            errors.append(f"speed: must be > 0 tokens/s, got {self.speed}")
        if not 0 <= self.warmup_steps < self.steps:
            errors.append(f"warmup_steps: must be in [0, steps={self.steps}), got {self.warmup_steps}")
        if self.mode == "slots" and self.slots < self.instances:
            errors.append(f"slots: {self.slots} slots cannot be spread over {self.instances} instances")
        errors += self._cap_errors(self.lengths, "lengths")
        errors += self._elastic_errors()
        errors += self._stage_errors()
        if errors:
            raise SimConfigError("; ".join(errors))

    def _cap_errors(self, lengths: LengthSpec, where: str) -> list[str]:
        """cost_model mode: the longest trajectory (prompt + cap) must fit one instance's KV budget."""
        if self.profile is None or self.mode != "cost_model" or lengths.kind != "lognormal":
            return []
        longest = self.prompt_tokens + (lengths.cap or 0)
        if lengths.cap is None:
            return [f"{where}.cap: cost_model mode needs capped lengths (a trajectory must fit the KV budget)"]
        if longest > self.profile.kv_tokens:
            return [f"{where}.cap: prompt + cap = {longest} tokens exceeds the KV budget ({self.profile.kv_tokens:.0f} tokens)"]
        return []

    def _stage_errors(self) -> list[str]:
        if not self.stages:
            return []
        errors = []
        if self.mode != "cost_model" or self.coordinated or self.turns != 1:
            errors.append("stages: several rollout stages are simulated in mode 'cost_model', uncoordinated (least_loaded "
                          "routing, no migration, dispatch, elastic or scale; global or per_instance sync) and single-turn; "
                          "a coordinated or multi-turn multi-stage run is not modelled yet")
        names = [self.stage_name, *(s.name for s in self.stages)]
        if len(set(names)) != len(names):
            errors.append(f"stages: rollout stage names must differ, got {names}")
        for s in self.stages:
            where = f"stages.{s.name}"
            for name in ("instances", "group_size"):
                if getattr(s, name) < 1:
                    errors.append(f"{where}.{name}: must be >= 1, got {getattr(s, name)}")
            if s.max_running is not None and s.max_running < 1:
                errors.append(f"{where}.max_running: must be >= 1, got {s.max_running}")
            errors += self._cap_errors(s.lengths, f"{where}.lengths")
        return errors

    def _elastic_errors(self) -> list[str]:
        errors = []
        if (self.scale or self.elastic) and self.mode != "cost_model":
            errors.append("scale / elastic_*: instances join or leave only in mode 'cost_model' (slots mode has none)")
        for entry in self.scale:
            if len(entry) != 2 or entry[0] < 0 or entry[1] < 1:
                errors.append(f"scale: entries are (after_step >= 0, instances >= 1), got {entry!r}")
        if (self.elastic_min is None) != (self.elastic_max is None):
            errors.append("elastic_min / elastic_max: give both, or neither")
        elif self.elastic and not 1 <= self.elastic_min <= self.instances <= self.elastic_max:
            errors.append(f"elastic_min <= instances <= elastic_max must hold, got {self.elastic_min} <= "
                          f"{self.instances} <= {self.elastic_max}")
        if self.elastic_window < 1 or self.instance_start_s < 0:
            errors.append("elastic_window must be >= 1 step and instance_start_s >= 0 s")
        return errors

    @property
    def elastic(self) -> bool:
        """Automatic scaling (streamrl §4.3) within [elastic_min, elastic_max]."""
        return self.elastic_min is not None and self.elastic_max is not None

    @property
    def coordinated(self) -> bool:
        """Is the rollout driven by the coordinator's cycle (any non-default coordination choice)?"""
        return (self.coordinator or self.routing != "least_loaded" or self.migration != "none"
                or self.dispatch != "none" or self.weight_sync in ("greedy", "throughput_aware")
                or bool(self.scale) or self.elastic)  # elastic: one path, the coordinator's, as in the runtime

    @property
    def batch_samples(self) -> int:
        """B = G * S, in samples (S: the first rollout stage's group size)."""
        return self.batch_groups * self.group_size

    @property
    def rollouts(self) -> tuple[StageSim, ...]:
        """Every rollout stage in order, the first (the top-level fields) included."""
        return (StageSim(self.stage_name, self.instances, self.lengths, self.group_size), *self.stages)

    def as_dict(self) -> dict:
        return asdict(self)
