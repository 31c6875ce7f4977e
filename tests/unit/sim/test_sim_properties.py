"""Property tests: any small simulated run finishes, keeps the bound and conservation, and trains each group once."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlflow.operators.cost_profile import CostProfile
from rlflow.sim import LengthSpec, SimConfig, Simulation, TrainerModel

PROFILE = CostProfile(
    name="small", k1=1e-6, k2=2e-3, k3=1e-4, k4=1e-2, k5=1.0,
    kv_budget=3000.0, max_running=6, prefill_s_per_token=1e-4, pull_s=0.5,
)
POLICIES = {  # kind -> eta choices (None where the kind fixes or ignores it)
    "staleflow": [0, 1, 2, 3],
    "synchronous": [None],
    "one_step": [None],
    "in_flight_limit": [0, 1, 2],
    "queue_max": [1, 2],
    "queue_drop": [None],
    "unbounded": [None],
}


@st.composite
def configs(draw):
    policy = draw(st.sampled_from(sorted(POLICIES)))
    eta = draw(st.sampled_from(POLICIES[policy]))
    groups = draw(st.integers(1, 4))
    mode = draw(st.sampled_from(["slots", "cost_model"]))
    sync = draw(st.sampled_from(["global", "per_instance"])) if mode == "cost_model" else "global"
    return SimConfig(
        mode=mode,
        instances=draw(st.integers(1, 3)),
        slots=draw(st.integers(3, 12)),
        profile=PROFILE,
        lengths=LengthSpec(kind="lognormal", mean=draw(st.sampled_from([20, 200])), tailness=draw(st.sampled_from([0, 60, 120])), cap=2000),
        prompt_tokens=draw(st.sampled_from([0, 50])),
        group_size=draw(st.integers(1, 4)),
        batch_groups=groups,
        policy=policy,
        eta=eta,
        capacity=groups * draw(st.integers(1, 3)) if policy == "queue_drop" else None,
        batch_redundancy=draw(st.integers(0, 2)) if policy in ("staleflow", "synchronous") else 0,
        weight_sync=sync,
        partial_rollout=draw(st.booleans()),
        trainer=TrainerModel(t_step=draw(st.sampled_from([0.5, 5.0, 50.0]))),
        reward_latency_s=draw(st.sampled_from([0.0, 0.3, 20.0])),  # control costs (issue #33): hops to the buffer
        step_control_s=draw(st.sampled_from([0.0, 0.2])),
        steps=8,
        warmup_steps=1,
        seed=draw(st.integers(0, 3)),
        max_events=200_000,
    )


def run_checked(config):
    """Run the simulation; every step trained a whole batch, every group is accounted for, none above the bound."""
    sim = Simulation(config)
    result = sim.run()
    c = sim.policy.counters
    assert c.conserved() and c.consumed == config.steps * config.batch_groups
    assert len(sim.groups) == c.in_flight + c.pending
    eta = {"synchronous": 0, "one_step": 1}.get(config.policy, config.eta)
    if eta is not None:
        assert result.max_staleness <= eta
    return sim, result


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_any_run_finishes_within_bound_and_conserves(config):
    sim, result = run_checked(config)
    if config.policy == "synchronous":
        assert all(sim.timeline.peak(a, b) == 0 for a, b in result.train_steps)
    assert min(result.staleness, default=0) >= 0
