"""The Python API (rlflow/api.py): the same compile, simulate and errors as the CLI, from a script."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import rlflow
from rlflow.errors import PipelineInvalid

REPO = Path(__file__).resolve().parents[3]
SYNC = REPO / "pipelines" / "synchronous.yaml"


def test_compile_takes_a_path_and_overrides_as_a_mapping_or_strings():
    plan = rlflow.compile(SYNC, overrides={"stages.train.steps": 2, "stages.train.algo": "rloo"})
    train = plan.pipeline["stages"]["train"]
    assert (train["steps"], train["algo"]) == (2, "rloo")
    assert plan.overrides == ["stages.train.steps=2", "stages.train.algo=rloo"]
    same = rlflow.compile(str(SYNC), overrides=["stages.train.steps=2", "stages.train.algo=rloo"])
    assert same.raw["pipeline"] == plan.raw["pipeline"]


def test_compile_takes_a_dict_and_records_it_as_a_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = yaml.safe_load(SYNC.read_text()) | {"name": "from-a-script"}
    plan = rlflow.compile(spec)
    assert plan.name == "from-a-script" and Path(plan.source) == Path(".rlflow/pipelines/from-a-script.yaml")
    assert yaml.safe_load(Path(plan.source).read_text()) == spec  # what a resume recompiles from


def test_a_bad_pipeline_raises_the_problems_the_cli_prints():
    with pytest.raises(PipelineInvalid) as err:
        rlflow.compile(SYNC, overrides={"stages.train.lr": -1})
    (problem,) = err.value.problems
    assert problem.rule == "out-of-range" and "'lr' must be > 0" in problem.message
    with pytest.raises(TypeError, match="a list of 'key=value' strings or a mapping"):
        rlflow.compile(SYNC, overrides="stages.train.steps=2")


def test_simulate_returns_the_result_and_its_notes():
    plan = rlflow.compile(SYNC)
    lines = []
    result, notes = rlflow.simulate(plan, steps=12, log=lines.append)
    assert result.summary()["steps"] == 12 and result.mean_staleness == 0.0  # a barrier trains on-policy
    assert lines[-1].startswith("simulating 'synchronous': 12 steps") and [f"note: {n}" for n in notes] == lines[:-1]


def test_a_plan_file_runs_through_the_same_path(tmp_path):
    from rlflow.api import as_plan
    from rlflow.compiler import write_plan

    path, _ = write_plan(rlflow.compile(SYNC).raw, tmp_path / "plan.json")
    plan = as_plan(path, {"stages.train.steps": 3})
    assert plan.pipeline["stages"]["train"]["steps"] == 3
    assert json.loads(path.read_text())["pipeline"]["stages"]["train"]["steps"] == 10  # the file is unchanged
