"""Skew-aware dispatch as `rlflow run` drives it (rlflow/runtime/dispatch_lanes.py): lanes, caps, LPT, learning."""

from __future__ import annotations

import pytest

from rlflow.operators.length_ranker import OnlineLengthRanker, OracleRanker
from rlflow.operators.policy import InvariantViolation
from rlflow.runtime.dispatch_lanes import DispatchLanes

LENGTHS = {f"p{k}": float(k) for k in range(1, 11)}  # prompt p_k produces k tokens


def make(ranker, *, members=1, max_running=8, ptl=lambda bs: 1.0):
    counts: dict = {}
    return DispatchLanes(ranker, alpha=0.2, members=members, max_running=max_running,
                           ptl=lambda bs, held=0.0: ptl(bs), counts=counts, log=lambda *a: None), counts


def waiting(*names):
    return {f"g{n}": n for n in names}  # gid -> prompt text


def test_no_split_until_the_ranker_has_seen_a_completed_group():
    d, counts = make(OnlineLengthRanker())
    d.plan(waiting(*LENGTHS), n_alive=4)
    everyone = frozenset({0, 1, 2, 3})
    assert d.lanes([0, 1, 2, 3]) == [("long", everyone, 8), ("regular", everyone, 8)]  # no split
    assert d.head(waiting(*LENGTHS), "long") is None
    assert d.head(waiting(*LENGTHS), "regular") == "gp1"  # input order while nothing is known
    assert counts["dispatch_plans"] == 0


def test_hand_worked_split_lanes_cap_and_lpt_order():
    # 10 prompts predicted 1..10 tokens, alpha 0.2: p10 and p9 are the long tail. Flat PTL, so an instance
    # takes L_avg * ceil(M / BS): recent lengths 1..10 give P90 = 9.1 (long) and P50 = 5.5 (regular).
    # N_l = 1: max(9.1 * ceil(2/2), 5.5 * ceil(3/3)) = 9.1; N_l = 2 and 3 also give 9.1, so the first wins.
    d, counts = make(OracleRanker(LENGTHS))
    d.recent.extend(range(1, 11))
    w = waiting(*LENGTHS)
    d.plan(w, n_alive=4)
    assert d.n_long == 1 and d.long == {"gp10", "gp9"}
    assert d.lanes([0, 1, 2, 3]) == [("long", frozenset({0}), 2), ("regular", frozenset({1, 2, 3}), 8)]
    assert d.head(w, "long") == "gp10" and d.head(w, "regular") == "gp8"  # longest predicted first
    del w["gp10"]
    assert d.head(w, "long") == "gp9"
    d.routed("gp10")
    d.routed("gp8")
    assert counts["dispatch_long_groups"] == 1 and counts["dispatch_long_instances"] == 1


def test_a_group_outside_its_lane_is_an_invariant_violation():
    d, _ = make(OracleRanker(LENGTHS))
    d.recent.extend(range(1, 11))
    d.plan(waiting(*LENGTHS), n_alive=4)
    d.check_lane("gp10", 0, d.lanes([0, 1, 2, 3]))
    d.check_lane("gp8", 3, d.lanes([0, 1, 2, 3]))
    with pytest.raises(InvariantViolation, match=r"group gp10 \(long lane, instances \[0\]\) was routed to instance 2"):
        d.check_lane("gp10", 2, d.lanes([0, 1, 2, 3]))
    with pytest.raises(InvariantViolation, match="regular lane"):
        d.check_lane("gp8", 0, d.lanes([0, 1, 2, 3]))


def test_a_group_is_several_trajectories_on_one_instance():
    # 4 members per group: the long lane's cap is its share of long-tail groups times the group size,
    # and PTL is asked for trajectories, not groups
    asked = []
    d, _ = make(OracleRanker(LENGTHS), members=4, max_running=64, ptl=lambda bs: asked.append(bs) or 1.0)
    d.recent.extend(range(1, 11))
    d.plan(waiting(*LENGTHS), n_alive=4)
    assert d.lanes([0, 1, 2, 3])[0] == ("long", frozenset({0}), 8)
    assert asked and all(bs % 4 == 0 for bs in asked)


def test_lanes_follow_the_alive_instances():
    d, _ = make(OracleRanker(LENGTHS))
    d.recent.extend(range(1, 11))
    d.plan(waiting(*LENGTHS), n_alive=4)
    assert d.lanes([1, 2, 3]) == [("long", frozenset({1}), 2), ("regular", frozenset({2, 3}), 8)]
    # one instance left: nothing to split, and a group already marked long-tail may still run there
    assert d.lanes([3]) == [("long", frozenset({3}), 8), ("regular", frozenset({3}), 8)]
    d.check_lane("gp10", 3, d.lanes([3]))


def test_the_learned_ranker_sends_the_prompts_it_learned_are_long_to_the_long_lane():
    # prompts of many words produce long answers; the ranker learns that from completed groups
    d, counts = make(OnlineLengthRanker(refit_every=8))
    train = {f"t{k}": " ".join(["word"] * k) for k in range(1, 41)}
    for gid, text in train.items():
        d.plan({gid: text}, n_alive=4)
        d.completed(gid, [3 * len(text.split())] * 2)
    assert counts["ranker_observed"] == 40
    fresh = {f"n{k}": " ".join(["word"] * k) for k in (2, 5, 33, 8, 37, 12, 3, 21, 6, 15)}
    d.plan(fresh, n_alive=4)
    assert d.long == {"n37", "n33"}
    assert d.head(fresh, "long") == "n37"


def test_recall_is_reported_once_enough_groups_completed():
    d, _ = make(OracleRanker(LENGTHS))
    d.recent.extend(range(1, 11))
    assert d.recall() is None
    for _ in range(2):
        w = waiting(*LENGTHS)
        d.plan(w, n_alive=4)
        for gid, prompt in w.items():
            d.completed(gid, [int(LENGTHS[prompt])])
    assert d.recall() == pytest.approx(1.0)  # the oracle ranks perfectly


def test_forgotten_groups_leave_no_trace():
    d, _ = make(OracleRanker(LENGTHS))
    d.recent.extend(range(1, 11))
    d.plan(waiting(*LENGTHS), n_alive=4)
    d.forget("gp10")
    assert "gp10" not in d.long and "gp10" not in d.info
    d.completed("gp10", [])  # a late report for it changes nothing
    assert len(d.scored) == 0


def test_waiting_prompts_are_predicted_again_only_after_a_refit():
    class Counting(OnlineLengthRanker):
        predicted = 0

        def predict(self, prompts):
            Counting.predicted += len(prompts)
            return super().predict(prompts)

    d, _ = make(Counting(refit_every=2))
    w = {f"w{k}": "word " * k for k in range(1, 6)}
    d.plan(w, n_alive=2)
    assert Counting.predicted == 5
    d.plan({"a": "x"}, n_alive=2)  # first completion: the ranker fits, the waiting set is predicted again
    d.completed("a", [4])
    d.plan(w, n_alive=2)
    assert Counting.predicted == 5 + 1 + 5
    d.plan({"b": "xx"}, n_alive=2)
    d.completed("b", [8])  # one observation since the fit: refit_every=2 not reached, predictions stand
    d.plan(w, n_alive=2)
    assert Counting.predicted == 11 + 1
    assert d.dirty is False
