"""The `openenv:` and `verifiers:` adapters alone (no Ray): an OpenEnv Environment as rlflow's episode contract
(text to its Action, its Observation to text, reward and done carried over, picklable between instances), rubrics as
reward functions, and the named problems compile reports for references that cannot be adapted."""

from __future__ import annotations

import pickle

import pytest

pytest.importorskip("openenv")
pytest.importorskip("verifiers")

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

from rlflow import registry
from rlflow.stages.env_openenv import observation_text, reset_kwargs
from rlflow.stages.environment import EnvStep

OPENENV = "openenv:rlflow.stages.openenv_calc:CalcEnv"
VERIFIERS = "verifiers:rlflow.stages.verifiers_calc:load_taskset"


def test_an_openenv_environment_runs_as_an_rlflow_episode():
    env = registry.resolve("env", OPENENV)()
    assert env.reset({"prompt": "Ann has 37 pens and buys 48 more. Calc:", "answer": "85"}) == ""
    assert env.step("<calc>37+48</calc>") == EnvStep("=85", 0.0, False)
    moved = pickle.loads(pickle.dumps(env))  # an episode migrating between rollout instances
    assert moved.step("<calc>37+48</calc>=85 A=85") == EnvStep("", 1.0, True)  # the rubric, with reset's answer
    assert env.step("A=84") == EnvStep("", 0.0, True)


def test_openenv_and_verifiers_rubrics_score_completions():
    for ref in (OPENENV, VERIFIERS):
        score = pickle.loads(pickle.dumps(registry.resolve("reward", ref)))  # shipped to the Score actors
        row = {"prompt": "Ann has 37 pens and buys 48 more. Calc:", "answer": "85"}
        assert score("<calc>37+48</calc>=85 A=85", "85", row["prompt"], row) == 1.0
        assert score("<calc>37+48</calc>=85 A=86", "85", row["prompt"], row) == 0.0


class Say(Action):
    words: str
    loud: bool = False


class Heard(Observation):
    echo: str
    count: int


class Echo(Environment[Say, Heard, State]):
    def reset(self, seed=None, episode_id=None, prompt: str = "", **kwargs):
        return Heard(echo=prompt, count=0)

    def step(self, action: Say, timeout_s=None, **kwargs):
        return Heard(echo=action.words, count=len(action.words), reward=0.5)

    @property
    def state(self):
        return State()


def test_text_goes_to_the_one_text_field_and_observations_become_text():
    assert reset_kwargs(Echo, {"prompt": "hi", "answer": "x"}) == {"prompt": "hi"}  # only what reset names
    assert observation_text(Heard(echo="a", count=1, done=True, reward=1.0)) == '{"echo": "a", "count": 1}'
    env = registry.resolve("env", f"openenv:{__name__}:Echo")()
    assert env.reset({"prompt": "hi"}) == '{"echo": "hi", "count": 0}'
    assert env.step("abc") == EnvStep('{"echo": "abc", "count": 3}', 0.5, False)


class TwoTexts(Action):
    a: str
    b: str


class TwoTextEnv(Environment[TwoTexts, Heard, State]):
    def reset(self, seed=None, episode_id=None, **kwargs):
        return Heard(echo="", count=0)

    def step(self, action: TwoTexts, timeout_s=None, **kwargs):
        return Heard(echo="", count=0)

    @property
    def state(self):
        return State()


class Untyped(Environment):
    def reset(self, seed=None, episode_id=None, **kwargs):
        return Observation()

    def step(self, action, timeout_s=None, **kwargs):
        return Observation()

    @property
    def state(self):
        return State()


@pytest.mark.parametrize("ref, rule, words", [
    (f"openenv:{__name__}:Untyped", "not-an-env", "cannot tell the Action class"),
    (f"openenv:{__name__}:TwoTexts", "not-an-env", "not a concrete OpenEnv Environment"),
    (f"openenv:{__name__}:TwoTextEnv", "not-an-env", "2 required text fields (a, b)"),
    (VERIFIERS, "verifiers-env-not-steppable", "drives the model itself"),
])
def test_references_that_cannot_be_adapted_are_named(ref, rule, words):
    with pytest.raises(registry.ComponentError) as e:
        registry.check_reference("env", ref)
    assert e.value.rule == rule and words in str(e.value)


def test_a_verifiers_reference_without_a_taskset_is_named():
    with pytest.raises(registry.ComponentError) as e:
        registry.check_reference("reward", "verifiers:rlflow.stages.tasks:calc")  # a function giving rows, not a taskset
    assert e.value.rule == "not-a-reward"


def test_a_verifiers_taskset_as_the_prompts():
    from rlflow.data_head import head_problem
    from rlflow.runtime.evaluation import held_out_rows

    rows = registry.resolve("task", VERIFIERS)(seed=0, count=3)
    assert [sorted(r) for r in rows] == [["answer", "demo", "idx", "prompt"]] * 3  # no sandbox plumbing
    assert rows[0]["prompt"].endswith("Calc:") and rows[0]["demo"].endswith(f"A={rows[0]['answer']}")
    assert head_problem(VERIFIERS, ("prompt", "answer")) is None
    assert head_problem(VERIFIERS, ("question", "answer"))[1] == "bad-data"  # its columns, named at compile
    held = held_out_rows({"source": VERIFIERS, "holdout": 0.5, "prompt_field": "prompt", "answer_field": "answer"},
                         size=4, seed=0)
    assert 0 < len(held) <= 4 and all(r["row"]["answer"] == r["answer"] for r in held)
    with pytest.raises(registry.ComponentError) as e:  # an environment is stepped, not read
        registry.check_reference("task", OPENENV)
    assert e.value.rule == "openenv-has-no-rows"


def test_a_taskset_module_beside_the_pipeline_is_found_and_recorded(tmp_path, monkeypatch):
    from pathlib import Path

    from rlflow.compiler import compile_pipeline

    repo = Path(__file__).resolve().parents[3]
    (tmp_path / "beside_vf_tasks.py").write_text("from rlflow.stages.verifiers_calc import load_taskset  # noqa: F401\n")
    text = (repo / "pipelines" / "verifiers_calc.yaml").read_text()
    (tmp_path / "p.yaml").write_text(text.replace("rlflow.stages.verifiers_calc:load_taskset", "beside_vf_tasks:load_taskset"))
    monkeypatch.chdir(repo)
    plan = compile_pipeline(tmp_path / "p.yaml")
    assert plan["python_path"] == [str(tmp_path.resolve())]  # the Ray workers import it from there
    assert plan["tasks"]["main"]["source"] == "verifiers:beside_vf_tasks:load_taskset"
