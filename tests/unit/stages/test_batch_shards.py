"""Splitting a training batch over ranks (stages/batch_shards.py): by tokens, whole-batch normalisers."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlflow.stages import grpo
from rlflow.stages.batch_shards import balance, cost, merge_rank_metrics, shard_batch
from rlflow.stages.trajectory import Trajectory


def batch(lengths: list[int], group_size: int = 4) -> list[Trajectory]:
    rng = random.Random(len(lengths))
    return [Trajectory(group_id=f"g{i // group_size}", index=i % group_size, prompt="", answer="", prompt_ids=[1, 2],
                       completion_ids=[3] * n, behaviour_logprobs=[-1.0] * n, reward=float(rng.random() < 0.5))
            for i, n in enumerate(lengths)]


@given(st.lists(st.integers(1, 500), min_size=1, max_size=64), st.integers(1, 8))
def test_every_row_goes_to_exactly_one_rank_and_no_rank_exceeds_the_fair_share_by_more_than_one_row(costs, world):
    parts = balance(costs, world)
    assert sorted(i for p in parts for i in p) == list(range(len(costs)))
    totals = [sum(costs[i] for i in p) for p in parts]
    # greedy longest-first: the heaviest rank is over the mean by at most its last (smallest) row
    assert max(totals) <= sum(costs) / world + max(costs)
    assert balance(costs, world) == parts  # deterministic: every rank computes the same split


def test_long_tailed_lengths_are_balanced_by_tokens_not_count():
    lengths = [400] + [20] * 15  # one long completion, fifteen short
    shards = shard_batch(batch(lengths), 2, micro_batch_size=4)
    tokens = [sum(cost(t) for t in s.trajectories) for s in shards]
    assert [len(s.trajectories) for s in shards] == [1, 15]  # by count it would be 8 and 8: 540 vs 176 tokens
    assert max(tokens) / min(tokens) < 1.3
    # the same number of micro-batches on every rank (collectives): the one-row rank runs three padding passes
    assert {s.micro_batches for s in shards} == {4}


def test_advantages_and_normalisers_come_from_the_whole_batch():
    trajs = batch([5, 9, 13, 2, 7, 30, 4, 4])
    whole = grpo.batch_advantages(torch.tensor([t.reward for t in trajs]), [t.group_id for t in trajs])
    shards = shard_batch(trajs, 3, micro_batch_size=2)
    by_id = {t.traj_id: a for s in shards for t, a in zip(s.trajectories, s.advantages)}
    assert by_id == {t.traj_id: pytest.approx(float(a)) for t, a in zip(trajs, whole)}
    assert {s.num_tokens for s in shards} == {float(sum(len(t.completion_ids) for t in trajs))}
    assert {s.world_size for s in shards} == {3}


def test_rank_metrics_add_up():
    a = {"loss": 0.25, "pg_loss": 0.2, "kl": 0.0, "entropy": 1.0, "clip_frac": 0.1, "ratio_mean": 0.5,
         "importance_weight_mean": 0.5, "importance_weight_used_mean": 0.5, "importance_truncated_frac": 0.0,
         "importance_masked_frac": 0.0, "tokens": 30, "importance_weight_max": 1.5,
         "step_time_s": 2.0, "grad_norm": 3.0, "version": 4}
    b = {**a, "loss": 0.5, "tokens": 10, "importance_weight_max": 2.5, "step_time_s": 1.0}
    m = merge_rank_metrics([a, b])
    assert (m["loss"], m["tokens"], m["importance_weight_max"], m["step_time_s"]) == (0.75, 40, 2.5, 2.0)
    assert (m["grad_norm"], m["version"]) == (3.0, 4)
    assert m["rank_token_imbalance"] == pytest.approx(30 / 20)
