"""Ray Data carries the stream: the prompt source (lazy, seeded, weighted) and a reward stage's live stream."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import queue
import signal
import time

import pytest

from rlflow.errors import PipelineInvalid
from rlflow.runtime.messages import Rewarded, StreamFailed

pytestmark = pytest.mark.integration
HANG_GUARD_S = 60  # a ceiling against hangs, not a performance claim


def tokenize(text, add_special_tokens=True):
    return {"input_ids": list(text.encode())}


def source(tasks: dict, *, seed=0, skip=None, max_model_len=64, max_new=8):
    from rlflow.runtime.prompt_source import PromptSource

    return PromptSource(tasks, tokenize, max_new_tokens={t: max_new for t in tasks}, max_model_len=max_model_len,
                        seed=seed, source="pipe.yaml", skip=skip)


def write_jsonl(path, n: int, pad: str = "") -> str:
    with open(path, "w") as f:
        f.writelines(f'{{"prompt": "{i}+{i % 97}=", "answer": "{i + i % 97}", "id": {i}{pad}}}\n' for i in range(n))
    return str(path)


def rss_mib() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# ---------------------------------------------------------------- prompt source


def test_million_row_jsonl_starts_fast_with_bounded_memory(ray_cluster, tmp_path):
    big = write_jsonl(tmp_path / "big.jsonl", 1_000_000, pad=', "pad": "' + "x" * 60 + '"')
    size_mib = os.path.getsize(big) / 2**20
    warm = source({"main": {"source": write_jsonl(tmp_path / "warm.jsonl", 300)}})  # imports and threads first
    [warm.next(["main"]) for _ in range(400)]
    warm.close()
    before, t0 = rss_mib(), time.monotonic()
    ps = source({"main": {"source": big}})
    first = ps.next(["main"])
    first_s = time.monotonic() - t0
    ids = [first.row["id"]] + [ps.next(["main"]).row["id"] for _ in range(4999)]
    growth = rss_mib() - before
    ps.close()
    assert first_s < HANG_GUARD_S
    assert growth < size_mib / 4, f"driver RSS grew {growth:.0f} MiB reading a {size_mib:.0f} MiB file"
    assert len(set(ids)) == 5000 and ids != sorted(ids)
    assert first.prompt_ids == list(first.prompt.encode()) and first.n == 0


def test_order_is_seeded_shuffled_and_resumable(ray_cluster, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", 50)
    tasks = {"main": {"source": path}}

    def draw(n, **kw):
        ps = source(tasks, **kw)
        rows = [ps.next(["main"]) for _ in range(n)]
        position = ps.position()
        ps.close()
        return [r.row["id"] for r in rows], rows, position

    ids, rows, position = draw(120)
    assert ids == draw(120)[0]  # same seed, same order
    assert ids[:50] != draw(50, seed=1)[0]  # another seed, another order
    assert ids[:50] != list(range(50)) and sorted(ids[:50]) == list(range(50))  # shuffled, each row once an epoch
    assert sorted(ids[50:100]) == list(range(50)) and ids[50:100] != ids[:50]  # epoch 2: reshuffled (seed + 1)
    assert [r.n for r in rows] == list(range(120)) and position == {"main": 120}
    resumed, rrows, rpos = draw(40, skip={"main": 70})  # skip crosses an epoch boundary
    assert resumed == ids[70:110] and rrows[0].n == 70 and rpos == {"main": 110}


def test_two_tasks_by_weight_three_to_one(ray_cluster, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"q": [f"w{i}" for i in range(64)], "a": ["x"] * 64}), tmp_path / "words.parquet")
    words = {"source": str(tmp_path / "words.parquet"), "weight": 1.0, "prompt_field": "q", "answer_field": "a"}
    tasks = {"arith": {"source": "builtin:arith", "weight": 3.0}, "words": words}
    ps = source(tasks)
    drawn = [ps.next(["arith", "words"]) for _ in range(400)]
    assert collections.Counter(p.task for p in drawn) == {"arith": 300, "words": 100}
    assert [p.task for p in drawn[:8]] == ["arith", "arith", "words", "arith"] * 2  # smooth: interleaved
    assert all(p.row["q"] == p.prompt for p in drawn if p.task == "words")
    assert ps.next(["words"]).task == "words" and ps.position() == {"arith": 300, "words": 101}
    ps.close()


def test_bad_data_is_a_pipeline_error_before_the_run_and_a_named_stop_during_it(ray_cluster, tmp_path):
    from rlflow.runtime.prompt_source import BadRow

    with pytest.raises(PipelineInvalid) as e:
        source({"main": {"source": str(tmp_path / "missing.jsonl")}})
    assert [(p.rule, p.loc) for p in e.value.problems] == [("missing-file", ("data", "source"))]

    (tmp_path / "cols.jsonl").write_text("".join(json.dumps({"question": "q", "answer": "a"}) + "\n" for _ in range(5)))
    ps = source({"qa": {"source": str(tmp_path / "cols.jsonl")}})
    with pytest.raises(BadRow) as e:
        ps.next(["qa"])
    p = e.value.problem
    assert (p.rule, p.loc) == ("missing-prompt", ("data", "tasks", "qa", "source"))
    assert f"'{tmp_path / 'cols.jsonl'}' line 1 has no prompt" in p.message
    ps.close()

    good = [json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(3000)]
    broken = good[:2499] + ['{"prompt": oops'] + good[2499:]  # line 2500, far past any block's start
    (tmp_path / "broken.jsonl").write_text("\n".join(broken) + "\n")
    ps = source({"main": {"source": str(tmp_path / "broken.jsonl")}})
    with pytest.raises(BadRow) as e:
        [ps.next(["main"]) for _ in range(3001)]
    p = e.value.problem
    assert p.rule == "bad-data" and f"cannot read '{tmp_path / 'broken.jsonl'}' line 2500: not JSON" in p.message
    ps.close()

    ps = source({"main": {"source": write_jsonl(tmp_path / "long.jsonl", 20)}}, max_model_len=12, max_new=8)
    with pytest.raises(BadRow) as e:
        [ps.next(["main"]) for _ in range(20)]
    p = e.value.problem
    assert p.rule == "prompt-too-long" and f"'{tmp_path / 'long.jsonl'}' line " in p.message
    ps.close()


# ---------------------------------------------------------------- reward stream

def row_reward(completion, answer, *, prompt, row):
    """Reward for the tests: sees the prompt and the whole data row; raises on one completion."""
    if completion == "boom":
        raise ValueError("cannot score boom")
    assert prompt == row["prompt"]
    return (1.0 if completion == answer else 0.0) + row.get("bonus", 0.0)


def pid_reward(completion, answer, row):
    """Reward for the tests: records its process id, can be slow, can kill its own process."""
    with open(row["pidfile"], "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(row.get("sleep", 0.0))
    if row.get("die"):
        os._exit(1)
    return 1.0


def pids(path: str) -> list[int]:
    with open(path) as f:
        return [int(p) for p in f.read().split()]


def put_group(store, gid: str, completions: list[str], *, stage="score", task="arith", **row):
    import ray

    from rlflow.stages.trajectory import Trajectory

    row = {"prompt": "1+1=", "answer": "2", **row}
    trajs = [Trajectory(group_id=gid, index=i, prompt="1+1=", answer="2", prompt_ids=[1], completion=c, task=task,
                        row=row) for i, c in enumerate(completions)]
    ray.get(store.put.remote(trajs))
    ray.get(store.enqueue_group.remote(stage, [f"{gid}/{i}" for i in range(len(completions))]))


@contextlib.contextmanager
def stream(reward_fn: str, filter_fn: str | None = None, stage: str = "score"):
    import ray

    from rlflow.runtime.payload_store import PayloadStore
    from rlflow.runtime.reward_stream import RewardStream

    store = PayloadStore.remote()
    rs = RewardStream(store, stage=stage, reward_fn=reward_fn, filter_fn=filter_fn, concurrency=1, num_cpus=0.25)
    out: queue.Queue = queue.Queue()
    rs.start(out)
    try:
        yield store, rs, out
    finally:
        rs.close()
        ray.kill(store)


def collect(out: queue.Queue, n_trajs: int, timeout_s: float = HANG_GUARD_S) -> dict:
    """traj_id -> its output row; fails on an error event or a trajectory delivered twice."""
    got, deadline = {}, time.monotonic() + timeout_s
    while len(got) < n_trajs:
        event = out.get(timeout=max(deadline - time.monotonic(), 0.01))
        assert isinstance(event, Rewarded), event
        for row in event.batch.rows:
            assert row.traj_id not in got, f"{row.traj_id} delivered twice"
            got[row.traj_id] = dataclasses.asdict(row)
    return got


def next_error(out: queue.Queue, timeout_s: float = HANG_GUARD_S):
    deadline = time.monotonic() + timeout_s
    while True:
        event = out.get(timeout=max(deadline - time.monotonic(), 0.01))
        if isinstance(event, StreamFailed):
            return event.stage, str(event.error)


def test_reward_stream_scores_filters_and_contains_failures(ray_cluster):
    with stream("test_streams:row_reward", "drop_uniform_groups") as (store, _, out):
        put_group(store, "mixed", ["2", "3"], bonus=0.5)
        put_group(store, "uniform", ["2", "2"], task="repeat")
        put_group(store, "failing", ["boom", "2", "3"])
        got = collect(out, 7)
    assert set(got["mixed/0"]) == {"group_id", "traj_id", "task", "reward", "reward_error", "kept", "v_min", "v_max"}
    assert (got["mixed/0"]["v_min"], got["mixed/0"]["v_max"]) == (0, 0)  # each member's version span, for the ledger
    assert (got["mixed/0"]["reward"], got["mixed/1"]["reward"]) == (1.5, 0.5)  # the row reached the reward
    assert got["mixed/0"]["kept"] and not got["uniform/0"]["kept"] and got["uniform/1"]["task"] == "repeat"
    assert got["failing/0"]["reward_error"] == "test_streams:row_reward raised ValueError: cannot score boom"
    assert got["failing/1"]["reward_error"] == "" and got["failing/1"]["reward"] == 1.0
    assert got["failing/0"]["kept"]  # judged on the members that scored: 1.0 and 0.0 differ


def test_group_flows_while_stream_open(ray_cluster):
    """Guards the live-source workaround (reward_stream.one_row_per_block): without it nothing arrives until the
    stream ends."""
    import ray

    with stream("exact_match") as (store, rs, out):
        mine, default = ray.get(rs.host.block_sizes.remote())  # in the host actor's process, which runs the stream
        assert mine == 1 and default != 1  # restored for every other dataset
        put_group(store, "first", ["2"])
        try:
            collect(out, 1)  # includes start-up
        except queue.Empty:
            pytest.fail("a group put in the store never reached the output while the stream stayed open: Ray Data "
                        "merges read-side blocks again (see rlflow/runtime/reward_stream.py one_row_per_block)")
        for k in range(3):
            t0 = time.monotonic()
            put_group(store, f"g{k}", ["2", "1"])
            collect(out, 2, timeout_s=10)
            assert time.monotonic() - t0 < 10 and rs._thread.is_alive()
        assert len(ray.get(store.readers.remote("score"))) == 1


def test_back_pressure_keeps_unscored_groups_in_the_store(ray_cluster, tmp_path):
    import ray

    from rlflow.runtime.reward_stream import IN_FLIGHT_PER_ACTOR

    with stream("test_streams:pid_reward") as (store, _, out):
        for k in range(150):
            put_group(store, f"g{k}", ["a"], pidfile=str(tmp_path / "pids"), sleep=0.02)
        first = collect(out, 1)
        counts = ray.get(store.counts.remote("score"))
        assert counts["pulled"] - counts["delivered"] <= IN_FLIGHT_PER_ACTOR  # concurrency 1
        assert counts["pending"] > 0  # the rest wait in the store, not in Ray Data's queues
        got = collect(out, 150 - len(first))  # the first bundle holds up to MAX_GROUPS_PER_PULL groups
    assert len(got) + len(first) == 150 and not set(got) & set(first)


def test_stream_ended_early_reports_its_stage(ray_cluster):
    import ray

    with stream("exact_match", stage="grade") as (store, _, out):
        put_group(store, "g", ["2"], stage="grade")
        collect(out, 1)
        ray.get(store.close.remote())  # the source ends, but nobody closed the stream
        stage, message = next_error(out)
    assert stage == "grade" and "reward stream 'grade'" in message and "not closed" in message


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_killed_reward_worker_is_survived_without_loss(ray_cluster, tmp_path):
    """Ray Data restarts a killed reward actor (the Score actor, parent of the process the reward runs in) and
    retries its batch: every trajectory arrives exactly once."""
    pidfile = str(tmp_path / "pids")
    with stream("test_streams:pid_reward") as (store, _, out):
        put_group(store, "warm", ["a"], pidfile=pidfile)
        collect(out, 1)
        for k in range(3):
            put_group(store, f"slow{k}", ["a", "b"], pidfile=pidfile, sleep=0.5)
        time.sleep(1.0)  # the actor is inside the slow groups now
        victim = parent_of(pids(pidfile)[-1])
        os.kill(victim, signal.SIGKILL)
        for k in range(3):
            put_group(store, f"after{k}", ["a", "b"], pidfile=pidfile)
        got = collect(out, 12)  # 12 more, none twice
    assert len(got) == 12 and all(r["reward"] == 1.0 and not r["reward_error"] for r in got.values())
    assert set(pids(pidfile)) - {victim}  # scored by a restarted actor


def test_killed_source_worker_is_reported(ray_cluster):
    import ray

    with stream("exact_match") as (store, _, out):
        put_group(store, "g", ["2"])
        collect(out, 1)
        (reader,) = ray.get(store.readers.remote("score"))
        t0 = time.monotonic()
        os.kill(reader, signal.SIGKILL)
        stage, message = next_error(out)
    assert stage == "score" and "reward stream 'score'" in message and "died" in message
    assert time.monotonic() - t0 < HANG_GUARD_S


def test_a_row_that_kills_its_reward_process_fails_only_its_trajectory(ray_cluster, tmp_path):
    """os._exit in the reward on one row: that trajectory fails by name (the reward's process was replaced, the
    row tried once more), the actor lives and Ray Data replays nothing."""
    pidfile = str(tmp_path / "pids")
    with stream("test_streams:pid_reward") as (store, _, out):
        put_group(store, "poison", ["a"], pidfile=pidfile, die=True)
        put_group(store, "after", ["a", "b"], pidfile=pidfile)
        got = collect(out, 3)
    assert got["poison/0"]["reward_error"] == (
        "test_streams:pid_reward killed its process (exit code 1) on trajectory poison/0 of task 'arith' (prompt "
        "'1+1='), twice; this trajectory fails, the stage goes on")
    assert got["after/0"]["reward"] == got["after/1"]["reward"] == 1.0
    assert len({parent_of_or_none(p) for p in pids(pidfile)} - {None}) <= 1  # one Score actor throughout


def parent_of_or_none(pid: int) -> int | None:
    try:
        return parent_of(pid)
    except OSError:  # the dead ones
        return None


def test_a_reward_that_hangs_on_every_row_stops_its_stage_in_a_few_timeouts(ray_cluster, monkeypatch):
    """Not minutes of timeouts (a window of 64 trajectories): TIMEOUTS_IN_A_ROW of them, naming the reward and the
    row it hung on."""
    from rlflow.runtime import reward_stream

    monkeypatch.setattr(reward_stream, "REWARD_TIMEOUT_S", 1.0)
    with stream("rewards_for_tests:hangs_on") as (store, _, out):
        put_group(store, "warm", ["2"])
        collect(out, 1)  # start-up is not part of the bound
        t0 = time.monotonic()
        for k in range(4):
            put_group(store, f"stuck{k}", ["2", "2"], hang=True)
        stage, message = next_error(out)
        took = time.monotonic() - t0
    assert stage == "score" and message.startswith("rewards_for_tests:hangs_on timed out on 3 calls in a row (1 s each; "
                                                   "the last on trajectory stuck1/0 of task 'arith' (prompt '1+1='))")
    assert took < 20, took  # 3 timeouts of 1 s and their process restarts; generous
