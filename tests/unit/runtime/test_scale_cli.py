"""`rlflow scale`: which requests it refuses (exit 2, the rule and the way out), and what it leaves for the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlflow.cli import main
from rlflow.compiler import compile_pipeline, write_plan
from rlflow.plan_model import Plan
from rlflow.runtime.launch import new_run_dir

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def elastic_plan(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = compile_pipeline(REPO / "pipelines" / "bounded_async.yaml",
                            ["stages.rollout.replicas=1", "stages.rollout.elastic.max_replicas=3"])
    write_plan(plan, ".rlflow/plan.json")
    return plan


@pytest.mark.parametrize("argv, rule, text", [
    (["scale", "rollout", "4"], "elastic-bounds", "outside stages.rollout.elastic [1, 3]"),
    (["scale", "rollout", "0"], "elastic-bounds", "outside"),
    (["scale", "generate", "2"], "unknown-stage", "use one of rollout"),
    (["scale", "rollout", "2"], "no-run", "no run of pipeline 'bounded-async'"),
])
def test_refused_requests_exit_2_with_the_rule(elastic_plan, argv, rule, text, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"[{rule}]" in err and text in err and "Traceback" not in err


def test_a_stage_that_is_not_elastic_says_how_to_make_it_so(tmp_path, monkeypatch, capsys, quickstart_plan):
    monkeypatch.chdir(tmp_path)
    write_plan(quickstart_plan, ".rlflow/plan.json")
    assert main(["scale", "rollout", "2"]) == 2
    err = capsys.readouterr().err
    assert "[not-elastic]" in err and "declare stages.rollout.elastic" in err


def test_request_goes_to_the_newest_run_and_wait_times_out_saying_so(elastic_plan, capsys):
    old = new_run_dir(Plan.of(elastic_plan))
    new = new_run_dir(Plan.of(elastic_plan))
    assert main(["scale", "rollout", "2"]) == 0
    assert json.loads((new / "scale" / "rollout.json").read_text())["instances"] == 2
    assert not (old / "scale").exists()
    assert main(["scale", "rollout", "3", "--run", str(old), "--wait", "0.6"]) == 3  # no run there to answer
    err = capsys.readouterr().err
    assert "waited 0.6 s for 3 serving instance(s)" in err
    assert json.loads((old / "scale" / "rollout.json").read_text())["instances"] == 3
