"""The discrete-event loop: a virtual clock jumping between completions, train-step ends and syncs.

The loop drives a real StalenessPolicy (operators/policy_kinds.py `make_policy`) exactly as an executor
must: verify(weights version) then reserve when a unit has room; occupy(min member version) when
all S samples of a group finished (reward_latency_s later: the hops to the buffer); consume() when the
trainer is idle and the policy is ready; the weights version advances when the step ends (its compute
plus step_control_s) and is published to the rollout side. A multi-turn sample
finishes when its last turn does; the policy never sees its turns or environment steps.
"""

from __future__ import annotations

import heapq
import random
import time
from dataclasses import replace
from itertools import count

import numpy as np

from rlflow.operators.policy import InvariantViolation, StalenessPolicy
from rlflow.operators.policy_kinds import make_policy
from rlflow.sim.config import SimConfig, SimConfigError
from rlflow.sim.fleet import CoordinatedFleet, Fleet, Fleets
from rlflow.sim.lengths import LengthSampler, expected_length
from rlflow.sim.result import SimResult, Timeline
from rlflow.sim.slots import SlotPool, closed_form_prediction
from rlflow.sim.trajectories import CoordinatedTS, Group, Sample, TrajectoryServer


class SimulationStalled(RuntimeError):
    """The run cannot reach its step count (nothing left to happen, or the event budget is spent)."""


def build_policy(config: SimConfig) -> StalenessPolicy:
    """The policy a pipeline would get, by name; a bad combination is a SimConfigError."""
    try:
        return make_policy(
            config.policy,
            batch_size=config.batch_groups,
            eta=config.eta,
            capacity=config.capacity,
            batch_redundancy=config.batch_redundancy,
        )
    except ValueError as e:
        raise SimConfigError(f"policy: {e}") from e


class Simulation:
    """One run of `config`; `policy` defaults to build_policy(config)."""

    def __init__(self, config: SimConfig, policy: StalenessPolicy | None = None):
        self.cfg = config
        self.policy = policy if policy is not None else build_policy(config)
        self.sampler = LengthSampler(config.lengths, np.random.default_rng(config.seed))
        # per rollout stage (index 0: the first, described by the top-level fields); later stages draw from streams
        # of their own, so adding a stage leaves the first stage's lengths as they were
        self.samplers = [self.sampler] + [LengthSampler(s.lengths, np.random.default_rng([config.seed, i]))
                                          for i, s in enumerate(config.stages, 1)]
        self._group_sizes = [config.group_size] + [s.group_size for s in config.stages]
        self._env_rng = random.Random(f"env-latency/{config.seed}")  # own stream: lengths do not move with turns
        self._filter_rng = random.Random(f"group-filter/{config.seed}")
        self._check_lengths_fit()
        self.now = 0.0
        self.weights = 0  # latest published weights version (train steps finished)
        self.state_epoch = 0  # bumped on every policy or trajectory-server change
        self.ts = CoordinatedTS() if config.coordinated else TrajectoryServer()
        self.tss = [self.ts] + [TrajectoryServer() for _ in config.stages]  # each stage's own samples waiting
        self.groups: dict[int, Group] = {}  # admitted, not yet consumed / dropped / aborted
        self.timeline = Timeline(sum(s.instances for s in config.rollouts))
        self._heap: list = []
        self._seq = count()
        self._gids = count()
        self._verified: dict[int, bool] = {}
        self._verified_epoch = -1
        self._training = False
        self._steps_started = 0
        self._steps_done = 0
        self._stop = False
        self.events = 0
        # steady-state window statistics
        self._in_window = config.warmup_steps == 0
        self._t_warm = 0.0
        self._busy_at_warm = 0.0
        self._train_busy = 0.0
        self._trained_tokens = 0.0
        self._trained_samples = 0
        self._staleness: list[int] = []
        self._step_max: list[int] = []
        self._trained_lengths: list[int] = []
        self._sampled_lengths: list[int] = []
        self._train_steps: list[tuple[float, float]] = []
        self._step_events: list[int] = []  # events run by the end of each train step (what a shorter run would cost)
        # several rollout stages: per stage, trained samples / tokens / length sum / longest length after warm-up, and
        # each fleet's (busy, unit) instance-seconds at the end of warm-up
        self._stage_trained = [[0, 0, 0, 0] for _ in config.rollouts] if config.stages else None
        self._stage_at_warm = [(0.0, 0.0)] * len(config.rollouts)  # warm-up 0: the window starts at 0
        self.env_waiting = 0  # samples between turns, waiting on their environment
        self.env_steps = 0  # environment steps started (whole run)
        self._env_area = 0.0  # integral of env_waiting over time
        self._env_t = 0.0
        self._env_area_at_warm = 0.0
        self.scale_events: list = []  # elastic: (seconds, steps ended, instances, why)
        self._units_at_warm = 0.0
        if config.mode == "slots":
            stagger = expected_length(config.lengths) / config.speed if config.stagger else 0.0
            self.rollout = SlotPool(self, config.slots, config.speed, config.instances, stagger)
        elif config.coordinated:
            self.rollout = CoordinatedFleet(self, config.instances, config.profile, config.prompt_tokens, config)
        else:
            self.rollout = Fleet(
                self, config.instances, config.profile, config.prompt_tokens, config.weight_sync, config.partial_rollout
            )
            if config.stages:
                self.rollout = Fleets([self.rollout] + self._stage_fleets())

    def _stage_fleets(self) -> list[Fleet]:
        """One fleet per rollout stage after the first; instance idx continue where the previous fleet's end."""
        cfg = self.cfg
        fleets, first = [], cfg.instances
        for i, s in enumerate(cfg.stages, 1):
            profile = cfg.profile if s.max_running is None else replace(cfg.profile, max_running=s.max_running)
            fleets.append(Fleet(self, s.instances, profile, cfg.prompt_tokens, cfg.weight_sync, cfg.partial_rollout,
                                stage=i, first=first))
            first += s.instances
        return fleets

    # -- what engines call ------------------------------------------------------------------------
    def schedule(self, t: float, fn, arg) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn, arg))

    def next_sample(self, version: int, stage: int = 0) -> Sample | None:
        """A sample of rollout stage `stage` that weights `version` may generate: a routable one, or the first of a
        newly admitted group."""
        ts = self.tss[stage]
        sample = ts.take(version)
        if sample is not None:
            return sample
        if not self._verify(version):
            return None
        gid = next(self._gids)
        self.policy.reserve(gid, version)
        self.state_epoch += 1
        group = self.new_group(gid, version, stage)
        self.groups[gid] = group
        ts.put(group)
        return ts.take(version)

    def new_group(self, gid: int, version: int | None, stage: int = 0) -> Group:
        """The S samples of a fresh prompt of rollout stage `stage`, lengths drawn from that stage's distribution."""
        cfg = self.cfg
        return Group(gid, version, self.samplers[stage].draw_group(self._group_sizes[stage]), cfg.prompt_tokens, cfg.turns,
                     stage)

    def env_step(self, sample: Sample, done) -> None:
        """`sample` ended a turn (not its last) and left its engine: `done(sample)` runs when its environment
        step does, env_latency_s later (fixed) or an exponential draw of that mean."""
        cfg = self.cfg
        latency = cfg.env_latency_s
        if cfg.env_latency == "exponential" and latency > 0:
            latency = self._env_rng.expovariate(1.0 / latency)
        self._env_count(+1)
        self.env_steps += 1
        self.schedule(self.now + latency, done, sample)

    def env_left(self) -> None:
        """A sample stopped waiting on its environment (its step ended, or its group was aborted)."""
        self._env_count(-1)

    def _env_count(self, delta: int) -> None:
        self._env_area += self.env_waiting * (self.now - self._env_t)
        self._env_t = self.now
        self.env_waiting += delta

    def can_route(self, version: int, stage: int = 0) -> bool:
        """Would next_sample(version, stage) return work (no side effects)?"""
        return self.tss[stage].has(version) or self._verify(version)

    def sample_done(self, sample: Sample) -> None:
        if self._in_window:
            self._sampled_lengths.append(sample.length)
        if self.cfg.coordinated:
            self.rollout.sample_done(sample)
        group = sample.group
        group.remaining -= 1
        group.min_version = sample.version if group.min_version is None else min(group.min_version, sample.version)
        if group.remaining:
            return
        if self.cfg.reward_latency_s > 0:  # payload store, reward stream, driver queue: the group stays in flight
            self.schedule(self.now + self.cfg.reward_latency_s, self._group_scored, group)
        else:
            self._group_scored(group)

    def _group_scored(self, group: Group) -> None:
        """A completed group reaches the buffer (the policy); one the policy let go of meanwhile is not offered."""
        if self.groups.get(group.gid) is not group:
            return
        if self.cfg.filter_drop_rate and self._filter_rng.random() < self.cfg.filter_drop_rate:
            # the group filter drops it (runtime/buffer.py rewarded): its slot frees and the group is generated again
            self.groups.pop(group.gid)
            self._forget(self.policy.filter(group.gid))
            self.state_epoch += 1
            return
        self._forget(self.policy.occupy(group.gid, group.min_version))
        self.state_epoch += 1

    def _forget(self, entries) -> None:
        """Groups the policy let go of: dropped when completed, aborted (surplus) when still generating."""
        for entry in entries:
            group = self.groups.pop(entry.gid, None)
            if group is not None and group.remaining:
                self.tss[group.stage].discard(group)
                self.rollout.abort(group)

    # -- trainer ----------------------------------------------------------------------------------
    def _try_train(self) -> None:
        if self._training or self._steps_started == self.cfg.steps or not self.policy.ready():
            return
        batch = self.policy.consume()
        self.state_epoch += 1
        self.policy.check_invariants()
        step = self._steps_started
        self._steps_started += 1
        self._forget(batch.dropped)
        tokens = 0
        lengths: list[int] = []
        groups = []
        for entry in batch.entries:
            group = self.groups.pop(entry.gid, None)
            if group is None or group.remaining:
                raise InvariantViolation(
                    f"{self.policy.name}: step {step} trains group {entry.gid}, which is not a completed, untrained group"
                )
            lengths.extend(group.lengths)
            tokens += sum(group.lengths) + self.cfg.prompt_tokens * len(group.lengths)
            groups.append(group)
        compute = self.cfg.trainer.step_time(tokens, len(lengths))
        # the step's control hops (buffer -> trainer call, payload take, publish, result, weight dispatch and load)
        # hold the trainer, so the next step cannot start, and the new weights, so rollout waits on them; only
        # `compute` counts as trainer busy, as the run's step_time_s does
        duration = compute + self.cfg.step_control_s
        if step >= self.cfg.warmup_steps:
            if self._stage_trained is not None:
                self._count_stages(groups)
            staleness = batch.staleness()
            self._staleness.extend(staleness)
            self._step_max.append(max(staleness, default=0))
            self._trained_lengths.extend(lengths)
            self._trained_tokens += tokens
            self._trained_samples += len(lengths)
            self._train_busy += compute
        self._training = True
        self._train_steps.append((self.now, self.now + duration))
        self.schedule(self.now + duration, self._on_train_end, step)

    def _count_stages(self, groups: list[Group]) -> None:
        prompt = self.cfg.prompt_tokens
        for group in groups:
            counts = self._stage_trained[group.stage]
            n, total = len(group.lengths), sum(group.lengths)
            counts[0] += n
            counts[1] += total + prompt * n
            counts[2] += total
            counts[3] = max(counts[3], max(group.lengths))

    def _on_train_end(self, step: int) -> None:
        self._step_events.append(self.events + 1)  # this event included
        self._training = False
        self._steps_done += 1
        self.weights += 1
        self.state_epoch += 1  # a new version: the policy may admit more (the runtime's coordinator is poked now)
        if self._steps_done == self.cfg.warmup_steps:
            self._in_window = True
            self._t_warm = self.now
            self._busy_at_warm = self.rollout.busy_time(self.now)
            self._units_at_warm = self.rollout.unit_time(self.now)
            if self.cfg.stages:
                self._stage_at_warm = [(f.busy_time(self.now), f.unit_time(self.now)) for f in self.rollout.fleets]
            self._env_count(0)
            self._env_area_at_warm = self._env_area
        if self._steps_done == self.cfg.steps:
            self._stop = True
            return
        self.rollout.publish(self.weights)
        self._elastic()

    def _elastic(self) -> None:
        """Elastic rollout: the scale requests due after this step (`cfg.scale`), else the automatic rule."""
        if not self.cfg.coordinated:
            return
        asked = [n for after, n in self.cfg.scale if after == self._steps_done]
        if asked:
            self.rollout.resize(asked[-1], f"scale to {asked[-1]} after step {self._steps_done}")
        else:
            start, end = self._train_steps[-1]  # the step that just ended
            self.rollout.stepped(end - start)

    # -- loop -------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        wall = time.perf_counter()
        heap = self._heap
        self._settle()
        while not self._stop:
            if not heap:
                raise SimulationStalled(self._stall_report("no event left"))
            if self.events >= self.cfg.max_events:
                raise SimulationStalled(self._stall_report(f"event budget {self.cfg.max_events} spent"))
            t, _, fn, arg = heapq.heappop(heap)
            self.now = t
            fn(arg)
            self.events += 1
            self._settle()
        return self._result(time.perf_counter() - wall)

    def _settle(self) -> None:
        self._try_train()
        self.rollout.wake()

    def _verify(self, version: int) -> bool:
        if self._verified_epoch != self.state_epoch:
            self._verified.clear()
            self._verified_epoch = self.state_epoch
        ok = self._verified.get(version)
        if ok is None:
            ok = self._verified[version] = self.policy.verify(version)
        return ok

    def _check_lengths_fit(self) -> None:
        for i, (sampler, stage) in enumerate(zip(self.samplers, self.cfg.rollouts)):
            longest = sampler.max_length
            if self.cfg.mode == "cost_model" and longest is not None:
                if longest + self.cfg.prompt_tokens > self.cfg.profile.kv_tokens:
                    where = f"stages.{stage.name}.lengths" if i else "lengths"
                    raise SimConfigError(
                        f"{where}: a {longest}-token response after a {self.cfg.prompt_tokens}-token prompt cannot fit"
                        f" the KV budget of {self.cfg.profile.kv_tokens:.0f} tokens"
                    )

    def _stall_report(self, why: str) -> str:
        c = self.policy.counters
        return (
            f"simulation stalled at t={self.now:.3f}s after {self._steps_done}/{self.cfg.steps} steps ({why}):"
            f" policy {self.policy.name!r} ready={self.policy.ready()} version={self.policy.version}"
            f" in_flight={c.in_flight} pending={c.pending} weights={self.weights}"
        )

    def _result(self, wall_s: float) -> SimResult:
        cfg = self.cfg
        end = self.now
        window = max(end - self._t_warm, 1e-12)
        busy = self.rollout.busy_time(end) - self._busy_at_warm
        rollout_idle = max(0.0, 1 - busy / max(self.rollout.unit_time(end) - self._units_at_warm, 1e-12))
        times, running = self.timeline.resample(end, cfg.timeline_points)
        c = self.policy.counters
        self._env_count(0)
        stages = self._stage_results(end, rollout_idle)
        return SimResult(
            policy=cfg.policy,
            mode=cfg.mode,
            steps=cfg.steps,
            warmup_steps=cfg.warmup_steps,
            sim_time_s=end,
            window_s=window,
            trained_tokens_per_s=self._trained_tokens / window,
            trained_trajectories_per_s=self._trained_samples / window,
            generated_tokens_per_s=sum(self._sampled_lengths) / window,
            staleness=self._staleness,
            step_max_staleness=self._step_max,
            trained_lengths=self._trained_lengths,
            sampled_lengths=self._sampled_lengths,
            expected_length=self._expected_length(stages),
            trainer_idle_ratio=max(0.0, 1 - self._train_busy / window),
            rollout_idle_ratio=rollout_idle,
            consumed=c.consumed,
            dropped=c.dropped,
            aborted=c.aborted,
            filtered=c.filtered,
            preemptions=getattr(self.rollout, "preemptions", 0),
            pulls=getattr(self.rollout, "pulls", 0),
            events=self.events,
            wall_s=wall_s,
            train_steps=self._train_steps,
            timeline_t=times,
            timeline_running=running,
            predicted=closed_form_prediction(cfg),
            turns=cfg.turns,
            env_steps=self.env_steps,
            mean_env_waiting=(self._env_area - self._env_area_at_warm) / window,
            scale_events=self.scale_events,
            step_events=self._step_events,
            stages=stages,
        )

    def _stage_results(self, end: float, rollout_idle: float) -> dict[str, dict]:
        """Per rollout stage, in order: instances, what it contributed to training after warm-up, its rollout idle
        ratio and E[L]."""
        cfg = self.cfg
        if self._stage_trained is None:  # one stage: the run's own numbers
            counts = [[self._trained_samples, self._trained_tokens, sum(self._trained_lengths),
                       max(self._trained_lengths, default=0)]]
            idle = [rollout_idle]
        else:
            counts = self._stage_trained
            idle = []
            for fleet, (busy0, units0) in zip(self.rollout.fleets, self._stage_at_warm):
                busy, units = fleet.busy_time(end) - busy0, fleet.unit_time(end) - units0
                idle.append(max(0.0, 1 - busy / max(units, 1e-12)))
        total = sum(c[0] for c in counts)
        out = {}
        for stage, (n, tokens, length_sum, longest), stage_idle in zip(cfg.rollouts, counts, idle):
            out[stage.name] = {
                "instances": stage.instances,
                "trained_samples": n,
                "trained_tokens": tokens,
                "trained_share": n / total if total else float("nan"),
                "mean_trained_length": length_sum / n if n else float("nan"),
                "max_trained_length": longest,
                "expected_length": expected_length(stage.lengths),
                "rollout_idle_ratio": stage_idle,
            }
        return out

    @staticmethod
    def _expected_length(stages: dict[str, dict]) -> float:
        """E[L]; with several rollout stages, their E[L] weighted by their trained shares."""
        if len(stages) == 1:
            return next(iter(stages.values()))["expected_length"]
        return sum(s["trained_share"] * s["expected_length"] for s in stages.values())


def simulate(config: SimConfig, policy: StalenessPolicy | None = None) -> SimResult:
    """Run `config` to its step count and return steady-state statistics."""
    return Simulation(config, policy).run()
