"""The simulator against the closed-form staleness model (docs/concepts/staleness.md), and the queue-max length bias.

The full grid lives in benchmarks/sim_validation.py; this pins a representative subset.
"""

from __future__ import annotations

import pytest

from rlflow.sim import simulate
from rlflow.sim.slots import closed_form_config, closed_form_prediction

TOLERANCE = 0.3  # steps of staleness, as the model's authors report for their simulator


@pytest.mark.parametrize(
    "rho, q, tailness, c_over_b",
    [
        (0.5, 1, 0, 1),  # rollout-bound, fixed lengths
        (0.5, 2, 50, 2),
        (0.75, 5, 90, 0.5),
        (0.75, 1, 90, 2),
        (1.5, 1, 50, 0.5),  # train-bound
        (1.5, 5, 90, 1),
        (2.0, 2, 50, 2),
        (2.0, 5, 90, 0.5),
    ],
)
def test_queue_drop_mean_staleness_matches_the_closed_form(rho, q, tailness, c_over_b):
    result = simulate(closed_form_config(rho=rho, q=q, tailness=tailness, c_over_b=c_over_b))
    assert result.predicted is not None
    assert result.predicted.rho == pytest.approx(rho)
    assert abs(result.mean_staleness - result.predicted.mean) < TOLERANCE


def test_prediction_applies_only_to_queue_drop_in_slots_mode():
    assert closed_form_prediction(closed_form_config(rho=1.5, q=2, tailness=50, c_over_b=1)) is not None
    assert closed_form_prediction(closed_form_config(rho=1.5, q=2, tailness=50, c_over_b=1, policy="queue_max", eta=2)) is None


def test_staleness_depends_on_tailness_not_on_mean_length():
    short = simulate(closed_form_config(rho=1.5, q=2, tailness=50, c_over_b=1, mean_length=500))
    long = simulate(closed_form_config(rho=1.5, q=2, tailness=50, c_over_b=1, mean_length=4000))
    heavier = simulate(closed_form_config(rho=1.5, q=2, tailness=90, c_over_b=1, mean_length=500))
    assert long.mean_staleness == pytest.approx(short.mean_staleness, abs=0.1)
    assert heavier.mean_staleness > short.mean_staleness + 0.3


def test_smaller_queue_lowers_staleness_when_train_bound():
    by_q = [simulate(closed_form_config(rho=2.0, q=q, tailness=50, c_over_b=1)).mean_staleness for q in (1, 2, 5)]
    assert by_q[0] < by_q[1] < by_q[2]


def _bias(policy: str, tailness: float, eta: int | None = None) -> float:
    config = closed_form_config(rho=2.0, q=2, tailness=tailness, c_over_b=1, policy=policy, eta=eta, steps=200, warmup_steps=40)
    return simulate(config).length_bias


def test_queue_drop_trains_on_the_sampled_length_distribution():
    assert abs(_bias("queue_drop", 90)) < 0.02


def test_queue_max_trains_on_shorter_samples_more_so_when_stricter_and_heavier_tailed():
    strict_heavy, loose_heavy, strict_mild = _bias("queue_max", 90, eta=1), _bias("queue_max", 90, eta=3), _bias("queue_max", 50, eta=1)
    assert strict_heavy < loose_heavy < -0.05
    assert strict_heavy < strict_mild < -0.05
