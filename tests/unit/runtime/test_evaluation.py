"""Evaluation's pure parts: the hash split, pass@k, length buckets, the metrics, and scoring on a fake engine."""

from __future__ import annotations

import json
import math
import random
from itertools import combinations

import pytest

from rlflow.runtime.evaluation import (
    bucket,
    bucket_edges,
    eval_tasks,
    evaluate,
    held_out,
    held_out_rows,
    pass_at_k,
    summarize,
)
from rlflow.runtime.messages import EvalPrompt, EvalTask
from rlflow.stages.tasks import repeat


def test_held_out_is_deterministic_and_near_the_fraction():
    prompts = [f"p{i}" for i in range(20_000)]
    first = [held_out(p, 0.1) for p in prompts]
    assert first == [held_out(p, 0.1) for p in prompts]  # same answer every call (sha256, not hash())
    assert abs(sum(first) / len(first) - 0.1) < 0.01
    # nested: a larger fraction holds out a superset, so raising it never trains on a row evaluated before
    assert all(held_out(p, 0.3) for p, h in zip(prompts, first) if h)
    assert held_out("12+7=", 0.5) == held_out("12+7=", 0.5)


def test_held_out_rows_are_exactly_the_rows_training_skips():
    task = {"source": "builtin:repeat", "holdout": 0.2, "limit": None, "prompt_field": "prompt", "answer_field": "answer"}
    generated = [r["prompt"] for r in repeat(seed=0, count=4096)]
    expected = [p for p in generated if held_out(p, 0.2)]
    rows = held_out_rows(task, size=len(expected), seed=0)
    assert [r["prompt"] for r in rows] == expected  # in source order, a recurring prompt each time it recurs
    assert len(set(expected)) < len(expected)  # (repeat does repeat its short prompts)
    assert held_out_rows(task, size=5, seed=0) == rows[:5]  # the first rows, in source order
    # more rows than the training source's 4096 hold: the generator runs on; none of them is trained on
    more = held_out_rows(task, size=2 * len(expected), seed=0)
    assert len(more) == 2 * len(expected) and more[: len(expected)] == rows
    assert all(held_out(r["prompt"], 0.2) for r in more)


def test_held_out_rows_from_a_file_take_every_row(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text("\n".join(json.dumps({"q": f"{i}+1=", "a": str(i + 1)}) for i in range(5)))
    task = {"source": str(path), "holdout": None, "limit": None, "prompt_field": "q", "answer_field": "a"}
    assert [r["answer"] for r in held_out_rows(task, size=3, seed=0)] == ["1", "2", "3"]


def _pass_at_k_by_counting(n, c, k):
    """pass@k by enumerating every k-subset of n samples (c of them correct)."""
    subsets = list(combinations([1] * c + [0] * (n - c), k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n,c,k", [(4, 0, 4), (4, 1, 4), (4, 4, 1), (5, 2, 1), (6, 2, 3), (10, 3, 4), (8, 7, 2)])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(_pass_at_k_by_counting(n, c, k), abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 2)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_length_buckets_are_terciles():
    lengths = list(range(1, 10))  # 1..9
    edges = bucket_edges(lengths)
    assert edges == (3, 6)
    assert [bucket(x, edges) for x in lengths] == ["short"] * 3 + ["medium"] * 3 + ["long"] * 3
    random.Random(0).shuffle(lengths)
    assert bucket_edges(lengths) == (3, 6)  # order does not matter
    assert bucket_edges([2, 2, 2, 2]) == (2, 2)  # ties: everything short, the other buckets empty


def test_summarize():
    results = [{"greedy_reward": 1.0, "sample_rewards": [1.0, 0.0], "bucket": "short"},
               {"greedy_reward": 0.5, "sample_rewards": [0.0, 0.0], "bucket": "long"},
               {"greedy_reward": 0.0, "sample_rewards": [0.0, 1.0], "bucket": "long"}]
    m = summarize(results, k=2)
    assert m["eval/accuracy"] == pytest.approx(1 / 3)  # only reward 1 counts as correct
    assert m["eval/pass_at_2"] == pytest.approx(2 / 3)
    assert m["eval/reward_mean"] == pytest.approx(0.5)
    assert m["eval/sample_reward_mean"] == pytest.approx(2 / 6)
    assert m["eval/accuracy_len_short"] == 1.0 and m["eval/accuracy_len_long"] == 0.0
    assert "eval/accuracy_len_medium" not in m  # an empty bucket has no metric


class FakeEngine:
    """Answers the prompt's answer greedily; samples answer it on even members only. Records the settings used."""

    def __init__(self):
        self.temperature, self.max_new_tokens = 1.0, 8
        self.waiting, self.seen = [], []

    @property
    def idle(self):
        return not self.waiting

    def start(self, traj):
        self.seen.append((self.temperature, self.max_new_tokens))
        self.waiting.append(traj)

    def step(self):
        out, self.waiting = self.waiting[:3], self.waiting[3:]  # a few per step, like a batch
        for t in out:
            t.completion = t.answer if self.temperature == 0 or t.index % 2 == 0 else "wrong"
        return out


def test_evaluate_greedy_then_samples_on_the_engine():
    rows = [EvalPrompt(f"{i}", "x" * (i + 1), {}, [1, 2], i + 1) for i in range(6)]
    engine = FakeEngine()
    tasks = {"main": EvalTask(rows, lambda c, a: float(c == a), temperature=0.7, max_new_tokens=5)}
    m = evaluate(engine, tasks, k=2)
    assert m["eval/accuracy"] == 1.0 and m["eval/pass_at_2"] == 1.0 and m["eval/sample_reward_mean"] == 0.5
    assert m["eval/prompts"] == 6 and m["eval/reward_failed"] == 0
    assert engine.seen == [(0.0, 5)] * 6 + [(0.7, 5)] * 12  # greedy first, then k samples each
    assert (engine.temperature, engine.max_new_tokens) == (1.0, 8)  # restored
    assert {"eval/accuracy_len_short", "eval/accuracy_len_medium", "eval/accuracy_len_long"} <= set(m)


def test_evaluate_counts_a_failing_reward_as_zero():
    rows = [EvalPrompt("p", "a", {}, [1], 1)]

    def broken(completion, answer):
        raise RuntimeError("boom")

    m = evaluate(FakeEngine(), {"main": EvalTask(rows, broken, temperature=1.0, max_new_tokens=4)}, k=1)
    assert m["eval/accuracy"] == 0.0 and m["eval/reward_failed"] == 2


def test_eval_tasks_defaults_from_the_plan():
    from pathlib import Path

    from rlflow.compiler import compile_pipeline
    from rlflow.errors import PipelineInvalid

    repo = Path(__file__).resolve().parents[3]
    plan = compile_pipeline(repo / "pipelines" / "quickstart.yaml", ["data.eval=0.1", "data.eval_size=32", "data.eval_k=3"])
    tasks, settings = eval_tasks(plan, data=None, task=None, reward=None, n=None, k=None, max_new_tokens=None, temperature=None)
    assert tasks["main"]["holdout"] == 0.1 and tasks["main"]["reward_fn"] == "exact_match"
    assert (settings["size"], settings["k"], settings["max_model_len"]) == (32, 3, 128)
    # --data naming the run's own source keeps its split; another source is scored whole
    same, _ = eval_tasks(plan, data="builtin:repeat", task=None, reward=None, n=4, k=2, max_new_tokens=8, temperature=None)
    assert same["main"]["holdout"] == 0.1 and same["main"]["max_new_tokens"] == 8
    other, _ = eval_tasks(plan, data="builtin:arith", task=None, reward="numeric_close", n=4, k=2, max_new_tokens=None,
                          temperature=None)
    assert other["main"]["holdout"] is None and other["main"]["reward_fn"] == "numeric_close"
    with pytest.raises(PipelineInvalid):
        eval_tasks(None, data=None, task=None, reward=None, n=None, k=None, max_new_tokens=None, temperature=None)
    with pytest.raises(PipelineInvalid):
        eval_tasks(None, data="nope.jsonl", task=None, reward=None, n=None, k=None, max_new_tokens=None, temperature=None)
    assert (settings["stop"], settings["episode"]) == ([], None)  # single-turn: no stop strings, no environment
    agentic = compile_pipeline(repo / "pipelines" / "agentic_calc.yaml")
    _, settings = eval_tasks(agentic, data=None, task=None, reward=None, n=None, k=None, max_new_tokens=None,
                             temperature=None)
    assert settings["stop"] == ["</calc>"] and settings["max_turn_tokens"] == 16  # scored as the run generates
    assert settings["episode"] == {"env": "calculator", "env_kwargs": {}, "max_turns": 2}


def test_eval_data_takes_what_data_source_takes(tmp_path):
    """--data: a `datasets` directory (--split, else the run's split when it is the run's source), an .arrow file and
    a verifiers taskset, read as training reads them; each bad one refused at --data / --split by its rule."""
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("verifiers")
    from rlflow.errors import PipelineInvalid

    rows = datasets.Dataset.from_dict({"prompt": ["1+1=", "2+2="], "answer": ["2", "4"]})
    datasets.DatasetDict({"train": rows, "test": rows.select([1])}).save_to_disk(tmp_path / "dd")
    rows.save_to_disk(tmp_path / "one")
    arrow = next((tmp_path / "one").glob("*.arrow"))

    def score(data, split=None, plan=None):
        tasks, _ = eval_tasks(plan, data=data, split=split, task=None, reward=None, n=8, k=1, max_new_tokens=None,
                              temperature=None)
        return [r["answer"] for r in held_out_rows(tasks["main"], size=8, seed=0)]

    assert score(str(tmp_path / "dd"), "test") == ["4"]
    assert score(str(tmp_path / "one")) == score(str(arrow)) == ["2", "4"]
    assert len(score("verifiers:rlflow.stages.verifiers_calc:load_taskset")) == 8
    from pathlib import Path

    from rlflow.compiler import compile_pipeline

    quickstart = Path(__file__).resolve().parents[3] / "pipelines" / "quickstart.yaml"
    run = compile_pipeline(quickstart, [f"data.source={tmp_path / 'dd'}", "data.split=test"])
    assert score(str(tmp_path / "dd"), plan=run) == ["4"]  # the run's own DatasetDict source: its split by default

    def refused(data, split=None):
        with pytest.raises(PipelineInvalid) as err:
            score(data, split)
        (p,) = err.value.problems
        return p.loc[0], p.rule

    assert refused(str(tmp_path / "dd")) == ("--split", "bad-split")  # several splits, none named
    assert refused(str(tmp_path / "dd"), "val") == ("--split", "bad-split")
    assert refused(str(tmp_path)) == ("--data", "bad-dataset-dir")
    assert refused(str(tmp_path / "missing.arrow")) == ("--data", "missing-file")
    assert refused("verifiers:rlflow.stages.tasks:calc")[0] == "--data"  # a row generator, not a taskset
    assert refused("builtin:arith", "train") == ("--split", "bad-eval-input")


def test_eval_of_a_run_scored_by_a_reward_model_only_names_the_stage_and_the_way_out():
    from pathlib import Path

    from rlflow.compiler import compile_pipeline
    from rlflow.errors import PipelineInvalid

    quickstart = Path(__file__).resolve().parents[3] / "pipelines" / "quickstart.yaml"
    by_model = ["stages.score.fn=null", "stages.score.model=builtin:tiny-reward"]
    options = dict(data="builtin:arith", task=None, n=4, k=1, max_new_tokens=None, temperature=None)
    with pytest.raises(PipelineInvalid) as err:
        eval_tasks(compile_pipeline(quickstart, by_model), reward=None, **options)
    (p,) = err.value.problems
    assert (p.loc, p.rule) == (("--reward",), "eval-needs-reward-fn")
    assert "stage 'score'" in p.message and "model only" in p.message and "None" not in p.message
    assert "--reward NAME" in p.fix and "eval_fn" in p.fix
    tasks, _ = eval_tasks(compile_pipeline(quickstart, by_model), reward="numeric_close", **options)
    assert tasks["main"]["reward_fn"] == "numeric_close"
    tasks, _ = eval_tasks(compile_pipeline(quickstart, [*by_model, "stages.score.eval_fn=exact_match"]), reward=None,
                          **options)
    assert tasks["main"]["reward_fn"] == "exact_match"  # the stage's eval_fn
