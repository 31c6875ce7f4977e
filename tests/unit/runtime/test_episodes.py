"""Multi-turn episodes (rlflow/runtime/episodes.py) on the real tiny model and HFEngine: turns, the loss mask,
V_traj across turns, environments running while the engine generates, interruption with the environment inside
the trajectory, and (property test) conservation and mask invariants over random turn sequences."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine_helpers import trajectories
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlflow.runtime.episodes import Episodes
from rlflow.stages import tasks
from rlflow.stages.engine_hf import HFEngine
from rlflow.stages.environment import Environment, EnvStep
from rlflow.stages.trajectory import Trajectory

OBSERVATION = " ab"
STOP = (" ",)  # the repeat model writes words separated by spaces: every turn that goes on past a word is a tool call


class Counter(Environment):
    """Answers every call with the same observation and counts its calls (state that must survive migration)."""

    def __init__(self, reward: float = 0.5):
        self.calls, self.reward = 0, reward

    def reset(self, row: dict) -> str:
        return ""

    def step(self, action: str) -> EnvStep:
        self.calls += 1
        assert any(s in action for s in STOP), action  # the action is the turn's text, stop string included
        return EnvStep(OBSERVATION, self.reward, False)


class Gate(Counter):
    """Blocks in step until the test opens its gate (an environment that takes a while)."""

    gate = threading.Event()

    def step(self, action: str) -> EnvStep:
        assert Gate.gate.wait(30), "the test never opened the gate"
        return super().step(action)


@pytest.fixture(scope="module")
def tokenizer(repeat_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(repeat_model_dir)


def run_episodes(engine, episodes, batch, *, between=None, limit: int = 500) -> list[Trajectory]:
    """The rollout worker's loop, in-process: begin, generate turns, environments between turns, to the end."""
    for t in batch:
        if episodes.begin(t):  # an agent's episode starts on the engine at its first request
            engine.start(t)
    done = []
    for _ in range(limit):
        if engine.idle and not episodes.waiting:
            return done
        for t in episodes.ready(wait_s=0.0 if not engine.idle else 1.0):
            done.append(t) if t.finish_reason else engine.start(t)
        if not engine.idle:
            done.extend(t for t in engine.step() if not episodes.turn_ended(t))
        if between:
            between()
    raise AssertionError("episodes did not finish")


def check_episode(t: Trajectory, tokenizer, max_turns: int, max_new_tokens: int) -> None:
    """Mask, log-probs and turn offsets of a finished episode agree with each other and with the observations."""
    n = len(t.completion_ids)
    assert len(t.loss_mask) == len(t.behaviour_logprobs) == n <= max_new_tokens
    assert 1 <= len(t.turn_starts) <= max_turns and t.turn_starts == sorted(t.turn_starts)
    obs = tokenizer.encode(OBSERVATION, add_special_tokens=False)
    for start in t.turn_starts[1:]:  # before each later turn: exactly one observation, mask 0
        assert t.completion_ids[start - len(obs):start] == obs
        assert t.loss_mask[start - len(obs):start] == [0] * len(obs)
        assert t.behaviour_logprobs[start - len(obs):start] == [0.0] * len(obs)
    env_tokens = len(obs) * (len(t.turn_starts) - 1)
    assert t.loss_mask.count(0) == env_tokens
    assert all(lp < 0 for lp, m in zip(t.behaviour_logprobs, t.loss_mask) if m)  # generated: real log-probs
    assert t.env_reward == pytest.approx(0.5 * (len(t.turn_starts) - 1))


def test_episodes_alternate_turns_and_observations(repeat_model_dir, tokenizer):
    engine = HFEngine(repeat_model_dir, max_running=8, max_new_tokens=40, max_model_len=128, stop=STOP, seed=3)
    episodes = Episodes(Counter, {}, max_turns=3, tokenizer=tokenizer, max_new_tokens=40, stop=STOP)
    batch = trajectories(tokenizer, tasks.repeat(5, 12))
    done = run_episodes(engine, episodes, batch)
    assert sorted(t.traj_id for t in done) == sorted(t.traj_id for t in batch)  # each episode ends once
    assert not episodes.envs and not episodes.waiting
    for t in done:
        check_episode(t, tokenizer, max_turns=3, max_new_tokens=40)
        assert OBSERVATION.strip() in t.completion or len(t.turn_starts) == 1
    assert any(len(t.turn_starts) == 3 for t in done)  # the model does reach the turn limit here
    # the trainer learns from generated tokens only
    from rlflow.stages.batch_shards import shard_batch

    for i, t in enumerate(done):
        t.reward = float(i % 2)
    (shard,) = shard_batch(done[:8], 1, 4)
    assert shard.num_tokens == sum(t.loss_mask.count(1) for t in done[:8]) < sum(len(t.completion_ids) for t in done[:8])


def test_a_turn_budget_ends_turns_and_the_episode_budget_ends_episodes(repeat_model_dir, tokenizer):
    engine = HFEngine(repeat_model_dir, max_running=8, max_new_tokens=12, max_model_len=128, stop=("zzz",),
                      max_turn_tokens=3, seed=3)
    episodes = Episodes(Counter, {}, max_turns=4, tokenizer=tokenizer, max_new_tokens=12, stop=("zzz",))
    done = run_episodes(engine, episodes, trajectories(tokenizer, tasks.repeat(6, 6)))
    for t in done:  # no tool call ever (no "zzz"): one turn, cut by the per-turn budget unless eos came first
        assert len(t.turn_starts) == 1 and len(t.completion_ids) <= 3


def test_v_traj_is_the_oldest_version_over_all_turns(repeat_model_dir, tokenizer):
    engine = HFEngine(repeat_model_dir, max_running=8, max_new_tokens=40, max_model_len=128, stop=STOP, seed=4)
    episodes = Episodes(Counter, {}, max_turns=3, tokenizer=tokenizer, max_new_tokens=40, stop=STOP)
    state = {k: v.numpy() for k, v in engine.model.state_dict().items()}
    versions = iter(range(1, 1000))

    def new_weights():  # a weight sync between every engine step: turns span versions
        engine.load_weights(state, next(versions))

    done = run_episodes(engine, episodes, trajectories(tokenizer, tasks.repeat(7, 8)), between=new_weights)
    multi = [t for t in done if len(t.turn_starts) > 1]
    assert multi
    for t in done:
        assert t.version == min(t.versions_seen) and len(set(t.versions_seen)) == len(t.versions_seen)
    assert any(len(t.versions_seen) > 1 for t in multi)


def test_environments_run_while_the_engine_generates(repeat_model_dir, tokenizer):
    engine = HFEngine(repeat_model_dir, max_running=8, max_new_tokens=40, max_model_len=128, stop=STOP, seed=5)
    episodes = Episodes(Gate, {}, max_turns=2, tokenizer=tokenizer, max_new_tokens=40, stop=STOP)
    Gate.gate.clear()
    batch = trajectories(tokenizer, tasks.repeat(8, 8))
    for t in batch:
        if episodes.begin(t):  # an agent's episode starts on the engine at its first request
            engine.start(t)
    finished_while_waiting = []
    for _ in range(200):  # generate with the gate shut: tool calls pile up on their environments
        if engine.idle:
            break
        finished_while_waiting += [t for t in engine.step() if not episodes.turn_ended(t)]
    waiting = episodes.waiting_ids()
    assert waiting and engine.idle  # every turn that called a tool waits; the engine went on with the rest
    assert not episodes.ready()
    Gate.gate.set()
    done = finished_while_waiting + run_episodes(engine, episodes, [])
    assert sorted(t.traj_id for t in done) == sorted(t.traj_id for t in batch)
    for t in done:
        if t.traj_id in waiting:
            assert len(t.turn_starts) == 2 and t.env_s > 0


def test_an_interrupted_episode_carries_its_environment_to_another_instance(repeat_model_dir, tokenizer):
    engine = HFEngine(repeat_model_dir, max_running=8, max_new_tokens=40, max_model_len=128, stop=STOP, seed=6)
    first = Episodes(Counter, {}, max_turns=4, tokenizer=tokenizer, max_new_tokens=40, stop=STOP)
    batch = trajectories(tokenizer, tasks.repeat(9, 8))
    for t in batch:
        first.begin(t)
        engine.start(t)
    while not first.waiting:
        assert not engine.idle
        for t in engine.step():
            first.turn_ended(t)
    tid = first.waiting_ids()[0]
    moved = first.take(tid)  # its environment step is applied, then it leaves with the environment inside
    first.leave(moved)
    assert moved.env_state and tid not in first.envs and tid not in first.waiting
    assert first.take("nobody/0") is None
    other = HFEngine(repeat_model_dir, max_running=8, max_new_tokens=40, max_model_len=128, stop=STOP, seed=7)
    second = Episodes(Counter, {}, max_turns=4, tokenizer=tokenizer, max_new_tokens=40, stop=STOP)
    second.begin(moved)
    assert not moved.env_state and second.envs[tid].calls == 1  # the same environment, its state intact
    other.start(moved)
    (t,) = run_episodes(other, second, [])
    check_episode(t, tokenizer, max_turns=4, max_new_tokens=40)
    for gone in first.waiting_ids():  # an abort forgets a waiting episode and its environment
        assert first.drop(gone) and gone not in first.envs
    assert not first.waiting and not first.drop("nobody/0")


def test_ended_takes_only_the_steps_that_ended_their_episode(repeat_model_dir, tokenizer):
    """What the rollout worker asks after an engine step: episodes whose step ended them are final now; a step that
    goes on to a next turn stays for ready() (it goes back to the engine at the next step)."""
    class EndsOdd(Counter):  # episodes with an odd index end at their first call; the others go on
        def reset(self, row: dict) -> str:
            self.odd = row["index"] % 2 == 1
            return ""

        def step(self, action: str) -> EnvStep:
            return EnvStep("", 0.0, True) if self.odd else super().step(action)

    engine = HFEngine(repeat_model_dir, max_running=8, max_new_tokens=40, max_model_len=128, stop=STOP, seed=9)
    episodes = Episodes(EndsOdd, {}, max_turns=3, tokenizer=tokenizer, max_new_tokens=40, stop=STOP)
    batch = trajectories(tokenizer, tasks.repeat(11, 8))
    for i, t in enumerate(batch):
        t.row = {**(t.row or {}), "index": i}
        episodes.begin(t)
        engine.start(t)
    while not engine.idle:
        for t in engine.step():
            episodes.turn_ended(t)
    waiting = {tid: episodes.envs[tid].odd for tid in episodes.waiting_ids()}
    assert any(waiting.values()) and not all(waiting.values())
    for _, future, _ in episodes.waiting.values():
        future.result(timeout=30)
    ended = episodes.ended()
    assert sorted(t.traj_id for t in ended) == sorted(tid for tid, odd in waiting.items() if odd)
    assert all(t.finish_reason and len(t.loss_mask) == len(t.completion_ids) for t in ended)
    assert sorted(episodes.waiting_ids()) == sorted(tid for tid, odd in waiting.items() if not odd)
    assert not episodes.ended()  # the rest go on: ready() hands them back for their next turn
    assert all(not t.finish_reason for t in episodes.ready())


def test_a_broken_environment_ends_its_episode_not_the_instance(repeat_model_dir, tokenizer):
    class Broken(Counter):
        def step(self, action):
            raise RuntimeError("boom")

    engine = HFEngine(repeat_model_dir, max_running=8, max_new_tokens=40, max_model_len=128, stop=STOP, seed=8)
    episodes = Episodes(Broken, {}, max_turns=3, tokenizer=tokenizer, max_new_tokens=40, stop=STOP)
    batch = trajectories(tokenizer, tasks.repeat(10, 6))
    done = run_episodes(engine, episodes, batch)
    assert len(done) == len(batch)
    assert all(len(t.turn_starts) == 1 and len(t.loss_mask) == len(t.completion_ids) for t in done)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6), st.booleans()), min_size=1, max_size=60),
       max_turns=st.integers(1, 4), budget=st.integers(8, 40), obs=st.sampled_from(["", " ab", " ab ab ab ab"]))
def test_conservation_and_masks_over_random_turns(tokenizer, turns, max_turns, budget, obs):
    """Driven by hand (no engine): six trajectories; each draw generates tokens for one of them and ends its turn
    with a tool call or not. Every trajectory is in exactly one place (generating, on its environment, finished),
    ends at most once, and a finished one has a full mask whose zeros are exactly its observations."""
    class Fixed(Counter):
        def step(self, action):
            return EnvStep(obs, 1.0, False)

    episodes = Episodes(Fixed, {}, max_turns=max_turns, tokenizer=tokenizer, max_new_tokens=budget, stop=STOP)
    word = tokenizer.encode("ab", add_special_tokens=False)
    space = tokenizer.encode(" ", add_special_tokens=False)
    trajs = [Trajectory(group_id="p", index=i, prompt="ab*2=", answer="ab ab", prompt_ids=[1, 2]) for i in range(6)]
    generating = {t.traj_id: t for t in trajs}
    for t in trajs:
        episodes.begin(t)
    finished: dict[str, Trajectory] = {}
    for who, n, tool in turns:
        for t in episodes.ready(wait_s=5.0):
            if t.finish_reason:
                assert t.traj_id not in finished
                finished[t.traj_id] = t
            else:
                generating[t.traj_id] = t
        live = sorted(generating)
        if not live:
            continue
        t = generating.pop(live[who % len(live)])
        room = budget - len(t.completion_ids)
        ids = (word * n)[:max(0, room - len(space))] + (space if tool else [])
        ids = ids[:max(1, room)]
        t.completion_ids += ids
        t.behaviour_logprobs += [-1.0] * len(ids)
        t.finish_reason = "stop" if tool or len(t.completion_ids) < budget else "length"
        if not episodes.turn_ended(t):
            assert t.traj_id not in finished
            finished[t.traj_id] = t
        ids_everywhere = set(generating) | set(episodes.waiting) | set(finished)
        assert len(generating) + len(episodes.waiting) + len(finished) == len(ids_everywhere) <= 6
    obs_ids = tokenizer.encode(obs, add_special_tokens=False) if obs else []
    for t in finished.values():
        assert len(t.loss_mask) == len(t.completion_ids) == len(t.behaviour_logprobs) <= budget
        assert len(t.turn_starts) <= max_turns
        zeros = [i for i, m in enumerate(t.loss_mask) if m == 0]
        assert all(t.behaviour_logprobs[i] == 0.0 for i in zeros)
        assert len(zeros) <= len(obs_ids) * (len(t.turn_starts) - 1) + len(obs_ids)  # a cut last observation too
