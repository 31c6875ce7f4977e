"""Stop strings on HFEngine: a model forced to write a known text ends at the token that completes the stop string;
ids and behaviour log-probs stay 1:1 and end there; the text rewards see ends before the stop string."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import numpy as np
from engine_helpers import reference_logprobs, run_to_idle

from rlflow.stages.engine_hf import HFEngine
from rlflow.stages.trajectory import Trajectory

PROMPT = "ab*3="
SCRIPT = "The answer is 42.\nThen more text ### and more"


def force(engine: HFEngine, script: list[int]) -> None:
    """Make the model write `script` after PROMPT: a large logit bonus on script[k] at the position that predicts the
    k-th completion token. The KV cache is still the real model's, and a plain forward pass (the reference log-probs)
    sees the same bonus."""
    model, prompt_len = engine.model, len(engine.tokenizer(PROMPT)["input_ids"])
    forward = model.forward

    def forced(input_ids=None, position_ids=None, **kwargs):
        out = forward(input_ids=input_ids, position_ids=position_ids, **kwargs)
        n = out.logits.shape[1]
        positions = position_ids if position_ids is not None else torch.arange(n).expand(out.logits.shape[0], n)
        positions = positions[:, -n:]
        k = positions - (prompt_len - 1)
        bonus = torch.zeros_like(out.logits)
        for row, col in zip(*torch.nonzero((k >= 0) & (k < len(script)), as_tuple=True)):
            bonus[row, col, script[int(k[row, col])]] = 30.0
        out.logits = out.logits + bonus
        return out

    model.forward = forced


def run(model_dir, stop, *, max_new_tokens=40, rows=3, temperature=0.7):
    engine = HFEngine(model_dir, max_running=4, chunk_size=3, max_new_tokens=max_new_tokens, temperature=temperature,
                      seed=2, stop=stop)
    script = engine.tokenizer(SCRIPT, add_special_tokens=False)["input_ids"]
    force(engine, script)
    ids = engine.tokenizer(PROMPT)["input_ids"]
    batch = [Trajectory(group_id="g", index=i, prompt=PROMPT, answer="", prompt_ids=list(ids)) for i in range(rows)]
    for traj in batch:
        engine.start(traj)
    done = run_to_idle(engine)
    assert len(done) == rows
    return engine, script, done


def stop_token_index(tokenizer, script: list[int], stop: str) -> int:
    """The index of the first token whose decoding makes the text contain `stop`."""
    return next(i for i in range(len(script)) if stop in tokenizer.decode(script[: i + 1], skip_special_tokens=True))


def test_completion_ends_at_the_token_completing_the_stop_string(repeat_model_dir):
    engine, script, done = run(repeat_model_dir, ["\n"])
    end = stop_token_index(engine.tokenizer, script, "\n")
    for traj in done:
        assert traj.finish_reason == "stop"
        assert traj.completion_ids == script[: end + 1]  # the stop token is kept (trained on, like eos)
        assert len(traj.behaviour_logprobs) == len(traj.completion_ids)
        assert traj.completion == "The answer is 42."  # the text ends before the stop string
        np.testing.assert_allclose(traj.behaviour_logprobs, reference_logprobs(engine.model, traj, 0.7), atol=1e-4)


def test_a_stop_string_spanning_several_tokens_and_the_earliest_of_several(repeat_model_dir):
    engine, script, done = run(repeat_model_dir, ["###", "is 42"])
    end = stop_token_index(engine.tokenizer, script, "is 42")
    assert len(engine.tokenizer.decode(script[end:end + 1])) < len("is 42")  # it did span tokens
    for traj in done:
        assert traj.completion_ids == script[: end + 1] and traj.finish_reason == "stop"
        assert traj.completion == "The answer "
        assert len(traj.behaviour_logprobs) == len(traj.completion_ids)


def test_a_later_stop_string_and_no_stop_string(repeat_model_dir):
    engine, script, done = run(repeat_model_dir, ["###"])
    end = stop_token_index(engine.tokenizer, script, "###")
    assert all(t.completion_ids == script[: end + 1] and t.completion == "The answer is 42.\nThen more text " for t in done)
    engine, script, done = run(repeat_model_dir, ["never"], max_new_tokens=8)
    for traj in done:
        assert traj.finish_reason == "length" and traj.completion_ids == script[:8]
        assert traj.completion == engine.tokenizer.decode(script[:8], skip_special_tokens=True)


def test_stop_on_the_last_allowed_token_is_a_stop(repeat_model_dir):
    engine, script, _ = run(repeat_model_dir, [], rows=1)
    end = stop_token_index(engine.tokenizer, script, "\n")
    _, _, done = run(repeat_model_dir, ["\n"], max_new_tokens=end + 1, rows=1)
    assert done[0].finish_reason == "stop" and len(done[0].completion_ids) == end + 1


def test_empty_stop_strings_are_refused(repeat_model_dir):
    with pytest.raises(ValueError, match="non-empty"):
        HFEngine(repeat_model_dir, stop=[""])


def assert_stop_semantics(engine, done, stop: str) -> int:
    """Every trajectory that ended on the stop string ends at the token completing it; returns how many did."""
    decode = engine.tokenizer.decode
    on_string = 0
    for traj in done:
        assert len(traj.behaviour_logprobs) == len(traj.completion_ids) > 0
        text = decode(traj.completion_ids, skip_special_tokens=True)
        if traj.finish_reason == "stop" and traj.completion_ids[-1] != engine.tokenizer.eos_token_id:
            on_string += 1
            assert stop in text and stop not in decode(traj.completion_ids[:-1], skip_special_tokens=True)
            assert traj.completion == text[: text.index(stop)]
        else:
            assert stop not in text and traj.completion == text
    return on_string


@pytest.mark.vllm
@pytest.mark.slow  # a vLLM engine start; vLLM's stop path also runs wherever a pipeline sets `stop`
def test_vllm_stops_at_the_same_token_with_the_same_text(repeat_model_dir):
    """vLLM (SamplingParams.stop, include_stop_str_in_output=False) keeps the completing token as its last token id and
    log-prob and nothing after it; the engine cuts the text as HFEngine does. A space stops `ab ab ab` inside the
    token ` ab`, so the text is cut in the middle of the last token."""
    pytest.importorskip("vllm")
    from rlflow.stages import tasks
    from rlflow.stages.engine_vllm import VLLMEngine

    rows = [r for r in tasks.repeat(3, 40) if " " in r["answer"]][:8]
    results = {}
    for name, cls in (("hf", HFEngine), ("vllm", VLLMEngine)):
        engine = cls(repeat_model_dir, max_running=8, max_new_tokens=24, temperature=0.0, max_model_len=128, stop=[" "])
        try:
            batch = [Trajectory(group_id=f"g{i}", index=0, prompt=r["prompt"], answer=r["answer"],
                                prompt_ids=engine.tokenizer(r["prompt"])["input_ids"]) for i, r in enumerate(rows)]
            for traj in batch:
                engine.start(traj)
            done = run_to_idle(engine, limit=2000)
            assert assert_stop_semantics(engine, done, " ") >= len(rows) // 2
            results[name] = {t.traj_id: (t.completion, t.finish_reason) for t in done}
        finally:
            getattr(engine, "close", lambda: None)()
    assert results["vllm"] == results["hf"]  # greedy on the same model: the same texts, cut the same way
