"""Length distributions and config validation of the simulator."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rlflow.sim.config import LengthSpec, SimConfig, SimConfigError, TrainerModel
from rlflow.sim.lengths import LengthSampler, expected_length, group_tail_multiplier, load_recorded
from rlflow.staleness_model import tail_multiplier


def _draw(spec, n=200_000, seed=0):
    return np.asarray(LengthSampler(spec, np.random.default_rng(seed)).draw(n))


def test_fixed_lengths_are_constant():
    assert set(_draw(LengthSpec(kind="fixed", mean=512), n=100).tolist()) == {512}


def test_lognormal_keeps_the_mean_and_grows_its_tail_with_tailness():
    mild = _draw(LengthSpec(kind="lognormal", mean=1000, tailness=30))
    heavy = _draw(LengthSpec(kind="lognormal", mean=1000, tailness=90))
    assert mild.mean() == pytest.approx(1000, rel=0.01)
    assert heavy.mean() == pytest.approx(1000, rel=0.03)
    assert np.percentile(heavy, 99) > 2 * np.percentile(mild, 99)
    assert heavy.dtype.kind == "i"


def test_cap_bounds_lengths_and_expected_length_accounts_for_it():
    spec = LengthSpec(kind="lognormal", mean=1000, tailness=90, cap=2000)
    drawn = _draw(spec)
    assert drawn.max() == 2000
    assert drawn.mean() == pytest.approx(expected_length(spec), rel=0.01)
    assert expected_length(spec) < 1000


def test_sampler_is_deterministic_per_seed():
    spec = LengthSpec(kind="lognormal", mean=100, tailness=50)
    assert _draw(spec, 1000, seed=3).tolist() == _draw(spec, 1000, seed=3).tolist()
    assert _draw(spec, 1000, seed=3).tolist() != _draw(spec, 1000, seed=4).tolist()


@pytest.mark.parametrize("fmt", ["lines", "json"])
def test_recorded_lengths_load_in_both_formats(tmp_path, fmt):
    values = [10, 20, 20, 400]
    path = tmp_path / "lengths.txt"
    path.write_text(json.dumps(values) if fmt == "json" else "\n".join(map(str, values)) + "\n")
    assert load_recorded(path).tolist() == values
    spec = LengthSpec(kind="file", path=str(path))
    assert set(_draw(spec, 2000).tolist()) == set(values)
    assert expected_length(spec) == pytest.approx(112.5)


def test_tail_multiplier_of_recorded_lengths_is_the_exact_order_statistic(tmp_path):
    path = tmp_path / "l.txt"
    path.write_text("1\n3\n")
    # max of 2 draws from {1, 3}: 1 with prob 1/4, else 3 -> 2.5; mean 2
    assert group_tail_multiplier(LengthSpec(kind="file", path=str(path)), 2) == pytest.approx(1.25)


def test_group_tail_multiplier_matches_the_closed_form_module():
    spec = LengthSpec(kind="lognormal", mean=1000, tailness=50, cap=8000)
    assert group_tail_multiplier(spec, 8) == tail_multiplier(50, 8, cap=8000, mean=1000)
    drawn = _draw(spec, 80_000).reshape(-1, 8)
    assert drawn.max(axis=1).mean() / drawn.mean() == pytest.approx(group_tail_multiplier(spec, 8), rel=0.02)


def test_bad_length_file_is_rejected(tmp_path):
    path = tmp_path / "l.txt"
    path.write_text("5\n0\n")
    with pytest.raises(SimConfigError, match="at least one length"):
        load_recorded(path)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mode": "warp"}, "mode: unknown"),
        ({"weight_sync": "per_instance"}, "slots mode models"),
        ({"mode": "cost_model"}, "profile: cost_model mode needs"),
        ({"warmup_steps": 100, "steps": 100}, "warmup_steps"),
        ({"slots": 2, "instances": 4}, "cannot be spread"),
    ],
)
def test_config_errors_name_the_field(kwargs, message):
    with pytest.raises(SimConfigError, match=message):
        SimConfig(**kwargs)


def test_trainer_model_fixed_or_linear_in_tokens():
    assert TrainerModel(t_step=2.0).step_time(10**6) == 2.0
    assert TrainerModel(base_s=1.0, s_per_token=1e-3).step_time(2000) == pytest.approx(3.0)
    with pytest.raises(SimConfigError):
        TrainerModel(t_step=None)
