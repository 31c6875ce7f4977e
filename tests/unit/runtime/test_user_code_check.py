"""User code edited after compile: at run start an import, syntax or signature error is `user-code-error`, exit 2,
one line naming the file and line, before Ray starts; mid-run (a new reward process imports the module again) the
reward stage stops by the same rule, which the driver turns into a named stop (exit 3, after a checkpoint)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from rlflow.cli import main
from rlflow.compiler import compile_pipeline
from rlflow.errors import Problem
from rlflow.plan_model import Plan
from rlflow.runtime import user_code_check
from rlflow.runtime.messages import StreamFailed
from rlflow.runtime.reward_call import RewardStageFailing
from rlflow.runtime.reward_stream import Score

REPO = Path(__file__).resolve().parents[3]
GOOD = "def score(completion, answer):\n    return float(completion.strip() == answer.strip())\n"
SYNTAX = "def score(completion, answer):\n    return float(completion.strip() == answer.strip()\n"  # line 2: no ')'


@pytest.fixture(autouse=True)
def _tests_beside(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # test_reward_failures' stream helpers
    monkeypatch.syspath_prepend(str(REPO / "tests" / "integration"))  # rewards_for_tests, which they import


def pipeline_with(tmp_path: Path, module: str) -> Path:
    """The quickstart, its reward `module:score` beside it (a module of the user's)."""
    text = (REPO / "pipelines" / "quickstart.yaml").read_text()
    path = tmp_path / "pipeline.yaml"
    path.write_text(text.replace("fn: exact_match}", f"fn: {module}:score}}"))
    (tmp_path / f"{module}.py").write_text(GOOD)
    return path


def test_a_reward_module_broken_after_compile_exits_2_naming_file_and_line_before_ray(tmp_path, monkeypatch, capsys):
    """Issue #45: compile, then a syntax error in the reward module, then `rlflow run`. Exit 2 with one line (the
    rule, the file and the line), no traceback, no "bug in rlflow"; before Ray starts (unit tests make ray.init fail,
    which `handled` would report as a bug, exit 1) and before a run directory exists. Compiled in a process of its
    own, as a user does, so this one has not imported the good module."""
    import ray

    pipeline_with(tmp_path, "broken_after_compile")
    compiled = subprocess.run([sys.executable, "-m", "rlflow.cli", "compile", "pipeline.yaml"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
    assert compiled.returncode == 0, compiled.stderr
    (tmp_path / "broken_after_compile.py").write_text(SYNTAX)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # ray.init would run, and fail the test
    assert main(["run"]) == 2
    out = capsys.readouterr()
    said = out.out + out.err
    assert "Traceback" not in said and "bug in rlflow" not in said, said
    (line,) = [ln for ln in said.splitlines() if "[user-code-error]" in ln]
    assert line.startswith(f"  stages.score.fn: {tmp_path / 'broken_after_compile.py'}:2: importing "
                           "'broken_after_compile' failed: SyntaxError: '(' was never closed; fix the module"), line
    assert not (tmp_path / ".rlflow" / "runs").exists()  # no run directory: stopped before Ray


def test_a_signature_changed_after_compile_names_the_def(tmp_path, monkeypatch):
    path = pipeline_with(tmp_path, "changed_signature")
    monkeypatch.syspath_prepend(str(tmp_path))
    plan = Plan.of(compile_pipeline(path))
    assert user_code_check.check(plan) == []
    (tmp_path / "changed_signature.py").write_text("\n\ndef score(completion):\n    return 1.0\n")
    monkeypatch.delitem(sys.modules, "changed_signature")  # a new `rlflow run` process imports it afresh
    (p,) = user_code_check.check(plan)
    assert (p.loc, p.rule) == (("stages", "score", "fn"), "user-code-error")
    assert p.message.startswith(f"{tmp_path / 'changed_signature.py'}:3: 'changed_signature:score' is function "
                                "score(completion) and cannot be called as reward"), p.message
    assert p.fix.endswith("it changed since `rlflow compile` checked it")


def test_every_place_a_pipeline_names_user_code_is_checked():
    pipeline = {
        "data": {"tasks": {"a": {"source": "mine.tasks:rows"}, "b": {"source": "builtin:arith"}}},
        "stages": {
            "gen": {"kind": "rollout", "engine": "hf", "env": "mine.envs:Echo",
                    "tools": ["mine.tools:add", {"type": "function", "function": {"name": "mul"}, "fn": "mine.tools:mul"}]},
            "score": {"kind": "reward", "fn": "mine.rewards:exact", "eval_fn": "mine.rewards:strict",
                      "scorers": [{"fn": "mine.rewards:part", "weight": 0.5}, {"model": "builtin:tiny-reward"}]},
            "train": {"kind": "train"},
        },
        "edges": [{"policy": {"kind": "streaming", "filter": "mine.filters:keep"}},
                  {"policy": {"kind": "skew_aware_dispatch", "ranker": "mine.rankers:Ranker"}}],
    }
    found = {(loc, category) for loc, category, _ in user_code_check.references(pipeline)}
    assert found == {
        (("data", "tasks", "a", "source"), "task"),
        (("stages", "gen", "engine"), "engine"), (("stages", "gen", "env"), "env"),
        (("stages", "gen", "tools", 0), "tool"), (("stages", "gen", "tools", 1), "tool"),
        (("stages", "score", "fn"), "reward"), (("stages", "score", "eval_fn"), "reward"),
        (("stages", "score", "scorers", 0, "fn"), "reward"),
        (("edges", 0, "policy", "filter"), "filter"), (("edges", 1, "policy", "ranker"), "ranker"),
    }


# ------------------------------------------------------------------------------------------ mid-run
def test_a_reward_module_broken_mid_run_stops_its_stage_by_name(tmp_path, monkeypatch):
    """The run is going; the module is edited with a syntax error; the reward's process dies (a poison row, the OOM
    killer) and its new one cannot import the reward. Retrying cannot help: the stage stops with `user-code-error`
    and the file and line, which the driver turns into RunFailed (rlflow run: exit 3, after a checkpoint)."""
    from test_reward_failures import drain, stream_over

    (tmp_path / "edited_mid_run.py").write_text(GOOD)
    monkeypatch.syspath_prepend(str(tmp_path))  # the reward's process inherits sys.path
    score = Score("edited_mid_run:score", 10.0)
    assert score.score_one("2", "2", "1+1=", {}) == (1.0, "")
    (tmp_path / "edited_mid_run.py").write_text(SYNTAX)
    os.kill(score.process.proc.pid, signal.SIGKILL)
    reward, error = score.score_one("2", "2", "1+1=", {})
    where = f"{tmp_path / 'edited_mid_run.py'}:2"
    assert reward != reward and error.startswith(f"edited_mid_run:score could not load it: {where}: importing "), error
    group = {"group_id": "g0", "task": "main", "traj_id": ["g0/0", "g0/1"], "completion": ["2", "3"],
             "answer": "2", "prompt": "1+1=", "row": "{}"}
    scored = score.score(group)
    assert scored["reward_error"] == ["edited_mid_run:score not called: it no longer loads"] * 2
    assert scored["stage_rule"] == "user-code-error"
    assert scored["stage_error"].startswith(f"edited_mid_run:score no longer loads in a new reward process: {where}: ")
    score.process.close()

    scored["kept"] = False
    events = drain(stream_over([pa.Table.from_pydict({"groups": [[scored]]})]))
    assert [type(e) for e in events] == [StreamFailed]
    err = events[0].error
    assert isinstance(err, RewardStageFailing) and err.problems[0].rule == "user-code-error"
    assert str(err) == (f"{scored['stage_error']}; fix the reward function 'mine:fn' (it changed since "
                        "the run started) [user-code-error]")
    assert "\n" not in str(err)  # one line: "run stopped: reward stage 'score' failed: <this>; rlflow run --resume ..."


def test_the_driver_stops_a_run_by_name_on_a_stage_error():
    """A reward stage's error event is a RunFailed naming the stage: `rlflow run` exits 3 with it (cli.handled),
    after the run saved a checkpoint (Run.run: a RunFailed with the trainer alive ends as KILLED, which saves)."""
    from rlflow.cli import handled
    from rlflow.errors import RunFailed
    from rlflow.runtime.driver import Run

    run = Run.__new__(Run)
    run.watchdog = type("W", (), {"fed": lambda self: None})()
    err = RewardStageFailing("p.yaml", [Problem(("stages", "score", "fn"), "x.py:2: bad", "user-code-error", "fix it")])
    with pytest.raises(RunFailed) as stopped:
        run._handle(StreamFailed("score", err))
    assert str(stopped.value).startswith("reward stage 'score' failed: x.py:2: bad; fix it [user-code-error]; ")

    def command():
        raise stopped.value

    assert handled(command)() == 3
