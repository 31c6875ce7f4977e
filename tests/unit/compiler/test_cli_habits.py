"""Habits from other tools carry over to `rlflow` (issue #32): bare key=value overrides, `-o -`, `rlflow show`,
`rlflow run PIPELINE.yaml`, overrides of one run kept out of the shared plan, shell completion, `rlflow eval`
finding user modules as compile does. The runtime is stood in for: these tests start no Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlflow.cli import main
from rlflow.plan_model import Plan
from rlflow.runtime import launch

REPO = Path(__file__).resolve().parents[3]
QUICKSTART = REPO / "pipelines" / "quickstart.yaml"


@pytest.fixture
def launched(monkeypatch) -> list[Plan]:
    """The plans `rlflow run` hands to launch(), which returns at once as a finished run."""
    plans: list[Plan] = []

    def fake_launch(plan, *, resume=False, address=None):
        plans.append(plan)
        return {"stopped": False}

    monkeypatch.setattr(launch, "launch", fake_launch)
    return plans


def test_bare_key_value_is_an_override(tmp_path):
    out = tmp_path / "plan.json"
    assert main(["compile", str(QUICKSTART), "stages.train.steps=10", "-o", str(out), "--set", "stages.train.lr=1e-4"]) == 0
    plan = json.loads(out.read_text())
    assert plan["pipeline"]["stages"]["train"]["steps"] == 10
    assert plan["overrides"] == ["stages.train.steps=10", "stages.train.lr=1e-4"]


def test_a_bare_argument_that_is_no_override_is_a_usage_error_naming_the_form(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["validate", str(QUICKSTART), "stages.train.steps"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "dotted.key=value" in err and "--set" in err and "Traceback" not in err


def test_output_dash_writes_the_plan_to_stdout_and_no_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["compile", str(QUICKSTART), "-o", "-"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["name"] == "quickstart"
    assert "pipeline 'quickstart'" in captured.err  # the summary, out of the pipe's way
    assert list(tmp_path.iterdir()) == []


def test_show_prints_the_resolved_pipeline_with_defaults_and_overrides(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["show", str(QUICKSTART), "stages.train.steps=7"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["stages"]["train"]["steps"] == 7
    assert shown["stages"]["train"]["clip_high"] == 0.28  # a default the file does not write
    assert shown["data"]["eval_k"] == 4
    assert list(tmp_path.iterdir()) == []  # writes nothing


def test_run_of_a_pipeline_compiles_it_first_where_compile_would(tmp_path, monkeypatch, capsys, launched):
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(QUICKSTART)]) == 0
    assert (tmp_path / ".rlflow" / "plan.json").is_file() and (tmp_path / ".rlflow" / "plan.svg").is_file()
    assert f"compiled {QUICKSTART} to .rlflow/plan.json" in capsys.readouterr().out
    (plan,) = launched
    assert plan.name == "quickstart" and plan.overrides == []


def test_run_overrides_apply_to_that_run_only_and_do_not_pile_up(tmp_path, monkeypatch, capsys, launched):
    monkeypatch.chdir(tmp_path)
    assert main(["compile", str(QUICKSTART), "--set", "stages.train.lr=1e-4"]) == 0
    shared = (tmp_path / ".rlflow" / "plan.json").read_bytes()
    assert main(["run", "--set", "stages.train.steps=3"]) == 0
    assert main(["run", "stages.train.steps=5"]) == 0  # bare, and no plan named: the default plan
    assert (tmp_path / ".rlflow" / "plan.json").read_bytes() == shared
    first, second = launched
    assert first.overrides == ["stages.train.lr=1e-4", "stages.train.steps=3"]
    assert second.overrides == ["stages.train.lr=1e-4", "stages.train.steps=5"]
    assert first.pipeline["stages"]["train"]["steps"] == 3
    assert "overrides for this run only: stages.train.steps=3" in capsys.readouterr().out


def test_a_run_directory_records_the_plan_it_ran_and_its_overrides(tmp_path):
    from rlflow.compiler import compile_pipeline

    plan = Plan.of(compile_pipeline(QUICKSTART, ["stages.train.steps=3"]))
    run_dir = launch.new_run_dir(plan, root=tmp_path)
    assert json.loads((run_dir / launch.RUN_FILE).read_text())["overrides"] == ["stages.train.steps=3"]
    assert json.loads((run_dir / launch.RUN_PLAN_FILE).read_text())["pipeline"]["stages"]["train"]["steps"] == 3


def test_shell_completion_completes_commands_and_options():
    env = {**os.environ, "_RLFLOW_COMPLETE": "complete_bash", "COMP_WORDS": "rlflow comp", "COMP_CWORD": "1"}
    done = subprocess.run([sys.executable, "-m", "rlflow.cli"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "compile" in done.stdout.split()
    shown = subprocess.run([sys.executable, "-m", "rlflow.cli", "--show-completion", "bash"], capture_output=True,
                           text=True, timeout=60)
    assert shown.returncode == 0 and "_rlflow_completion" in shown.stdout


BESIDE = """def score(completion, answer):
    return float(completion.strip() == answer)


def batch(prompts, completions, **kwargs):
    return [0.0 for _ in completions]
"""


@pytest.fixture
def model_and_module(tmp_path, monkeypatch) -> Path:
    """A working directory holding a reward module (not on sys.path) and a model directory (its config only)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_eval_rewards.py").write_text(BESIDE)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    yield model
    sys.modules.pop("my_eval_rewards", None)


def test_eval_finds_a_reward_module_in_the_working_directory(model_and_module, monkeypatch):
    from rlflow import cli_model, registry

    scored = []
    monkeypatch.setattr(cli_model, "_score", lambda model_dir, plan, *, engine, **o: scored.append(
        registry.resolve("reward", o["reward"])("4", "4")))
    assert main(["eval", str(model_and_module), "--reward", "my_eval_rewards:score", "--data", "builtin:arith"]) == 0
    assert scored == [1.0]


def test_eval_refuses_a_batch_reward_as_validate_does(model_and_module, capsys):
    assert main(["eval", str(model_and_module), "--reward", "my_eval_rewards:batch", "--data", "builtin:arith"]) == 2
    err = capsys.readouterr().err
    assert "a batch reward" in err and "[not-a-reward]" in err and "Traceback" not in err


def test_resume_applies_the_overrides_the_run_was_started_with(tmp_path, monkeypatch, capsys, launched):
    from rlflow.compiler import compile_pipeline
    from rlflow.runtime import checkpoint

    monkeypatch.chdir(tmp_path)
    assert main(["compile", str(QUICKSTART)]) == 0
    run_dir = launch.new_run_dir(Plan.of(compile_pipeline(QUICKSTART, ["stages.train.steps=3"])))
    (run_dir / checkpoint.STATE_FILE).write_text("{}")  # published a checkpoint: resumable
    assert main(["run", "--resume", "--set", "stages.train.lr=1e-4"]) == 0
    (plan,) = launched
    assert plan.overrides == ["stages.train.steps=3", "stages.train.lr=1e-4"]
    assert "resuming with the run's own overrides: stages.train.steps=3" in capsys.readouterr().out
