"""One rollout instance under StaleFlow's cost model (Appendix B), advanced analytically between events.

Between two changes of its running set (n trajectories) every running trajectory gains one token
per decode step and the KV cache grows by k5*n per step, so step j after the change takes
a + d*j seconds (Eq. 11 with kv growing linearly, d = k1*k5*n); x steps take the arithmetic sum
a*x + d*x*(x-1)/2, so the next completion or KV overflow is one quadratic away. Progress is kept
as a real-valued step counter so that work can join mid-step (continuous batching, to within one step).

A stepped engine (profile chunk_steps > 0: the hf engine, driven one call of up to chunk_steps decode iterations at
a time) admits work only between calls: a trajectory routed mid-call waits for the call to end (all of its batch
finished, or chunk_steps iterations run), as rlflow run's routes travel in an instance's next step call.

Multi-turn episodes: a sample whose turn ends (not its last) leaves the running set, waits on its environment
(`env`: no slot, no KV) and rejoins the waiting queue's tail as a continuation, re-prefilling prompt + generated
as a resumed partial rollout does.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from itertools import count

from rlflow.operators.cost_profile import CostProfile
from rlflow.sim.trajectories import Sample

# Admission keeps 1% of the KV budget free, as vLLM's block-manager watermark does; a preemption
# frees down to the same mark, so a full instance does not thrash one token at a time.
KV_WATERMARK = 0.01


class Instance:
    """Running set, waiting queue (FIFO; preempted work goes back to its head), KV budget, weights version."""

    def __init__(self, idx: int, fleet, profile: CostProfile, prompt_tokens: int):
        self.idx = idx
        self.fleet = fleet
        self.sim = fleet.sim
        self.p = profile
        self.prompt_tokens = prompt_tokens
        self.version = 0  # weights this instance holds
        self.accepting = True  # False while draining before a pull
        self.running: dict[int, Sample] = {}  # insertion order = admission order (newest is preempted first)
        self.waiting: deque[Sample] = deque()
        self.env: dict[int, Sample] = {}  # episodes between turns, waiting on their environment (by id)
        self._finish: list[tuple[float, int, Sample]] = []  # heap by finish progress; stale entries skipped
        self._seq = count()
        self.progress = 0.0  # decode steps done, continuous
        self._off = 0.0  # KV tokens held = _off + len(running) * progress
        self.t_seg = 0.0  # when the current segment's decoding starts (later than now while stalled)
        self.stall_until = 0.0  # prefill / pull block decoding until then
        self._a = self._d = 0.0  # this segment's first-step latency and per-step increment
        self._target = 0.0  # progress at the scheduled event
        self._epoch = 0
        self._limit = profile.kv_tokens * (1 - KV_WATERMARK)
        self._busy = 0.0
        self._acct_t = 0.0
        self.prefill_tokens = 0.0
        self.preemptions = 0
        self.completed = 0  # completed since the last pull (the snapshot's complete_trajs)
        self.finished_total = 0  # completed since it started (the elastic monitor's rate)
        self.retired = False  # elastic: left the fleet; its episodes back from their environment go to the TS
        self.joined_at = self.sim.now  # instance-seconds for idle ratios (elastic instances join and leave)
        self.left_at: float | None = None
        self.kv_prev: float | None = None  # KV units at the previous snapshot
        self.chunk = profile.chunk_steps
        self._call_end: float | None = None  # a stepped engine in a call: the progress at which the call ends

    # -- state ------------------------------------------------------------------------------------
    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    def kv_tokens(self) -> float:
        return self._off + len(self.running) * self.progress

    def empty(self) -> bool:
        """Drained: nothing running, waiting, or between turns (a sync waits for whole episodes)."""
        return not self.running and not self.waiting and not self.env

    def has_capacity(self) -> bool:
        """StaleFlow Eq. 3: a routed trajectory runs at once only if it fits and nothing is waiting."""
        return (
            self.accepting
            and not self.waiting
            and self._call_end is None
            and len(self.running) < self.p.max_running
            and self.kv_tokens() + self.prompt_tokens <= self._limit
        )

    def busy_time(self, now: float) -> float:
        self.advance(now)
        return self._busy

    # -- analytic decoding ------------------------------------------------------------------------
    def advance(self, now: float) -> None:
        """Bring progress and busy-time accounting up to `now` (the running set has not changed since)."""
        n = len(self.running)
        if n:  # the hop between engine steps (profile hop_s) is time with work, but not the engine's: not busy
            self._busy += (now - self._acct_t) * (1 - self.p.hop_s / self._a if self._a > 0 else 1.0)
        elif self.stall_until > self._acct_t:
            self._busy += min(now, self.stall_until) - self._acct_t
        self._acct_t = now
        if now > self.t_seg:
            if n:
                dt = now - self.t_seg
                b, d = self._a - self._d / 2, self._d
                x = dt / b if d == 0 else 2 * dt / (b + math.sqrt(b * b + 2 * d * dt))
                self.progress += x
                self._a += d * x
            self.t_seg = now

    def plan(self) -> None:
        """Recompute this segment's latency law and schedule the next completion or KV overflow."""
        now = self.sim.now
        self.advance(now)
        self._epoch += 1
        self.t_seg = max(now, self.stall_until, self.t_seg)
        n = len(self.running)
        if not n:
            return
        kv = self.kv_tokens()
        self._a = self.p.step_latency(self.p.k5 * kv, n)
        self._d = self.p.k1 * self.p.k5 * n
        if self.chunk and self._call_end is None:  # a stepped engine's call starts with the batch it has now
            self._call_end = self.progress + self.chunk
        heap = self._finish
        while heap and self.running.get(id(heap[0][2])) is not heap[0][2]:
            heapq.heappop(heap)
        x = max(0.0, heap[0][0] - self.progress)
        if n > 1:  # a lone trajectory always fits (config validation: prompt + cap <= budget)
            x = min(x, max(0.0, (self.p.kv_tokens - kv) / n))
        if self._call_end is not None:
            x = min(x, max(0.0, self._call_end - self.progress))
        self._target = self.progress + x
        t = self.t_seg + self._seconds(x)
        self.sim.schedule(t, self._on_wake, self._epoch)

    def _seconds(self, x: float) -> float:
        """Time for x decode steps from now on: sum_{j<x} (a + d*j), exact at whole steps."""
        return (self._a - self._d / 2) * x + 0.5 * self._d * x * x

    def _on_wake(self, epoch: int) -> None:
        if epoch != self._epoch:
            return
        sim = self.sim
        self.advance(sim.now)
        self.progress = max(self.progress, self._target)  # snap: float error must not miss the event
        heap = self._finish
        while heap and heap[0][0] <= self.progress + 1e-6:
            _, _, sample = heapq.heappop(heap)
            if self.running.get(id(sample)) is sample:
                self._remove(sample)
                if sample.last_turn:
                    self.completed += 1
                    self.finished_total += 1
                    sim.sample_done(sample)
                else:
                    self._to_env(sample)
        if self.kv_tokens() >= self.p.kv_tokens - 1e-6:
            self._preempt()
        if self._call_end is not None and self.progress >= self._call_end - 1e-6:
            self._call_end = None  # the call ended: what was routed meanwhile joins now
        self.admit_waiting()
        self.fleet.touch(self)

    # -- work -------------------------------------------------------------------------------------
    def admit(self, sample: Sample) -> None:
        """Start (or resume) a sample now; its prompt and generated tokens are (re-)prefilled first."""
        self.advance(self.sim.now)
        if sample.version is None:
            sample.version = self.version
        sample.join = self.progress
        sample.contrib = sample.prompt + sample.generated - self.progress
        sample.finish = self.progress + (sample.turn_end - sample.generated)
        self._off += sample.contrib
        sample.where = self
        self.running[id(sample)] = sample
        heapq.heappush(self._finish, (sample.finish, next(self._seq), sample))
        self.stall(self.p.prefill_s_per_token * (sample.prompt + sample.generated))
        self.prefill_tokens += sample.prompt + sample.generated
        self.sim.timeline.record(self.idx, self.sim.now, len(self.running))

    def admit_waiting(self) -> None:
        if self._call_end is not None:
            return  # mid-call: they join when it ends
        while self.waiting and len(self.running) < self.p.max_running:
            head = self.waiting[0]
            if self.kv_tokens() + head.prompt + head.generated > self._limit:
                return
            self.admit(self.waiting.popleft())

    def stall(self, seconds: float) -> None:
        """Block decoding for `seconds` more (prefill, pull)."""
        now = self.sim.now
        self.advance(now)
        self.stall_until = max(self.stall_until, self.t_seg, now) + seconds
        self.t_seg = self.stall_until

    def pull(self, version: int) -> None:
        """Load weights `version`; running work keeps its V_traj and its KV cache is recomputed."""
        self.advance(self.sim.now)
        self.version = version
        self.completed = 0
        held = self.kv_tokens()
        self.stall(self.p.pull_s + self.p.prefill_s_per_token * held)
        self.prefill_tokens += held

    def enqueue(self, sample: Sample) -> None:
        """A routed sample: runs now if it fits and nothing waits, else joins the waiting queue's tail."""
        self.advance(self.sim.now)
        fits = self.kv_tokens() + sample.prompt + sample.generated <= self._limit
        if (not self.waiting and self._call_end is None and len(self.running) < self.p.max_running
                and (fits or not self.running)):
            self.admit(sample)
        else:
            sample.where = self
            self.waiting.append(sample)

    def interrupt(self, sample: Sample) -> None:
        """Stop a sample held here and keep what it generated (partial rollout; it resumes elsewhere)."""
        self.advance(self.sim.now)
        if self.running.get(id(sample)) is sample:
            sample.generated += self.progress - sample.join
            self._remove(sample)
        else:
            self.waiting.remove(sample)
            sample.where = None

    def abort(self, sample: Sample) -> None:
        """Drop a sample held here (running, waiting, or on its environment)."""
        self.advance(self.sim.now)
        if self.running.get(id(sample)) is sample:
            self._remove(sample)
        elif self.env.pop(id(sample), None) is sample:
            sample.where = None
            self.sim.env_left()
        else:
            self.waiting.remove(sample)
            sample.where = None

    def _remove(self, sample: Sample) -> None:
        del self.running[id(sample)]
        sample.where = None
        self._off -= sample.contrib
        if not self.running:
            self._off = 0.0  # shed float drift
            self._call_end = None  # a stepped engine's call ends when its batch has finished
        self.sim.timeline.record(self.idx, self.sim.now, len(self.running))

    def _to_env(self, sample: Sample) -> None:
        """A turn ended on a tool call: the sample leaves the engine until its environment step is done."""
        sample.end_turn()
        sample.where = self
        self.env[id(sample)] = sample
        self.sim.env_step(sample, self._on_env_done)

    def _on_env_done(self, sample: Sample) -> None:
        if self.env.pop(id(sample), None) is not sample:
            return  # aborted meanwhile
        self.sim.env_left()
        if self.retired:  # elastic: this instance left meanwhile; the continuation resumes wherever it is routed
            sample.where = None
            self.fleet.ts.put(sample)
            return
        self.enqueue(sample)  # a continuation: back to this engine, whatever sync is pending (episodes finish here)
        self.fleet.touch(self)

    def _preempt(self) -> None:
        """KV full: move the newest running samples back to the head of the waiting queue (recompute)."""
        while len(self.running) > 1 and self.kv_tokens() > self._limit:
            sample = self.running[next(reversed(self.running))]
            sample.generated += self.progress - sample.join
            self._remove(sample)
            sample.where = self
            self.waiting.appendleft(sample)
            self.preemptions += 1
