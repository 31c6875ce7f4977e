"""The closed-form mean staleness of queue-drop (docs/concepts/staleness.md)."""

from __future__ import annotations

import math
import random

import pytest

from rlflow.staleness_model import lognormal_sigma, predict_mean_staleness, tail_multiplier


def test_rollout_bound_total_is_pqs_plus_rho():
    p = predict_mean_staleness(rho=0.5, concurrency=64, batch=128, tail=2.0)
    assert p.pre_queue == pytest.approx(64 * 2.0 / 128)
    assert p.in_queue == pytest.approx(0.5)
    assert p.mean == pytest.approx(1.5)


def test_train_bound_uses_queue_factor():
    p = predict_mean_staleness(rho=2.0, concurrency=64, batch=128, tail=1.0, queue_factor=2)
    assert p.pre_queue == pytest.approx(64 / (2.0 * 128))
    assert p.in_queue == pytest.approx((2 * 2 + 2.0 - 1) / (2 * 2.0))


def test_the_two_branches_meet_at_rho_one_for_q_one():
    below = predict_mean_staleness(rho=1 - 1e-9, concurrency=10, batch=10, tail=1.5)
    above = predict_mean_staleness(rho=1 + 1e-9, concurrency=10, batch=10, tail=1.5)
    assert below.mean == pytest.approx(above.mean, abs=1e-6)


def test_smaller_queue_lowers_staleness_when_train_bound():
    q1 = predict_mean_staleness(rho=1.5, concurrency=10, batch=10, tail=1, queue_factor=1)
    q2 = predict_mean_staleness(rho=1.5, concurrency=10, batch=10, tail=1, queue_factor=2)
    assert q1.mean < q2.mean


@pytest.mark.parametrize("bad", [dict(rho=0), dict(rho=1, queue_factor=0.5)])
def test_rejects_inputs_outside_the_model(bad):
    args = dict(rho=1, concurrency=1, batch=1, tail=1) | bad
    with pytest.raises(ValueError):
        predict_mean_staleness(**args)


def test_tail_multiplier_is_one_without_tail_or_group():
    assert tail_multiplier(0, 16) == 1.0
    assert tail_multiplier(90, 1) == 1.0


@pytest.mark.parametrize("tailness, group", [(50, 4), (90, 16)])
def test_tail_multiplier_matches_monte_carlo(tailness, group):
    rng, sigma, n = random.Random(1), lognormal_sigma(tailness), 20000
    draws = [math.exp(sigma * rng.gauss(0, 1) - sigma**2 / 2) for _ in range(n * group)]
    mc = sum(max(draws[i * group:(i + 1) * group]) for i in range(n)) / n / (sum(draws) / len(draws))
    assert tail_multiplier(tailness, group) == pytest.approx(mc, rel=0.02)


def test_cap_lowers_the_tail():
    assert tail_multiplier(90, 16, cap=3.0) < tail_multiplier(90, 16)
