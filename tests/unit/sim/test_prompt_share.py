"""A prompt's share of the length variance (workload.prompt_share): the simulator's groups and the closed form's
tail multiplier agree on it, each length keeps its law, and 0 is the i.i.d. group exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rlflow.compiler import compile_pipeline
from rlflow.sim.config import LengthSpec, SimConfigError
from rlflow.sim.from_plan import stage_lengths
from rlflow.sim.lengths import LengthSampler, group_tail_multiplier
from rlflow.staleness_model import _capped_max_mean, lognormal_sigma, tail_multiplier

REPO = Path(__file__).resolve().parents[3]


def groups(spec: LengthSpec, n: int = 20_000, size: int = 8, seed: int = 0) -> np.ndarray:
    sampler = LengthSampler(spec, np.random.default_rng(seed))
    return np.asarray([sampler.draw_group(size) for _ in range(n)])


def spec(share: float, cap: int | None = None) -> LengthSpec:
    return LengthSpec(kind="lognormal", mean=1000, tailness=60, cap=cap, prompt_share=share)


def test_share_zero_draws_exactly_the_independent_lengths():
    a = LengthSampler(spec(0.0), np.random.default_rng(5))
    b = LengthSampler(spec(0.0), np.random.default_rng(5))
    assert [a.draw_group(8) for _ in range(50)] == [b.draw(8) for _ in range(50)]


def test_share_one_makes_a_group_equally_long_and_share_between_correlates_it():
    assert all(len(set(g)) == 1 for g in groups(spec(1.0), n=200).tolist())
    logs = np.log(groups(spec(0.5)))
    within = np.mean([np.corrcoef(logs[:, 0], logs[:, j])[0, 1] for j in range(1, 8)])
    assert within == pytest.approx(0.5, abs=0.03)
    assert abs(np.corrcoef(np.log(groups(spec(0.0)))[:, :2].T)[0, 1]) < 0.03


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_each_length_keeps_its_law(share):
    drawn = groups(spec(share)).ravel()
    assert drawn.mean() == pytest.approx(1000, rel=0.03)
    assert np.log(drawn).std() == pytest.approx(lognormal_sigma(60), rel=0.03)


@pytest.mark.parametrize("share, cap", [(0.3, 4000), (0.7, None), (0.95, 3000)])
def test_the_closed_form_tail_multiplier_matches_the_drawn_groups(share, cap):
    drawn = groups(spec(share, cap), n=40_000, size=16)
    measured = drawn.max(axis=1).mean() / drawn.mean()
    assert group_tail_multiplier(spec(share, cap), 16) == pytest.approx(measured, rel=0.02)


def test_the_tail_multiplier_falls_from_the_iid_value_to_one():
    values = [tail_multiplier(60, 16, cap=5.0, prompt_share=s) for s in (0.0, 0.25, 0.5, 0.75, 1.0)]
    assert values == sorted(values, reverse=True) and values[0] > 2.5 and values[-1] == pytest.approx(1.0, abs=1e-9)
    sigma = lognormal_sigma(60)  # both integrals agree where they overlap, the i.i.d. group
    by_grid = _capped_max_mean(sigma, 16, 5.0, 1.0, 0.0) / _capped_max_mean(sigma, 1, 5.0, 1.0, 0.0)
    assert by_grid == pytest.approx(values[0], rel=1e-4)


def test_a_share_outside_zero_one_or_on_recorded_lengths_is_refused(tmp_path):
    with pytest.raises(SimConfigError, match="prompt_share: must be in"):
        spec(1.5)
    (tmp_path / "l.txt").write_text("5\n7\n")
    with pytest.raises(SimConfigError, match="recorded lengths carry no prompt"):
        LengthSpec(kind="file", path=str(tmp_path / "l.txt"), prompt_share=0.5)


def test_the_plan_carries_the_share_to_the_simulator():
    sets = ["workload.tailness=60", "workload.prompt_share=0.6", "workload.rollout_tokens_per_s=1000",
            "workload.train_tokens_per_s=1000"]
    plan = compile_pipeline(REPO / "pipelines" / "staleflow.yaml", sets)
    (name,) = [n for n, s in plan["pipeline"]["stages"].items() if s["kind"] == "rollout"]
    rollout = plan["pipeline"]["stages"][name]
    assert stage_lengths(plan["pipeline"]["workload"], name, rollout).prompt_share == 0.6
    iid = compile_pipeline(REPO / "pipelines" / "staleflow.yaml", sets[:1] + sets[2:])
    assert stage_lengths(iid["pipeline"]["workload"], name, rollout).prompt_share == 0.0


def test_a_run_measures_the_share_it_was_given():
    from rlflow.runtime.workload_measured import prompt_share

    for share in (0.0, 0.4, 0.8, 1.0):
        measured = prompt_share(groups(spec(share), n=3000).tolist())
        assert measured == pytest.approx(share, abs=0.04)
    assert prompt_share([[5, 5, 5]]) == 0.0 and prompt_share([[4, 4], [4, 4]]) == 0.0  # one group; no variance


def test_a_skew_aware_plan_states_its_share_assumption_and_others_do_not():
    from rlflow.sim.from_plan import share_notes, sim_config

    streamrl = compile_pipeline(REPO / "pipelines" / "streamrl.yaml", ["workload.prompt_share=0.7"])
    (note,) = share_notes(streamrl)
    assert note.startswith("rollout: a prompt's samples share 0.7 of the log-length variance")
    assert note in sim_config(streamrl, steps=5)[1]
    assert share_notes(compile_pipeline(REPO / "pipelines" / "staleflow.yaml", ["workload.tailness=60"])) == []


def test_a_run_measures_the_workload_it_was_given():
    from rlflow.runtime.workload_measured import as_overrides, measured_workload

    drawn = groups(LengthSpec(kind="lognormal", mean=300, tailness=80, prompt_share=0.6), n=3000).tolist()
    m = measured_workload(drawn)
    assert m["groups"] == 3000 and m["mean_length"] == pytest.approx(300, rel=0.05)
    assert m["tailness"] == pytest.approx(80, rel=0.05) and m["prompt_share"] == pytest.approx(0.6, abs=0.04)
    assert as_overrides(m) == (f"--set workload.mean_length={m['mean_length']:g} --set workload.tailness={m['tailness']:g} "
                               f"--set workload.prompt_share={m['prompt_share']:g}")
    assert measured_workload([[5, 6]]) is None
