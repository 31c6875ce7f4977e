"""The buffer and the ledger together (rlflow/runtime/buffer.py): payloads written when a group is buffered,
groups restored into the staleness policy on resume, a reward delivered twice counted once."""

from __future__ import annotations

import pytest

from rlflow.runtime.buffer import Buffer
from rlflow.runtime.ledger import Ledger
from rlflow.runtime.messages import Prompt, ScoredBatch
from rlflow.stages.trajectory import Trajectory


class Remote:
    def __init__(self, fn):
        self.remote = fn


class FakeStore:
    """The payload store's calls the buffer makes, in-process (ray.get is patched to pass values through)."""

    def __init__(self, payloads: dict[str, dict]):
        self.payloads = payloads
        self.peek = Remote(lambda tids: [self.payloads[t] for t in tids if t in self.payloads])
        self.discard = Remote(lambda tids: [self.payloads.pop(t, None) for t in tids])


def member(gid: str, i: int, version: int) -> Trajectory:
    return Trajectory(group_id=gid, index=i, prompt="p", answer="a", prompt_ids=[1], completion_ids=[1],
                      version=version, versions_seen=[version])


def batch(gid: str, rewards: list[float], version: int) -> ScoredBatch:
    n = len(rewards)
    return ScoredBatch.from_columns({"traj_id": [f"{gid}/{i}" for i in range(n)], "group_id": [gid] * n, "task": ["t"] * n,
                                     "reward": rewards, "reward_error": [""] * n, "kept": [True] * n,
                                     "v_min": [version] * n, "v_max": [version] * n})


@pytest.fixture
def setup(tmp_path, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)
    ledger = Ledger(tmp_path, eta=1, fresh=True)
    store = FakeStore({})
    counts: dict = {}
    buffer = Buffer({"kind": "in_flight_limit", "batch_size": 2, "eta": 1}, store, ledger, counts,
                    abort_group=lambda gid: None, log=lambda *a: None)
    return ledger, store, buffer, counts


def generate(ledger, store, buffer, gid: str, version: int) -> None:
    ledger.drawn(gid, Prompt(task="t", n=int(gid.split("-")[1]), prompt="p"))
    buffer.reserve(gid, version)
    for i in range(2):
        store.payloads[f"{gid}/{i}"] = member(gid, i, version)
        ledger.finished(f"{gid}/{i}", gid, version, 1)
    buffer.completed(gid, version)


def test_a_buffered_group_is_on_record_with_its_payload_and_a_second_reward_is_ignored(setup):
    ledger, store, buffer, counts = setup
    generate(ledger, store, buffer, "t-0", 0)
    buffer.rewarded_batch(batch("t-0", [1.0, 0.0], 0))
    buffer.rewarded_batch(batch("t-0", [1.0, 0.0], 0))  # Ray Data retried the bundle after its worker died
    ledger.flush()
    assert counts["duplicate_rewards"] == 1 and buffer.counters.pending == 1
    (rewards,) = ledger.db.execute("select rewards from payloads where gid='t-0'").fetchone()
    assert rewards == '{"t-0/0": 1.0, "t-0/1": 0.0}'
    assert ledger.counts() == {"buffered": 1}


def test_restore_puts_a_group_back_with_its_version_or_drops_it_above_the_bound(setup):
    ledger, _, buffer, counts = setup
    buffer.policy.version = 3  # resumed at step 3
    for n in range(3):
        ledger.drawn(f"t-{n}", Prompt(task="t", n=n, prompt="p"))
    assert buffer.restore("t-0", 2, {"t-0/0": 1.0}) == "restored"
    assert buffer.restore("t-1", 3, {"t-1/0": 0.0}) == "restored"
    assert buffer.restore("t-2", 1, {"t-2/0": 0.0}) == "dropped"  # 3 - 1 > eta 1: recorded, never trained
    ledger.flush()
    assert dict(ledger.db.execute("select gid, state from groups").fetchall())["t-2"] == "dropped"
    assert counts["dropped_groups"] == 1
    batch_ = buffer.consume()
    assert {e.gid: batch_.version - e.version for e in batch_.policy_batch.entries} == {"t-0": 1, "t-1": 0}  # as before
    assert batch_.rewards == {"t-0/0": 1.0, "t-1/0": 0.0}
    assert buffer.counters.conserved()


def test_restore_leaves_to_generation_what_the_policy_has_no_room_for(setup):
    _, _, buffer, _ = setup
    buffer.policy.version = 1
    fates = [buffer.restore(f"t-{n}", 1, {f"t-{n}/0": 1.0}) for n in range(5)]
    assert fates == ["restored"] * 4 + ["regenerate"]  # in_flight_limit: (eta + 1) * B = 4 groups


def test_the_reward_stream_carries_each_members_version_span_to_the_driver():
    import pyarrow as pa

    from rlflow.runtime.reward_stream import Score, per_trajectory

    g = {"group_id": "g", "task": "t", "prompt": "1+1=", "answer": "2", "row": "{}", "traj_id": ["g/0", "g/1"],
         "completion": ["2", "3"], "v_min": [0, 1], "v_max": [2, 1]}
    scored = Score("exact_match")(pa.Table.from_pydict({"groups": [[g]]}))
    batch = per_trajectory(scored)
    assert (batch["v_min"], batch["v_max"], batch["reward"]) == ([0, 1], [2, 1], [1.0, 0.0])
    assert batch["kept"] == [True, True]  # no filter: every group is kept


def test_the_reward_operator_applies_the_group_filter_to_the_group_it_scored():
    import pyarrow as pa

    from rlflow.runtime.reward_stream import Score, per_trajectory

    def group(gid, completions):
        return {"group_id": gid, "task": "t", "prompt": "1+1=", "answer": "2", "row": "{}",
                "traj_id": [f"{gid}/{i}" for i in range(len(completions))], "completion": completions}

    scored = Score("exact_match", filter_fn="drop_uniform_groups")(
        pa.Table.from_pydict({"groups": [[group("mixed", ["2", "3"]), group("uniform", ["3", "4"])]]}))
    batch = per_trajectory(scored)
    assert dict(zip(batch["group_id"], batch["kept"], strict=True)) == {"mixed": True, "uniform": False}


def test_auto_redundancy_admits_as_many_extra_groups_as_the_filter_drops(tmp_path, monkeypatch):
    """barrier batch_redundancy auto: none until a batch's worth of groups was scored, then B p / (1 - p) for the
    drop rate p of the recent groups (capped at 2 B); the policy then reserves that many more groups per batch."""
    import ray

    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)
    ledger, store = Ledger(tmp_path, eta=0, fresh=True), FakeStore({})
    buffer = Buffer({"kind": "synchronous", "batch_size": 4, "eta": 0, "batch_redundancy": "auto"}, store, ledger, {},
                    abort_group=lambda gid: None, log=lambda *a: None)

    def reserved() -> int:  # groups the policy admits now at version 0, beyond those it holds
        n = 0
        while buffer.verify(0):
            buffer.reserve(f"t-{100 + n}", 0)
            n += 1
        for k in range(n):
            buffer.policy.abort(f"t-{100 + k}")
            buffer.generating.discard(f"t-{100 + k}")
        return n

    assert buffer.policy.batch_redundancy == 0 and reserved() == 4
    uniform = [1.0, 1.0]  # the filter (here: the kept flag) drops a group whose rewards are uniform
    for n, kept in enumerate([True, False, False, True]):  # half of the first batch's worth dropped
        generate(ledger, store, buffer, f"t-{n}", 0)
        scored = batch(f"t-{n}", uniform if not kept else [1.0, 0.0], 0)
        if not kept:
            scored = ScoredBatch.from_columns({**{k: [getattr(r, k) for r in scored.rows] for k in
                                                  ("traj_id", "group_id", "task", "reward", "reward_error", "v_min", "v_max")},
                                               "kept": [False, False]})
        buffer.rewarded_batch(scored)
    assert buffer.policy.batch_redundancy == 4  # p = 1/2: B p / (1 - p) = 4
    assert reserved() == 4 + 4 - 2  # capacity B + 4, two entries occupied by the kept groups
    buffer._scored(False)  # more drops: p = 3/5 -> ceil(4 * 1.5) = 6
    assert buffer.policy.batch_redundancy == 6
    for _ in range(3):
        buffer._scored(False)  # p = 6/8 >= 2/3: capped at 2 B
    assert buffer.policy.batch_redundancy == 8


def test_a_fixed_redundancy_stays_fixed(setup, tmp_path):
    ledger, store, buffer, _ = setup
    fixed = Buffer({"kind": "synchronous", "batch_size": 4, "eta": 0, "batch_redundancy": 2}, store, ledger, {},
                   abort_group=lambda gid: None, log=lambda *a: None)
    for _ in range(8):
        fixed._scored(False)
    assert fixed.policy.batch_redundancy == 2
