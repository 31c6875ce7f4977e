"""The cost-model instance against a step-by-step reference, and its KV budget, prefill and pull costs."""

from __future__ import annotations

import heapq
from dataclasses import replace
from itertools import count

import pytest

from rlflow.operators.cost_profile import CostProfile
from rlflow.sim.engine import Instance
from rlflow.sim.result import Timeline
from rlflow.sim.trajectories import Group

PROFILE = CostProfile(
    name="test", k1=1e-6, k2=2e-3, k3=1e-4, k4=1e-2, k5=1.0,
    kv_budget=1e6, max_running=64, prefill_s_per_token=0.0, pull_s=0.0,
)


class Host:
    """The two things an Instance needs from the loop: a clock with a heap, and where finished samples go."""

    def __init__(self):
        self.now = 0.0
        self.timeline = Timeline(1)
        self.done: list[tuple[float, object]] = []
        self._heap: list = []
        self._seq = count()
        self._touched: set = set()
        self.sim = self

    def schedule(self, t, fn, arg):
        heapq.heappush(self._heap, (t, next(self._seq), fn, arg))

    def sample_done(self, sample):
        self.done.append((self.now, sample))

    def touch(self, inst):
        self._touched.add(inst)

    def run(self):
        while self._heap:
            t, _, fn, arg = heapq.heappop(self._heap)
            self.now = t
            fn(arg)
            for inst in self._touched:
                inst.plan()
            self._touched.clear()


def _samples(lengths, prompt):
    return Group(0, 0, list(lengths), prompt).samples


def _reference(lengths, prompt, p):
    """Decode step by step: step latency from tokens held at its start (Eq. 11); returns completion times."""
    gen = [0] * len(lengths)
    done = {}
    t = 0.0
    while len(done) < len(lengths):
        live = [i for i in range(len(lengths)) if i not in done]
        held = sum(prompt + gen[i] for i in live)
        t += p.step_latency(p.k5 * held, len(live))
        for i in live:
            gen[i] += 1
            if gen[i] == lengths[i]:
                done[i] = t
    return [done[i] for i in range(len(lengths))]


@pytest.mark.parametrize("lengths", [[300], [50, 400, 120], [7, 7, 900, 33, 250]])
def test_completion_times_match_a_step_by_step_decode(lengths):
    host = Host()
    inst = Instance(0, host, PROFILE, prompt_tokens=64)
    for s in _samples(lengths, 64):
        inst.admit(s)
    inst.plan()
    host.run()
    got = {s.index: t for t, s in host.done}
    want = _reference(lengths, 64, PROFILE)
    assert [got[i] for i in range(len(lengths))] == pytest.approx(want, rel=1e-9)


def test_compute_bound_matmul_term_takes_over_above_k2_over_k3():
    p = PROFILE
    assert p.step_latency(0, 10) == pytest.approx(p.k2 + p.k4)  # n * k3 = 1e-3 < k2
    assert p.step_latency(0, 100) == pytest.approx(100 * p.k3 + p.k4)


def test_prefill_and_pull_stall_decoding():
    p = replace(PROFILE, prefill_s_per_token=1e-4, pull_s=3.0)
    host = Host()
    inst = Instance(0, host, p, prompt_tokens=100)
    (s,) = _samples([200], 100)
    inst.admit(s)
    inst.plan()
    host.run()
    decode = _reference([200], 100, p)[0]
    assert host.done[0][0] == pytest.approx(100 * 1e-4 + decode)

    host2 = Host()
    inst2 = Instance(0, host2, p, prompt_tokens=100)
    (s2,) = _samples([200], 100)
    inst2.admit(s2)
    inst2.pull(1)  # at t=0: the pull waits for nothing, then the 100 held tokens are re-prefilled
    inst2.plan()
    host2.run()
    assert host2.done[0][0] == pytest.approx(100 * 1e-4 + 3.0 + 100 * 1e-4 + decode)
    assert inst2.version == 1 and s2.version == 0  # V_traj is the first token's weights


def test_kv_budget_preempts_newest_and_resumes_with_recompute():
    p = replace(PROFILE, kv_budget=1000.0, prefill_s_per_token=1e-5)
    host = Host()
    inst = Instance(0, host, p, prompt_tokens=10)
    samples = _samples([400, 400, 400, 400], 10)
    for s in samples:
        inst.admit(s)
    inst.plan()
    host.run()
    assert len(host.done) == 4
    assert inst.preemptions > 0
    assert inst.empty() and inst.kv_tokens() == pytest.approx(0)
    # the budget forced the later samples to finish after the earlier ones (they waited)
    order = [s.index for _, s in host.done]
    assert order[0] == 0
    # each preemption makes the victim re-prefill its prompt and generated tokens
    assert inst.prefill_tokens > 4 * 10


def test_lone_trajectory_never_preempted_at_the_budget():
    p = replace(PROFILE, kv_budget=500.0)
    host = Host()
    inst = Instance(0, host, p, prompt_tokens=100)
    (s,) = _samples([400], 100)  # exactly the budget at its last token
    inst.admit(s)
    inst.plan()
    host.run()
    assert len(host.done) == 1 and inst.preemptions == 0


def test_capacity_follows_eq3_fits_and_nothing_waiting():
    p = replace(PROFILE, kv_budget=1000.0, max_running=2)
    inst = Instance(0, Host(), p, prompt_tokens=100)
    assert inst.has_capacity()
    for s in _samples([50, 50], 100):
        inst.admit(s)
    assert not inst.has_capacity()  # max_running
    inst.accepting = False
    assert not inst.has_capacity()


def test_table4_profile_ships_the_papers_coefficients():
    p = CostProfile.load("staleflow-table4-qwen3-30b-a3b")
    assert (p.k1, p.k2, p.k3, p.k4) == (7.28e-8, 1.72e-3, 1.25e-4, 1.07e-2)
    assert p.kv_tokens > 0 and p.pull_s > 0 and p.prefill_s_per_token > 0
