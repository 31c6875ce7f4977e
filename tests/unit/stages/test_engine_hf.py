"""HFEngine on the real tiny model: log-probs, batching, interrupt/resume, abort, weight pulls, snapshot."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import numpy as np  # noqa: E402
from engine_helpers import mixed_rows, perturbed_state, reference_logprobs, run_to_idle, trajectories  # noqa: E402

from rlflow.stages.engine import EngineSnapshot, RolloutEngine  # noqa: E402
from rlflow.stages.engine_hf import HFEngine, sample  # noqa: E402
from rlflow.stages.trajectory import Trajectory  # noqa: E402


def test_is_a_rollout_engine(repeat_model_dir):
    engine = HFEngine(repeat_model_dir, instance_id=3)
    assert isinstance(engine, RolloutEngine)
    assert engine.version == 0 and engine.idle
    assert engine.snapshot() == EngineSnapshot(instance=3, version=0, kv_cache=0, run_trajs=[], wait_trajs=[],
                                               complete_trajs=0, max_running=64)


def test_behaviour_logprobs_match_a_fresh_forward_pass(repeat_model_dir):
    engine = HFEngine(repeat_model_dir, max_running=5, chunk_size=3, max_new_tokens=24, temperature=0.7, seed=1)
    batch = trajectories(engine.tokenizer, mixed_rows(12))
    assert len({len(t.prompt_ids) for t in batch}) >= 4
    for traj in batch:
        engine.start(traj)
    done = run_to_idle(engine)
    assert sorted(t.traj_id for t in done) == sorted(t.traj_id for t in batch)
    eos = engine.tokenizer.eos_token_id
    for traj in done:
        assert traj.finish_reason in ("stop", "length") and traj.instance == 0
        assert len(traj.behaviour_logprobs) == len(traj.completion_ids) > 0
        assert (traj.finish_reason == "stop") == (traj.completion_ids[-1] == eos)
        assert eos not in traj.completion_ids[:-1]
        assert traj.finish_reason == "stop" or len(traj.completion_ids) == 24
        assert traj.completion == engine.tokenizer.decode(traj.completion_ids, skip_special_tokens=True)
        assert traj.version == 0 and traj.versions_seen == [0]
        np.testing.assert_allclose(traj.behaviour_logprobs, reference_logprobs(engine.model, traj, 0.7), atol=1e-4)


def test_batched_generation_equals_single_under_greedy(repeat_model_dir):
    rows = mixed_rows(10)
    batched = HFEngine(repeat_model_dir, max_running=6, chunk_size=4, max_new_tokens=20, temperature=0.0)
    single = HFEngine(repeat_model_dir, max_running=1, chunk_size=4, max_new_tokens=20, temperature=0.0)
    for traj in trajectories(batched.tokenizer, rows):
        batched.start(traj)
    together = {t.traj_id: t for t in run_to_idle(batched)}
    for traj in trajectories(single.tokenizer, rows):
        single.start(traj)
        (alone,) = run_to_idle(single)
        assert alone.completion_ids == together[alone.traj_id].completion_ids
        np.testing.assert_allclose(alone.behaviour_logprobs, together[alone.traj_id].behaviour_logprobs, atol=1e-4)
    assert any(len(t.completion_ids) > 4 for t in together.values())  # rows spanned more than one chunk


def test_interrupt_returns_partial_and_resume_elsewhere_continues_it(repeat_model_dir):
    first = HFEngine(repeat_model_dir, instance_id=0, chunk_size=2, max_new_tokens=40, temperature=1.0, seed=5)
    batch = trajectories(first.tokenizer, [{"prompt": f"{w}*9=", "answer": " ".join([w] * 9)} for w in ("abc", "fed", "ghi", "jab")])
    for traj in batch:
        first.start(traj)
    first.step()
    running = first.snapshot().run_trajs
    assert running, "every trajectory finished within one chunk of 2 tokens"
    partial = first.interrupt(running[0])
    assert partial.finish_reason == "interrupt" and partial.instance == 0
    assert len(partial.completion_ids) == 2 == len(partial.behaviour_logprobs)
    assert partial.traj_id not in first.snapshot().run_trajs
    assert first.interrupt(partial.traj_id) is None and first.interrupt("nope/0") is None
    head = list(partial.completion_ids)

    second = HFEngine(repeat_model_dir, instance_id=1, chunk_size=4, max_new_tokens=40, temperature=1.0, seed=6)
    second.load_weights({k: v.numpy() for k, v in first.model.state_dict().items()}, version=3)
    second.start(partial)
    assert partial.finish_reason == ""
    (resumed,) = run_to_idle(second)
    assert resumed is partial and resumed.instance == 1 and resumed.finish_reason in ("stop", "length")
    assert resumed.completion_ids[:2] == head and len(resumed.completion_ids) > 2
    assert resumed.version == 0 and resumed.versions_seen == [0, 3]
    np.testing.assert_allclose(resumed.behaviour_logprobs, reference_logprobs(second.model, resumed, 1.0), atol=1e-4)


def test_interrupting_a_waiting_trajectory_returns_it_untouched(repeat_model_dir):
    engine = HFEngine(repeat_model_dir, max_running=1)
    a, b = trajectories(engine.tokenizer, mixed_rows(2))
    engine.start(a)
    engine.start(b)
    assert engine.snapshot().wait_trajs == [a.traj_id, b.traj_id]
    taken = engine.interrupt(b.traj_id)
    assert taken is b and b.completion_ids == [] and b.finish_reason == "interrupt"
    assert engine.snapshot().wait_trajs == [a.traj_id]


def test_abort_frees_the_slot(repeat_model_dir):
    engine = HFEngine(repeat_model_dir, max_running=2, chunk_size=1, max_new_tokens=30)
    a, b, c = trajectories(engine.tokenizer, [{"prompt": f"{w}*9=", "answer": ""} for w in ("abc", "def", "ghi")])
    for traj in (a, b, c):
        engine.start(traj)
    engine.step()
    snap = engine.snapshot()
    live = snap.run_trajs
    assert len(live) + snap.complete_trajs == 2 and snap.wait_trajs == [c.traj_id]
    assert live, "both admitted trajectories stopped after one token (seeded: should not happen)"
    assert engine.abort(live[0]) is True
    assert live[0] not in engine.snapshot().run_trajs
    assert engine.abort(live[0]) is False and engine.abort("nope/0") is False
    engine.step()  # the freed slot admits the waiting trajectory
    snap = engine.snapshot()
    assert snap.wait_trajs == [] and len(c.completion_ids) == 1 and len(snap.run_trajs) <= 2
    done = run_to_idle(engine)
    assert live[0] not in {t.traj_id for t in done}
    assert engine.snapshot().complete_trajs == 2


def test_load_weights_switches_the_policy_and_records_the_version(repeat_model_dir):
    engine = HFEngine(repeat_model_dir, chunk_size=3, max_new_tokens=24, temperature=1.0, seed=2)
    reference = transformers.AutoModelForCausalLM.from_pretrained(repeat_model_dir).eval()
    state = perturbed_state(reference)

    in_flight = trajectories(engine.tokenizer, [{"prompt": f"{w}*12=", "answer": ""} for w in ("abc", "hij")], group="f")
    for traj in in_flight:
        engine.start(traj)
    engine.step()
    before = {t.traj_id: len(t.completion_ids) for t in in_flight}
    old_logprobs = {t.traj_id: list(t.behaviour_logprobs) for t in in_flight}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read-only arrays must copy without a warning
        engine.load_weights(state, version=1)
    assert engine.version == 1 and engine.snapshot().version == 1

    fresh = trajectories(engine.tokenizer, mixed_rows(6), group="n")
    for traj in fresh:
        engine.start(traj)
    run_to_idle(engine)

    old_model = reference
    new_model = transformers.AutoModelForCausalLM.from_pretrained(repeat_model_dir).eval()
    new_model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in state.items()})
    for traj in fresh:
        assert traj.version == 1 and traj.versions_seen == [1]
        np.testing.assert_allclose(traj.behaviour_logprobs, reference_logprobs(new_model, traj, 1.0), atol=1e-4)
        stale = reference_logprobs(old_model, traj, 1.0)
        assert max(abs(a - b) for a, b in zip(stale, traj.behaviour_logprobs)) > 1e-2
    for traj in in_flight:
        k = before[traj.traj_id]
        assert traj.behaviour_logprobs[:k] == old_logprobs[traj.traj_id]
        if len(traj.completion_ids) > k:  # it continued under the new weights
            assert traj.version == 0 and traj.versions_seen == [0, 1]
            np.testing.assert_allclose(traj.behaviour_logprobs[k:], reference_logprobs(new_model, traj, 1.0)[k:], atol=1e-4)
        np.testing.assert_allclose(traj.behaviour_logprobs[:k], reference_logprobs(old_model, traj, 1.0)[:k], atol=1e-4)


def test_load_weights_rejects_unknown_names_and_wrong_shapes(repeat_model_dir):
    engine = HFEngine(repeat_model_dir)
    with pytest.raises(KeyError, match="not in the model"):
        engine.load_weights({"model.nope.weight": np.zeros(3, dtype=np.float32)}, version=1)
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights({"lm_head.weight": np.zeros((3, 3), dtype=np.float32)}, version=1)
    assert engine.version == 0


def test_max_model_len_violation_is_a_clear_error(repeat_model_dir):
    engine = HFEngine(repeat_model_dir, max_model_len=32, max_new_tokens=24)
    (long,) = trajectories(engine.tokenizer, [{"prompt": "123+456+789+12=", "answer": "1380"}])
    with pytest.raises(ValueError, match=r"prompt of \d+ tokens \+ max_new_tokens 24 = \d+ exceeds max_model_len 32"):
        engine.start(long)
    assert engine.idle
    with pytest.raises(ValueError, match="max_position_embeddings"):
        HFEngine(repeat_model_dir, max_model_len=100_000)
    with pytest.raises(ValueError, match="no prompt_ids"):
        engine.start(Trajectory(group_id="e", index=0, prompt="", answer="", prompt_ids=[]))


def test_snapshot_stays_consistent_while_running(repeat_model_dir):
    engine = HFEngine(repeat_model_dir, instance_id=2, max_running=4, chunk_size=2, max_new_tokens=16)
    batch = trajectories(engine.tokenizer, mixed_rows(10))
    by_id = {t.traj_id: t for t in batch}
    for traj in batch:
        engine.start(traj)
    with pytest.raises(ValueError, match="already on instance 2"):
        engine.start(batch[0])
    finished = 0
    while not engine.idle:
        finished += len(engine.step())
        snap = engine.snapshot()
        assert snap.instance == 2 and snap.max_running == 4 and snap.complete_trajs == finished
        assert len(snap.run_trajs) <= 4 and not set(snap.run_trajs) & set(snap.wait_trajs)
        assert snap.kv_cache == sum(len(by_id[i].prompt_ids) + len(by_id[i].completion_ids) for i in snap.run_trajs)
        assert len(snap.run_trajs) + len(snap.wait_trajs) + finished == len(batch)
    assert finished == len(batch) and engine.snapshot().kv_cache == 0


def test_top_p_samples_inside_the_nucleus_but_records_untruncated_logprobs():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 400))
    gen = torch.Generator().manual_seed(0)
    tokens, logprobs = sample(logits, temperature=1.0, top_p=0.7, generator=gen)
    assert set(tokens.tolist()) == {0, 1}
    np.testing.assert_allclose(logprobs.numpy(), np.log(np.array([0.5, 0.3]))[tokens.numpy()], rtol=1e-5)
    greedy, greedy_logprobs = sample(logits[:2], temperature=0.0, top_p=1.0, generator=gen)
    assert greedy.tolist() == [0, 0] and np.allclose(greedy_logprobs.numpy(), np.log(0.5))


def test_generation_raises_no_future_warning(repeat_model_dir):
    """The KV cache goes to the forward under the name the installed transformers takes (`cache` from 5.24), so no
    deprecation warning is printed before every step of a run."""
    engine = HFEngine(repeat_model_dir, max_running=4, chunk_size=3, max_new_tokens=8, temperature=1.0)
    for traj in trajectories(engine.tokenizer, mixed_rows(6)):
        engine.start(traj)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert len(run_to_idle(engine)) == 6


def test_sleep_frees_weights_and_kv_cache_and_wake_generates_only_after_a_load(repeat_model_dir):
    """Colocation's schedule on the hf engine: level 2 gives every state-dict tensor's memory back (weights and KV cache,
    with rows mid-generation), refuses to generate until a version is loaded after waking, and then generates exactly
    what an engine that never slept generates from the same weights."""
    import psutil

    rows = mixed_rows(6)
    slept = HFEngine(repeat_model_dir, max_running=8, chunk_size=2, max_new_tokens=16, temperature=0)
    awake = HFEngine(repeat_model_dir, max_running=8, chunk_size=2, max_new_tokens=16, temperature=0)
    state = perturbed_state(slept.model)
    first = {}
    for engine in (slept, awake):
        for traj in trajectories(engine.tokenizer, rows):
            engine.start(traj)
        first[engine] = engine.step()  # rows are mid-generation: the KV cache holds their tokens
    held = slept.held_bytes()
    assert held["weights"] == sum(t.numel() * t.element_size() for t in {id(t): t for t in slept.model.state_dict().values()}.values())
    assert held["kv_cache"] > 0
    rss = psutil.Process().memory_info().rss
    freed = slept.sleep(2)
    assert freed == held["weights"] + held["kv_cache"] and slept.asleep == 2
    assert slept.held_bytes() == {"weights": 0, "kv_cache": 0}
    # the weights' pages went back to the allocator (a 2.5 MB model: most of it leaves the process)
    assert rss - psutil.Process().memory_info().rss >= held["weights"] // 2
    with pytest.raises(RuntimeError, match="asleep"):
        slept.step()
    with pytest.raises(RuntimeError, match="while asleep"):
        slept.load_weights(state, version=1)
    slept.wake_up()
    assert slept.asleep == 0 and slept.held_bytes()["weights"] == held["weights"]
    with pytest.raises(RuntimeError, match="has not loaded a version"):
        slept.step()
    partial = {k: v for k, v in state.items() if k != "lm_head.weight"}
    assert slept.load_weights(partial, version=1).missing == ["lm_head.weight"]  # woke from level 2: all must come
    for engine in (slept, awake):
        engine.load_weights(state, version=1)
    done = {e: sorted((t.traj_id, t.completion_ids) for t in first[e] + run_to_idle(e)) for e in (slept, awake)}
    assert done[slept] == done[awake] and len(done[slept]) == 6


def test_sleep_at_level_1_keeps_the_weights(repeat_model_dir):
    engine = HFEngine(repeat_model_dir, max_new_tokens=8)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    engine.sleep(1)
    engine.wake_up()
    assert all(torch.equal(before[k], v) for k, v in engine.model.state_dict().items())
    assert engine.step() == []  # generates again without a load
