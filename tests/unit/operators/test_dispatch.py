"""StreamRL skew-aware dispatch (Algorithm 2, Eq. 2) and length rankers."""

import random

from rlflow.operators.length_ranker import OnlineLengthRanker, OracleRanker, recall_at_top
from rlflow.operators.skew_dispatch import instance_latency, percentile, skew_aware_dispatch


def test_eq2_latency_rounds():
    ptl = lambda bs: 1.0 + 0.01 * bs  # noqa: E731
    assert instance_latency(10, 100, ptl, 4) == (1.04 * 100) * 3
    assert instance_latency(0, 100, ptl, 4) == 0


def test_figure6_example_two_long_tail_samples_get_a_dedicated_instance():
    # StreamRL Figure 6: DP = 2, 2 long-tail samples twice as long as 64 regular ones
    prompts = [f"p{j}" for j in range(66)]
    lengths = [200] * 2 + [100] * 64
    ptl = lambda bs: 1.0 + 0.02 * max(0, bs - 8)  # noqa: E731  memory-bound up to 8, then linear
    plan = skew_aware_dispatch(prompts, lengths, 2, lengths, ptl, alpha=2 / 66 + 1e-9, max_batch=256)
    assert plan.long_tail == ["p0", "p1"] and (plan.n_long, plan.n_regular) == (1, 1)
    assert plan.assignment[0] == ["p0", "p1"] and len(plan.assignment[1]) == 64


def test_split_minimises_estimated_latency_and_orders_lpt():
    rng = random.Random(0)
    lengths = [rng.lognormvariate(7, 1) for _ in range(100)]
    prompts = list(range(100))
    plan = skew_aware_dispatch(prompts, lengths, 8, lengths, lambda bs: 1 + 0.05 * bs, alpha=0.2, max_batch=64)
    assert len(plan.long_tail) == 20 and plan.n_long + plan.n_regular == 8
    assert min(lengths[p] for p in plan.long_tail) >= max(lengths[p] for p in plan.regular)
    for ps in plan.assignment.values():
        assert [lengths[p] for p in ps] == sorted((lengths[p] for p in ps), reverse=True)
    # the chosen split is no worse than any other, by Eq. 2 with P90 / P50
    p90, p50 = percentile(lengths, 90), percentile(lengths, 50)
    for n_l in range(1, 8):
        t = max(instance_latency(-(-20 // n_l), p90, lambda bs: 1 + 0.05 * bs, 64),
                instance_latency(-(-80 // (8 - n_l)), p50, lambda bs: 1 + 0.05 * bs, 64))
        assert plan.latency <= t + 1e-9


def test_oracle_recall_is_perfect_and_learned_ranker_learns_a_length_signal():
    rng = random.Random(1)
    words = ["prove", "compute", "integral", "sum", "easy", "find", "show", "count"]

    def prompt(hard):
        body = " ".join(rng.choice(words) for _ in range(rng.randint(3, 8)))
        return ("hard olympiad: " if hard else "quick: ") + body

    data = [(prompt(h), (8000 if h else 500) * rng.uniform(0.7, 1.3)) for h in [rng.random() < 0.3 for _ in range(400)]]
    train, test = data[:300], data[300:]
    ranker = OnlineLengthRanker(dim=256, refit_every=100)
    assert ranker.predict(["x"]) == [0.0]
    ranker.observe([p for p, _ in train], [n for _, n in train])
    pred = ranker.predict([p for p, _ in test])
    actual = [n for _, n in test]
    hard = sum(n > 3000 for n in actual) / len(actual)  # the ranker separates difficulty, not noise within it
    assert recall_at_top(pred, actual, hard) >= 0.9
    assert recall_at_top(pred, actual, 0.2) >= 0.5
    oracle = OracleRanker(dict(test))
    assert recall_at_top(oracle.predict([p for p, _ in test]), actual) == 1.0
    assert recall_at_top([1, 2, 3, 4, 5], [5, 4, 3, 2, 1], 0.2) == 0.0
