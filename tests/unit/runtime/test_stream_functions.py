"""The pure parts of the streams: smooth weighted round-robin over tasks, the reward-signature adapter, the
group filter's verdict and the reward stream's output shape (no Ray started)."""

from __future__ import annotations

import collections
import functools
import math

import pyarrow as pa

from rlflow.runtime.prompt_source import wrr_pick, wrr_state
from rlflow.runtime.reward_call import filter_verdict, reward_caller
from rlflow.runtime.reward_stream import per_trajectory


def picks(weights: dict, n: int, tasks=None, current=None) -> list[str]:
    current = {} if current is None else current
    return [wrr_pick(current, weights, list(tasks or weights)) for _ in range(n)]


def test_round_robin_is_smooth_exact_and_deterministic():
    w = {"a": 3.0, "b": 1.0}
    assert picks(w, 8) == ["a", "a", "b", "a"] * 2
    assert picks(w, 8) == picks(w, 8)
    three = {"x": 1.0, "y": 2.0, "z": 5.0}
    assert collections.Counter(picks(three, 800)) == {"x": 100, "y": 200, "z": 500}
    assert picks({"a": 1.0, "b": 1.0}, 4) == ["a", "b", "a", "b"]  # ties go to the earlier task


def test_round_robin_over_a_subset_draws_only_from_it():
    w = {"a": 3.0, "b": 1.0, "c": 4.0}
    assert set(picks(w, 20, tasks=["b", "c"])) == {"b", "c"}
    assert picks(w, 3, tasks=["b"]) == ["b"] * 3


def test_round_robin_state_is_restored_from_counts():
    w = {"a": 3.0, "b": 1.0, "c": 0.5}
    current: dict = {}
    first = picks(w, 37, current=current)
    restored = wrr_state(w, collections.Counter(first))
    assert all(math.isclose(restored[t], current[t], abs_tol=1e-9) for t in w)
    assert picks(w, 50, current=restored) == picks(w, 50, current=current)


def test_reward_caller_passes_only_what_the_function_takes():
    seen = []

    def plain(completion, answer):
        return float(completion == answer)

    def with_row(completion, answer, row):
        seen.append(row)
        return 1.0

    def with_prompt(completion, answer, *, prompt):
        seen.append(prompt)
        return 2.0

    def with_kwargs(completion, answer, **extra):
        seen.append(sorted(extra))
        return 3.0

    class Callable:
        def __call__(self, completion, answer, prompt=None):
            seen.append(prompt)
            return 4.0

    args = ("7", "7", "3+4=", {"prompt": "3+4=", "answer": "7"})
    assert reward_caller(plain)(*args) == 1.0
    assert reward_caller(with_row)(*args) == 1.0 and seen.pop() == args[3]
    assert reward_caller(with_prompt)(*args) == 2.0 and seen.pop() == "3+4="
    assert reward_caller(with_kwargs)(*args) == 3.0 and seen.pop() == ["prompt", "row"]
    assert reward_caller(Callable())(*args) == 4.0 and seen.pop() == "3+4="
    assert reward_caller(functools.partial(with_row))(*args) == 1.0 and seen.pop() == args[3]


def test_filter_verdict_judges_the_members_that_scored():
    def differ(rewards):
        return len(set(rewards)) > 1

    assert filter_verdict(differ, [1.0, 0.0], ["", ""])
    assert not filter_verdict(differ, [1.0, 1.0, float("nan")], ["", "", "raised"])
    assert filter_verdict(None, [1.0], [""]) and not filter_verdict(None, [float("nan")], ["raised"])


def test_output_batch_has_one_entry_per_trajectory():
    g = {"group_id": "g", "task": "t", "traj_id": ["g/0", "g/1"], "reward": [1.0, 0.0], "reward_error": ["", "x"],
         "kept": True}
    batch = per_trajectory(pa.Table.from_pydict({"groups": [[g], [{**g, "group_id": "h", "traj_id": ["h/0", "h/1"]}]]}))
    assert batch == {"group_id": ["g", "g", "h", "h"], "traj_id": ["g/0", "g/1", "h/0", "h/1"], "task": ["t"] * 4,
                     "reward": [1.0, 0.0] * 2, "reward_error": ["", "x"] * 2, "kept": [True] * 4}
