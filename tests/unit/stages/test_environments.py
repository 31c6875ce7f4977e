"""The built-in environments (calculator, python tool), the builtin:calc task and its `tagged_number` reward, and
the `env` component category. Environments run in stages/sandbox.py: about 70 ms a step."""

from __future__ import annotations

import ast
import pickle
import statistics
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlflow import registry
from rlflow.stages import env_calculator, rewards, tasks
from rlflow.stages.env_calculator import Calculator
from rlflow.stages.env_python import PythonTool
from rlflow.stages.environment import Environment, EnvStep


def calc(expr: str) -> str:
    step = Calculator().step(f"The sum is <calc>{expr}</calc>")
    assert isinstance(step, EnvStep) and step.reward == 0.0 and step.done is False
    return step.observation


@pytest.mark.parametrize("expr, observation", [
    ("37+48", "=85"), ("85-37", "=48"), ("12*34", "=408"), ("5/2", "=2.5"), ("8/2", "=4"), ("(3+4)*-2", "=-14"),
    ("-7", "=-7"), (" 2 * (10 - 3) ", "=14"), ("17//5", "=3"), ("17%5", "=2"), ("1.5*2", "=3"), ("0.25+0.5", "=0.75"),
])
def test_calculator_evaluates_arithmetic(expr, observation):
    assert calc(expr) == observation


def test_calculator_uses_the_last_call_of_the_turn():
    assert Calculator().step("<calc>1+1</calc> no, <calc>2*3</calc>").observation == "=6"


@pytest.mark.parametrize("action", [
    "<calc>__import__('os').system('x')</calc>", "<calc>2**999999</calc>", "<calc>x+1</calc>", "<calc>abs(-3)</calc>",
    "<calc>(1).real</calc>", "<calc>True+1</calc>", "<calc>'a'*3</calc>", "<calc>" + "1+" * 40 + "1</calc>",
    "<calc>(1+</calc>", "<calc></calc>", "<calc>1/0</calc>", "no tool call at all", "<calc>1+1", "<calc>[1][0]</calc>",
])
def test_calculator_reports_bad_input_in_a_short_observation(action):
    observation = Calculator().step(action).observation
    assert observation.startswith("=error: ") and len(observation) < 40, observation


def test_a_checked_expression_runs_as_written_without_comments():
    assert calc("1 # ignored") == "=1"
    assert isinstance(env_calculator.parse("1 + 2"), ast.Expression)
    assert env_calculator.parse("a" * 70) == "over 64 chars"


def test_latency_kinds_and_their_bounds(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(env_calculator.time, "sleep", slept.append)
    exponential = Calculator(latency_s=0.01, latency="exponential", seed=3)
    for _ in range(2000):  # no call in the action: no sandbox run, only the latency
        exponential.step("thinking")
    assert statistics.mean(slept) == pytest.approx(0.01, rel=0.1) and len(set(slept)) == 2000
    slept.clear()
    fixed = Calculator(latency_s=0.02)
    fixed.step("a")
    fixed.step("b")
    assert slept == [0.02, 0.02]
    slept.clear()
    Calculator().step("a")
    assert slept == []
    with pytest.raises(ValueError, match="fixed, exponential"):
        Calculator(latency="uniform")


def test_the_same_seed_gives_the_same_latencies_and_each_episode_its_own(monkeypatch):
    def draws(env, n=5):
        slept: list[float] = []
        monkeypatch.setattr(env_calculator.time, "sleep", slept.append)
        for _ in range(n):
            env.step("")
        return slept

    assert draws(Calculator(0.01, "exponential", seed=1)) == draws(Calculator(0.01, "exponential", seed=1))
    a, b = Calculator(0.01, "exponential"), Calculator(0.01, "exponential")
    assert a.reset({"prompt": "p"}) == "" and b.reset({"prompt": "p"}) == ""
    assert draws(a) != draws(b)  # the trajectories of a batch do not wait the same sequence of times


def test_fixed_latency_really_sleeps():
    started = time.perf_counter()
    Calculator(latency_s=0.05).step("no call")
    assert time.perf_counter() - started >= 0.05


def test_python_tool_returns_the_output():
    tool = PythonTool()
    assert tool.reset({"prompt": "x"}) == ""
    step = tool.step("first <python>print(1)</python> then <python>print(sum(range(10)))\nprint('ok')</python>")
    assert step == EnvStep("<output>45\nok</output>", 0.0, False)


def test_python_tool_reports_errors_with_the_output_before_them():
    observation = PythonTool().step("<python>print('a')\n1/0</python>").observation
    assert observation == "<output>a\nZeroDivisionError: division by zero</output>"
    assert PythonTool().step("<python>import sys; sys.exit(3)</python>").observation == "<output>exit status 3</output>"
    assert PythonTool().step("no code").observation.startswith("<output>error: no <python>")


def test_python_tool_stops_a_busy_loop_at_the_wall_limit():
    started = time.perf_counter()
    observation = PythonTool(wall_s=0.5, cpu_s=10).step("<python>while True: pass</python>").observation
    assert observation == "<output>timed out</output>" and time.perf_counter() - started < 5


def test_python_tool_truncates_output():
    observation = PythonTool(max_output_chars=10).step("<python>print('x' * 1000)</python>").observation
    assert observation == "<output>" + "x" * 10 + "...</output>"


def test_environments_survive_pickling_between_turns(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(env_calculator.time, "sleep", slept.append)
    env = Calculator(latency_s=0.01, latency="exponential", seed=5)
    env.reset({"prompt": "p"})
    env.step("")
    copy = pickle.loads(pickle.dumps(env))
    env.step("")
    copy.step("")
    assert slept[1] == slept[2]  # the latency stream continues where it was
    assert copy.step("<calc>6*7</calc>").observation == "=42"
    tool = pickle.loads(pickle.dumps(PythonTool(max_output_chars=50, wall_s=2.0)))
    assert (tool.max_output_chars, tool.wall_s) == (50, 2.0)
    assert tool.step("<python>print(6*7)</python>").observation == "<output>42</output>"


@pytest.mark.parametrize("completion, answer, reward", [
    ("<calc>37+48</calc>=85 A=85", "85", 1.0),
    ("<calc>37+48</calc>=85", "85", 0.0),  # copying the observation is not an answer
    ("A=85", "85", 1.0), ("A=85.0", "85", 1.0), ("A=-3", "-3", 1.0), ("A=85 and more", "85", 1.0),
    ("A=84 A=85", "85", 1.0), ("A=85 A=84", "85", 0.0), ("A=85 A=", "85", 0.0), ("A= 85", "85", 0.0),
    ("A=850", "85", 0.0), ("85", "85", 0.0), ("", "85", 0.0), ("A=85", "eighty", 0.0),
])
def test_tagged_number(completion, answer, reward):
    assert rewards.tagged_number(completion, answer) == reward


def _pieces(row):
    segments = tasks.demo_segments(row["demo"])
    assert [by_model for _, by_model in segments] == [True, False, True], row
    return [text for text, _ in segments]


@given(st.integers(0, 2**31))
@settings(max_examples=100, deadline=None)
def test_calc_demos_are_consistent(seed):
    """The demo's call evaluates to the observation it shows, and its final answer is the row's answer."""
    for row in tasks.calc(seed, 20):
        action, observation, final = _pieces(row)
        assert row["prompt"].endswith(tasks.CALC_CUE) and row["demo"] == action + observation + final
        assert row["answer"] == final.removeprefix(" A=") and observation == "=" + row["answer"]
        assert rewards.tagged_number(row["demo"], row["answer"]) == 1.0
        assert rewards.tagged_number(action + observation, row["answer"]) == 0.0
        expr = action.removeprefix("<calc>").removesuffix("</calc>")
        tree = env_calculator.parse(expr)
        assert isinstance(tree, ast.Expression), (expr, tree)
        assert str(eval(compile(tree, "demo", "eval"), {"__builtins__": {}})) == row["answer"]  # whitelisted tree
        assert 10 <= int(expr[:2]) <= 99 and int(row["answer"]) >= 0


def test_calc_demo_observations_are_what_the_calculator_appends():
    rows = tasks.calc(7, 12)
    for row in rows:
        action, observation, _ = _pieces(row)
        assert Calculator().step(action).observation == observation
    assert len({r["prompt"] for r in tasks.calc(0, 500)}) > 450
    assert {r["demo"][8] for r in tasks.calc(0, 300)} == {"+", "-", "*"}


def test_env_builtins_are_registered_and_resolve():
    assert registry.builtin_names("env") == ["calculator", "python"]
    for name, cls in (("calculator", Calculator), ("python", PythonTool)):
        registry.check_reference("env", name)
        assert registry.resolve("env", name) is cls and issubclass(cls, Environment)
    assert registry.resolve("task", "builtin:calc") is tasks.calc
    assert registry.resolve("reward", "tagged_number") is rewards.tagged_number


def test_env_unknown_name_suggests_and_lists_the_choices():
    with pytest.raises(registry.ComponentError, match=r"unknown env 'calculater' \(did you mean 'calculator'\?\); "
                                                      r"use one of: calculator, python"):
        registry.check_reference("env", "calculater")


@pytest.fixture
def user_envs(tmp_path, monkeypatch):
    (tmp_path / "my_envs_for_test.py").write_text(
        "from rlflow.stages.environment import Environment, EnvStep\n"
        "class Echo(Environment):\n"
        "    def step(self, action):\n"
        "        return EnvStep(action)\n"
        "class NoStep(Environment):\n"
        "    pass\n"
        "class Plain:\n"
        "    def step(self, action):\n"
        "        return EnvStep(action)\n"
        "def make():\n"
        "    return Echo()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_envs_for_test"


def test_env_import_string_to_an_environment_class_is_valid(user_envs):
    registry.check_reference("env", f"{user_envs}:Echo")
    assert registry.resolve("env", f"{user_envs}:Echo")().step("hi").observation == "hi"


@pytest.mark.parametrize("attr, message", [
    ("Plain", ("is class Plain, which does not subclass Environment; an env is a class that subclasses "
               "rlflow.stages.environment.Environment")),
    ("NoStep", "is class NoStep, which does not implement step; "),
    ("make", "is function make, not a class; "),
])
def test_env_import_string_must_name_an_environment_subclass(user_envs, attr, message):
    with pytest.raises(registry.ComponentError, match=message.replace("(", r"\(").replace(".", r"\.")) as err:
        registry.check_reference("env", f"{user_envs}:{attr}")
    assert err.value.rule == "not-a-env" and str(err.value).startswith(f"'{user_envs}:{attr}' is ")


def test_env_import_string_that_does_not_import():
    with pytest.raises(registry.ComponentError, match="cannot import module 'no_such_envs_pkg'"):
        registry.check_reference("env", "no_such_envs_pkg:Tool")
    with pytest.raises(registry.ComponentError, match="has no attribute 'Calculater' \\(did you mean 'Calculator'"):
        registry.check_reference("env", "rlflow.stages.env_calculator:Calculater")
    with pytest.raises(registry.ComponentError, match="from the Python standard library|does not subclass"):
        registry.check_reference("env", "subprocess:Popen")
