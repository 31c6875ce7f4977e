"""A reward stage's scorers in its Score actor, without Ray (runtime/reward_pool.py): builtin:tiny-reward scores
what it was constructed to, a weighted sum adds the parts, a failing part fails the trajectory by name, and a judge
that times out fails its trajectories (and, on every bundle, stops the stage) instead of hanging."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest

from rlflow.runtime.reward_call import TIMEOUTS_IN_A_ROW
from rlflow.runtime.reward_pool import prepared
from rlflow.runtime.reward_stream import Score, per_trajectory


@pytest.fixture(scope="module")
def tiny_reward(tmp_path_factory):
    from rlflow.stages.reward_model import build_tiny_reward

    return str(build_tiny_reward(cache_dir=tmp_path_factory.mktemp("models"), progress=lambda line: None))


def bundle(*groups: tuple[str, str, list[str]]) -> pa.Table:
    rows = [{"group_id": f"g{i}", "task": "main", "prompt": prompt, "answer": answer, "row": "{}",
             "traj_id": [f"g{i}/{k}" for k in range(len(completions))], "completion": completions}
            for i, (prompt, answer, completions) in enumerate(groups)]
    return pa.Table.from_pydict({"groups": [rows]})


def digit_share(tokenizer, text: str) -> float:
    from rlflow.stages.reward_model import is_digit_share

    return is_digit_share(tokenizer(text)["input_ids"], tokenizer)


def test_tiny_reward_scores_the_share_of_digit_tokens(tiny_reward):
    from rlflow.stages.reward_model import RewardModel

    model = RewardModel(tiny_reward, batch_size=2, device="cpu")
    items = [{"prompt": p, "completion": c} for p, c in [("97+5=", "102"), ("ga*2=", "ga ga"), ("1+1=", "two"), ("x", "")]]
    got = [r for r, _, _ in model.score(items)]  # two batches, padded
    want = [digit_share(model.tokenizer, it["prompt"] + it["completion"]) for it in items]
    assert got == pytest.approx(want, abs=1e-3) and got[0] > got[2] > got[3] == pytest.approx(0.0, abs=1e-6)


def test_a_reward_model_loads_in_the_declared_dtype(tiny_reward):
    """auto is float32 off a GPU; a declared dtype is what loads, and scores within its precision."""
    import torch

    from rlflow.stages.reward_model import RewardModel

    items = [{"prompt": p, "completion": c} for p, c in [("97+5=", "102"), ("ga*2=", "ga ga"), ("1+1=", "two")]]
    scores = {}
    for dtype, want in [("auto", torch.float32), ("bfloat16", torch.bfloat16)]:
        model = RewardModel(tiny_reward, batch_size=3, device="cpu", dtype=dtype)
        assert {p.dtype for p in model.model.parameters()} == {want}
        scores[dtype] = [r for r, _, _ in model.score(items)]
    assert scores["bfloat16"] == pytest.approx(scores["auto"], abs=0.05) and scores["bfloat16"] != scores["auto"]


def test_a_weighted_sum_of_a_function_and_a_reward_model(tiny_reward):
    from transformers import AutoTokenizer

    scorers = [{"weight": 1.0, "fn": "exact_match"}, {"weight": 0.2, "model": tiny_reward}]
    out = per_trajectory(Score("exact_match", scorers=scorers, batch_size=3)(
        bundle(("97+5=", "102", ["102", "12", "x"]), ("ga*2=", "ga ga", ["ga ga"]))))
    tok = AutoTokenizer.from_pretrained(tiny_reward)
    texts = [("97+5=", "102"), ("97+5=", "12"), ("97+5=", "x"), ("ga*2=", "ga ga")]
    want = [float(c in ("102", "ga ga")) + 0.2 * digit_share(tok, p + c) for p, c in texts]
    assert out["traj_id"] == ["g0/0", "g0/1", "g0/2", "g1/0"] and out["reward_error"] == [""] * 4
    assert out["reward"] == pytest.approx(want, abs=1e-3)


def test_a_failing_part_fails_the_trajectory_by_name(tiny_reward, monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "integration"))  # rewards_for_tests
    scorers = [{"weight": 0.5, "fn": "rewards_for_tests:flaky_exact"}, {"weight": 0.5, "model": tiny_reward}]
    out = per_trajectory(Score("x", scorers=scorers)(bundle(("q", "abc", ["abc"]), ("q", "12", ["12"]))))
    assert math.isnan(out["reward"][0]) and out["reward_error"][0].startswith("rewards_for_tests:flaky_exact raised")
    assert out["reward_error"][1] == "" and out["reward"][1] > 0.5
    assert out["kept"] == [False, True]  # a group with no member scored is dropped, as a function stage's is


def test_a_judge_that_times_out_fails_its_trajectories_then_stops_the_stage(repeat_model_dir):
    judge = {"model": str(repeat_model_dir), "template": "{prompt}{completion}", "verdict": "regex:\\w",
             "max_new_tokens": 8, "timeout_s": 1e-4}
    score = Score("x", scorers=[{"weight": 1.0, "judge": judge}])
    for n in range(1, TIMEOUTS_IN_A_ROW + 1):
        table = score(bundle(("ga*2=", "ga ga", ["ga ga", "ga"])))
        g = table.column("groups").to_pylist()[0][0]
        assert all(math.isnan(r) for r in g["reward"])
        assert g["reward_error"] == ["the judge timed out after 0.0001 s"] * 2
        assert bool(g["stage_error"]) == (n == TIMEOUTS_IN_A_ROW)
    assert "timed out on every trajectory of 3 bundles in a row" in g["stage_error"]


def test_a_judge_reads_its_verdicts_with_the_rule(repeat_model_dir):
    from rlflow.stages.reward_judge import Judge

    judge = Judge(str(repeat_model_dir), "{completion}*2=", "regex:ga", max_new_tokens=6, batch_size=2)
    out = judge.score([{"prompt": "", "completion": w, "answer": ""} for w in ("ga", "eh", "ga")])
    texts = judge.last_verdicts  # the last batch's: the third item alone
    assert len(texts) == 1 and out[2] == (float("ga" in texts[0]), "", False)
    assert out[0] == out[2] and all(not why and r in (0.0, 1.0) for r, why, _ in out)  # greedy: same input, same verdict
    strict = Judge(str(repeat_model_dir), "{completion}*2=", "yes_no", max_new_tokens=6)
    (reward, why, timed_out), = strict.score([{"prompt": "", "completion": "ga", "answer": ""}])
    assert math.isnan(reward) and not timed_out and why.startswith("the judge's verdict ") and "(rule yes_no)" in why


def test_prepared_builds_the_tiny_reward_and_points_a_tiny_judge_at_the_policy(monkeypatch, tmp_path):
    monkeypatch.setenv("RLFLOW_CACHE", str(tmp_path))
    judge = {"model": "builtin:tiny-llama", "template": "{completion}", "verdict": "yes_no"}
    out = prepared([{"weight": 1.0, "model": "builtin:tiny-reward"}, {"weight": 1.0, "judge": judge}], "/policy",
                   log=lambda line: None)
    assert out[0]["model"] == str(tmp_path / "models" / "tiny-reward-v1") and out[1]["judge"]["model"] == "/policy"
    with pytest.raises(ValueError, match="needs the run's tiny Llama"):
        prepared([{"judge": judge}], None)


@pytest.mark.vllm
def test_a_vllm_judge_writes_the_verdicts_an_hf_judge_writes_and_times_out_by_name(repeat_model_dir):
    """engine vllm (stages/judge_generate.py): greedy on the vLLM rollout engine gives the same verdict texts as
    transformers' generate, several batches through one engine; a batch past its timeout fails by name."""
    pytest.importorskip("vllm")
    from rlflow.stages.reward_judge import Judge

    items = [{"prompt": "", "completion": w, "answer": ""} for w in ("ga", "eh", "ga ga", "97+5")]
    texts = {}
    for engine in ("hf", "vllm"):
        judge = Judge(str(repeat_model_dir), "{completion}*2=", "regex:ga", engine=engine, max_new_tokens=6,
                      batch_size=3, timeout_s=60.0)
        out = judge.score(items)  # two batches: 3, then 1
        assert all(not why for _, why, _ in out)
        texts[engine] = [judge.generate([judge.prompt(it)], 60.0)[0] for it in items]
        assert [r for r, _, _ in out] == [float("ga" in t) for t in texts[engine]]
    assert texts["vllm"] == texts["hf"]
    judge.timeout_s = 1e-4  # the vLLM judge, with no time at all: its requests are aborted
    (reward, why, timed_out), = judge.score(items[:1])
    assert math.isnan(reward) and timed_out and why == "the judge timed out after 0.0001 s"
    judge.timeout_s = 60.0  # and the engine still serves the next batch
    assert judge.score(items[:1])[0][0] == float("ga" in texts["vllm"][0])
    judge.close()
