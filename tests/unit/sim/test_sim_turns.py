"""Multi-turn episodes in the simulator: turns, environment latency, V_traj across turns, env_trajs, the barrier."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_sim_properties import run_checked

from rlflow.compiler import compile_pipeline
from rlflow.operators.cost_profile import CostProfile
from rlflow.sim import LengthSpec, SimConfig, SimConfigError, Simulation, TrainerModel, simulate
from rlflow.sim.engine import Instance
from rlflow.sim.fleet import CoordinatedFleet
from rlflow.sim.from_plan import sim_config
from rlflow.sim.report import text_report
from rlflow.sim.slots import SlotPool

PIPELINES = Path(__file__).resolve().parents[3] / "pipelines"
PROFILE = CostProfile(name="turns", k1=1e-6, k2=2e-3, k3=1e-4, k4=1e-2, k5=1.0, kv_budget=50_000.0,
                      max_running=64, prefill_s_per_token=1e-5, pull_s=0.2)
SMALL = CostProfile(name="small", k1=1e-6, k2=2e-3, k3=1e-4, k4=1e-2, k5=1.0,
                    kv_budget=3000.0, max_running=6, prefill_s_per_token=1e-4, pull_s=0.5)


def _cfg(**kw) -> SimConfig:
    base = dict(mode="cost_model", instances=2, slots=128, speed=50.0, profile=PROFILE,
                lengths=LengthSpec(kind="lognormal", mean=200, tailness=60, cap=1000), prompt_tokens=50,
                group_size=4, batch_groups=8, policy="staleflow", eta=2, trainer=TrainerModel(t_step=1.0),
                steps=30, warmup_steps=6, seed=1)
    return SimConfig(**(base | kw))


def _strip(result) -> dict:
    return {k: v for k, v in result.summary().items() if k != "wall_s"}


SINGLE_TURN = [
    dict(mode="slots", slots=24),
    dict(weight_sync="global", partial_rollout=True),
    dict(weight_sync="global", partial_rollout=False),
    dict(weight_sync="per_instance"),
    dict(routing="cost_model", weight_sync="throughput_aware", partial_rollout=True),
]


@pytest.mark.parametrize("kw", SINGLE_TURN, ids=lambda kw: "-".join(map(str, kw.values())))
def test_one_turn_ignores_the_environment_and_matches_the_default(kw):
    default = simulate(_cfg(**kw))
    explicit = simulate(_cfg(**kw, turns=1, env_latency_s=7.0, env_latency="exponential"))
    assert _strip(explicit) == _strip(default)
    assert explicit.env_steps == 0 and explicit.mean_env_waiting == 0.0
    assert "turns" not in default.summary() and "env steps" not in text_report(default)


def _ratio(latency: float, **kw) -> float:
    """Trained tokens/s of bounded-async (eta 2) over synchronous (eta 0), 3-turn episodes."""
    sync = simulate(_cfg(turns=3, env_latency_s=latency, eta=0, **kw))
    async_ = simulate(_cfg(turns=3, env_latency_s=latency, eta=2, **kw))
    assert sync.max_staleness == 0 and async_.max_staleness <= 2
    return async_.trained_tokens_per_s / sync.trained_tokens_per_s


@pytest.mark.parametrize("kw", [
    dict(weight_sync="global", partial_rollout=True, lengths=LengthSpec(kind="fixed", mean=200)),
    dict(weight_sync="per_instance", lengths=LengthSpec(kind="fixed", mean=200)),
    dict(mode="slots", slots=128, lengths=LengthSpec(kind="fixed", mean=200), trainer=TrainerModel(t_step=4.0)),
], ids=["global-partial", "per-instance", "slots"])
def test_environment_latency_is_where_asynchrony_pays(kw):
    """The async / sync throughput ratio grows with environment latency: a synchronous step waits for every
    environment step of its batch; a bounded-async rollout keeps generating (other episodes, the next batches)."""
    ratios = [_ratio(latency, **kw) for latency in (0.0, 4.0, 16.0)]
    assert ratios[0] > 1.0
    assert ratios[2] > ratios[0] * 1.12, ratios
    assert ratios[2] <= 3.0 * 1.1  # at most eta + 1 batches overlap


def test_latency_slows_every_run_and_episodes_wait_on_environments():
    fast, slow = simulate(_cfg(turns=3)), simulate(_cfg(turns=3, env_latency_s=4.0))
    assert slow.trained_tokens_per_s < fast.trained_tokens_per_s
    assert slow.env_steps >= 2 * slow.consumed * 4  # two steps per trained episode (at least)
    assert fast.mean_env_waiting == 0.0 < slow.mean_env_waiting
    assert "env steps" in text_report(slow) and slow.summary()["turns"] == 3


def test_exponential_latency_uses_its_own_seeded_stream():
    a = simulate(_cfg(turns=3, env_latency_s=2.0, env_latency="exponential"))
    b = simulate(_cfg(turns=3, env_latency_s=2.0, env_latency="exponential"))
    fixed = simulate(_cfg(turns=3, env_latency_s=2.0))
    assert _strip(a) == _strip(b) != _strip(fixed)


@pytest.mark.parametrize("kw, spanning", [
    (dict(weight_sync="global", partial_rollout=True), True),
    (dict(weight_sync="per_instance"), False),  # an instance behind finishes its episodes on its own weights
    (dict(routing="cost_model", weight_sync="throughput_aware", partial_rollout=True, migration="threshold"), True),
    (dict(mode="slots", slots=48), True),
], ids=["global-partial", "per-instance", "coordinated", "slots"])
def test_v_traj_is_the_oldest_version_over_all_turns(kw, spanning, monkeypatch):
    """Every admission (each turn's, and any resume) runs weights at least as new as V_traj, the first turn's."""
    seen: dict[int, list[tuple[int, int]]] = {}  # id(sample) -> (turn, weights version) at every admission
    admit, start = Instance.admit, SlotPool._start

    def admit_spy(self, sample):
        seen.setdefault(id(sample), []).append((sample.turn, self.version))
        admit(self, sample)

    def start_spy(self, slot, sample):
        seen.setdefault(id(sample), []).append((sample.turn, self.sim.weights))
        start(self, slot, sample)

    monkeypatch.setattr(Instance, "admit", admit_spy)
    monkeypatch.setattr(SlotPool, "_start", start_spy)
    sim = Simulation(_cfg(turns=3, env_latency_s=1.5, trainer=TrainerModel(t_step=0.3), **kw))
    done = []
    sample_done = sim.sample_done
    sim.sample_done = lambda s: (done.append((s, list(seen.get(id(s), [])))), sample_done(s))
    sim.run()
    assert done
    spans = 0
    for sample, admissions in done:
        assert sample.turn == 2 and sample.generated >= sample.length * 2 / 3 - 1e-6  # more if resumed in turn 3
        turns = [t for t, _ in admissions]
        versions = [v for _, v in admissions]
        assert turns == sorted(turns) and set(turns) == {0, 1, 2}
        assert sample.version == versions[0] == min(versions)
        spans += versions[-1] > versions[0]
    assert (spans > 0) == spanning  # do episodes see a weight update between their turns?


def _snapshots(monkeypatch) -> list:
    shots = []
    snap = CoordinatedFleet._inst_snapshot

    def spy(self, inst):
        s = snap(self, inst)
        shots.append((s, set(map(id, inst.env.values()))))
        return s

    monkeypatch.setattr(CoordinatedFleet, "_inst_snapshot", spy)
    return shots


def test_snapshots_list_episodes_between_turns_as_env_trajs(monkeypatch):
    shots = _snapshots(monkeypatch)
    sim = Simulation(_cfg(turns=3, env_latency_s=2.0, routing="cost_model", weight_sync="throughput_aware",
                          partial_rollout=True, migration="threshold"))
    sim.run()
    assert sim.rollout.coord.rejected == 0  # Eq. 1 holds: env_trajs count in accum_traj_num
    assert any(s.env_trajs for s, _ in shots)
    for s, env_ids in shots:
        assert {id(t) for t in s.env_trajs} == env_ids
        assert not env_ids & {id(t) for t in s.run_trajs + s.wait_trajs}


@pytest.mark.parametrize("coordinated", [False, True])
def test_global_barrier_waits_for_episodes_on_their_environment(coordinated, monkeypatch):
    """partial_rollout False: no instance pulls while an episode of any instance is between turns."""
    pulls = []
    pull = Instance.pull

    def spy(self, version):
        pulls.append(sum(len(i.env) + len(i.running) + len(i.waiting) for i in self.fleet.instances))
        pull(self, version)

    monkeypatch.setattr(Instance, "pull", spy)
    kw = dict(coordinator=True) if coordinated else {}
    sim = Simulation(_cfg(turns=3, env_latency_s=2.0, weight_sync="global", partial_rollout=False, **kw))
    result = sim.run()
    assert pulls and set(pulls) == {0}
    assert result.max_staleness <= 2


def test_config_rejects_bad_turns_and_latency():
    with pytest.raises(SimConfigError, match="turns"):
        _cfg(turns=0)
    with pytest.raises(SimConfigError, match="env_latency_s"):
        _cfg(env_latency_s=-1.0)
    with pytest.raises(SimConfigError, match="env_latency"):
        _cfg(env_latency="uniform")


# ----------------------------------------------------------------------------------- plans


def test_agentic_plan_reads_turns_and_latency_from_its_environment():
    plan = compile_pipeline(PIPELINES / "agentic_calc.yaml", ["stages.rollout.env_kwargs.latency_s=0.5",
                                                            "stages.rollout.env_kwargs.latency=exponential"])
    cfg, notes = sim_config(plan, steps=4)
    assert (cfg.turns, cfg.env_latency_s, cfg.env_latency) == (2, 0.5, "exponential")
    note = next(n for n in notes if "multi-turn" in n)
    assert "max_turns" in note and "env_kwargs.latency_s" in note and "all its turns" in note
    assert simulate(cfg).env_steps > 0


def test_workload_block_overrides_the_environment():
    plan = compile_pipeline(PIPELINES / "agentic_calc.yaml", ["workload.turns=1", "workload.env_latency_s=3"])
    cfg, notes = sim_config(plan, steps=4)
    assert (cfg.turns, cfg.env_latency_s) == (1, 3.0)
    assert not any("multi-turn" in n for n in notes)


def test_single_turn_plan_has_no_turns(quickstart_plan):
    cfg, notes = sim_config(quickstart_plan, steps=4)
    assert (cfg.turns, cfg.env_latency_s, cfg.env_latency) == (1, 0.0, "fixed")
    assert not any("turn" in n for n in notes)


# ----------------------------------------------------------------------------------- properties

POLICIES = {"staleflow": [0, 1, 2], "synchronous": [None], "one_step": [None], "in_flight_limit": [0, 2],
            "queue_drop": [None], "unbounded": [None]}


@st.composite
def multi_turn_configs(draw):
    policy = draw(st.sampled_from(sorted(POLICIES)))
    groups = draw(st.integers(1, 3))
    mode = draw(st.sampled_from(["slots", "cost_model"]))
    return SimConfig(
        mode=mode, instances=draw(st.integers(1, 3)), slots=draw(st.integers(3, 12)), profile=SMALL,
        lengths=LengthSpec(kind="lognormal", mean=draw(st.sampled_from([20, 200])),
                           tailness=draw(st.sampled_from([0, 60, 120])), cap=2000),
        prompt_tokens=draw(st.sampled_from([0, 50])), group_size=draw(st.integers(1, 4)), batch_groups=groups,
        policy=policy, eta=draw(st.sampled_from(POLICIES[policy])),
        capacity=groups * draw(st.integers(1, 3)) if policy == "queue_drop" else None,
        batch_redundancy=draw(st.integers(0, 2)) if policy in ("staleflow", "synchronous") else 0,
        weight_sync=draw(st.sampled_from(["global", "per_instance"])) if mode == "cost_model" else "global",
        partial_rollout=draw(st.booleans()), coordinator=mode == "cost_model" and draw(st.booleans()),
        turns=draw(st.integers(1, 4)), env_latency_s=draw(st.sampled_from([0.0, 0.5, 5.0])),
        env_latency=draw(st.sampled_from(["fixed", "exponential"])),
        trainer=TrainerModel(t_step=draw(st.sampled_from([0.5, 5.0, 50.0]))),
        steps=8, warmup_steps=1, seed=draw(st.integers(0, 3)), max_events=400_000,
    )


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(multi_turn_configs())
def test_multi_turn_runs_finish_within_bound_and_conserve(config):
    sim, result = run_checked(config)
    assert min(result.staleness, default=0) >= 0
    rollout = sim.rollout
    held = len(rollout._env) if isinstance(rollout, SlotPool) else sum(len(i.env) for i in rollout.instances)
    assert sim.env_waiting == held  # every sample between turns is on exactly one environment
    for group in sim.groups.values():  # in flight: every sample is somewhere, in its turns' bounds
        for s in group.samples:
            assert 0 <= s.turn < config.turns and s.generated <= s.length + 1e-6

