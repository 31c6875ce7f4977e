"""Elastic rollout: when to add or remove a rollout instance during a run (StreamRL §4.3, "Dynamic adjustment").

StreamRL monitors δ, the gap between generation and training time per iteration, estimates δ', the generation
time one more data-parallel unit would save, and adds a unit when δ >= δ'. Rollout instances are decoupled
(each is its own engine), so adding or removing one does not restart the trainer.

The rule is a pure function of measured seconds, shared by the runtime (rlflow/runtime/scaling.py) and the
simulator (rlflow/sim/fleet.py), and `ElasticMonitor` turns cumulative counters into those seconds:

- T_gen: seconds the fleet needs to generate one batch when it never waits = batch trajectories / fleet rate,
  where an instance's rate is the trajectories it finished per second it was busy (generating or loading
  weights) over the window. Busy time, not wall time: an instance held back by the staleness bound is not slow.
- T_train: the trainer's mean step time over the window (compute only, not its wait for data).

With n instances, one more saves δ' = T_gen - T_gen * n / (n + 1) = T_gen / (n + 1): scale out when
T_gen - T_train >= T_gen / (n + 1). Deviation from §4.3, which only scales out: scale in when one instance fewer
would still generate a batch no slower than the trainer trains it, T_gen * n / (n - 1) <= T_train, so rollout
GPUs a shorter workload no longer needs go back to the pool. The two thresholds leave a band between them,
T_train * (n - 1) / n < T_gen < T_train * (n + 1) / n, so a steady workload does not flip back and forth.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ElasticRule:
    """Bounds and pace of automatic scaling (the pipeline's `stages.<rollout>.elastic`)."""

    min_instances: int = 1
    max_instances: int = 1
    window_steps: int = 3  # train steps measured per decision; the window restarts when the fleet changes


def decide(n: int, gen_s: float, train_s: float, rule: ElasticRule) -> int:
    """The instance count StreamRL's rule picks next, from n instances, T_gen and T_train (seconds per batch)."""
    if n < rule.max_instances and gen_s - train_s >= gen_s / (n + 1):
        return n + 1
    if n > rule.min_instances and gen_s * n / (n - 1) <= train_s:
        return n - 1
    return n


@dataclass
class Measure:
    """What one decision is based on, for the log."""

    instances: int
    gen_s: float
    train_s: float
    target: int

    def describe(self) -> str:
        verb = "add one" if self.target > self.instances else "remove one" if self.target < self.instances else "keep"
        return (f"elastic: {self.instances} rollout instance(s) generate a batch in {self.gen_s:.2f} s when busy, "
                f"the trainer trains one in {self.train_s:.2f} s: {verb} (streamrl §4.3)")


@dataclass
class ElasticMonitor:
    """Feeds decide() from cumulative per-instance counters at every train step.

    observe() takes, per serving instance, (busy seconds, trajectories finished) since it started, and the step's
    train seconds; it returns a Measure once a window of steps has passed with the same instances, else None.
    """

    rule: ElasticRule
    batch_trajectories: int  # trajectories the fleet generates per train step (batch groups x members)
    _start: dict = field(default_factory=dict)  # instance -> (busy, finished) at the window's start
    _train: list = field(default_factory=list)

    def restart(self) -> None:
        """The fleet changed (an instance joined or left): measure a fresh window."""
        self._start, self._train = {}, []

    def observe(self, counters: dict, train_s: float) -> Measure | None:
        if set(counters) != set(self._start):
            self._start, self._train = dict(counters), []  # first step, or the fleet changed under us
            return None
        self._train.append(train_s)
        if len(self._train) < self.rule.window_steps:
            return None
        rate = 0.0
        for idx, (busy, finished) in counters.items():
            b0, f0 = self._start[idx]
            if busy - b0 > 0:
                rate += (finished - f0) / (busy - b0)
        train = sum(self._train) / len(self._train)
        self._start, self._train = dict(counters), []
        if rate <= 0:
            return None  # nothing finished in the window: no basis for a decision
        n = len(counters)
        gen = self.batch_trajectories / rate
        return Measure(n, gen, train, decide(n, gen, train, self.rule))
