"""Every shipped pipeline compiles, opens with its command and purpose, and lowers to a complete plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlflow.cli import main
from rlflow.compiler import compile_pipeline
from rlflow.plan import PLAN_VERSION

REPO = Path(__file__).resolve().parents[2]
PIPELINES = sorted((REPO / "pipelines").glob("*.yaml"))


def test_there_are_example_pipelines():
    names = {p.stem for p in PIPELINES}
    assert {"quickstart", "synchronous", "one_step", "bounded_async", "staleflow", "laminar", "streamrl", "mixed"} <= names


@pytest.mark.parametrize("path", PIPELINES, ids=lambda p: p.stem)
def test_pipeline_opens_with_its_command_and_purpose(path):
    first, second = path.read_text().splitlines()[:2]
    assert first == f"# rlflow compile pipelines/{path.name} && rlflow run"
    assert second.startswith("# Purpose: ")


@pytest.mark.parametrize("path", PIPELINES, ids=lambda p: p.stem)
def test_pipeline_compiles_to_plan_summary_and_picture(path, tmp_path, capsys):
    out = tmp_path / "plan.json"
    from rlflow.stages import smollm2

    if "builtin:smollm2-135m" in path.read_text() and smollm2.missing():  # an optional extra (CI leaves it out)
        assert main(["compile", str(path), "-o", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"{path}: 1 error") and "[model-not-installed]" in err and "rlflow[smollm2]" in err
        return
    assert main(["compile", str(path), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    plan = json.loads(out.read_text())
    assert plan["plan_version"] == PLAN_VERSION
    assert f"pipeline '{plan['name']}'" in printed and "staleness control:" in printed
    svg = out.with_suffix(".svg").read_text()
    assert svg.startswith("<svg") and all(f">{n}<" in svg for n in plan["pipeline"]["stages"])
    # every default is resolved: the plan's pipeline validates again unchanged
    from rlflow.schema import Pipeline

    assert Pipeline.model_validate(plan["pipeline"]).model_dump(mode="json", by_alias=True) == plan["pipeline"]


EXPECTED_CONTROL = {
    "synchronous": ("synchronous", 0),
    "one_step": ("one_step", 1),
    "bounded_async": ("in_flight_limit", 2),
    "staleflow": ("staleflow", 2),
    "laminar": ("unbounded", None),
    "streamrl": ("queue_drop", None),
    "quickstart": ("staleflow", 1),
}


@pytest.mark.parametrize("name", sorted(EXPECTED_CONTROL))
def test_edge_policy_lowers_to_the_control_plane_policy(name):
    plan = compile_pipeline(REPO / "pipelines" / f"{name}.yaml")
    control = plan["control"]["staleness"]
    assert (control["kind"], control["eta"]) == EXPECTED_CONTROL[name]
    assert control["batch_size"] == plan["pipeline"]["stages"]["buffer"]["batch_groups"]


def test_barrier_batch_redundancy_reaches_the_synchronous_policy(tmp_path):
    text = (REPO / "pipelines" / "synchronous.yaml").read_text()
    assert "{kind: barrier}" in text
    (tmp_path / "p.yaml").write_text(text.replace("{kind: barrier}", "{kind: barrier, batch_redundancy: 4}"))
    (tmp_path / "configs").symlink_to(REPO / "configs")
    control = compile_pipeline(tmp_path / "p.yaml")["control"]["staleness"]
    assert (control["kind"], control["eta"], control["batch_redundancy"]) == ("synchronous", 0, 4)


def test_queue_drop_pipeline_shows_predicted_staleness(capsys, tmp_path):
    main(["compile", str(REPO / "pipelines" / "streamrl.yaml"), "-o", str(tmp_path / "p.json")])
    out = capsys.readouterr().out
    plan = json.loads((tmp_path / "p.json").read_text())
    pred = plan["prediction"]
    assert pred["available"]
    assert pred["mean"] == pytest.approx(pred["pre_queue"] + pred["in_queue"])
    assert f"predicted mean staleness: {pred['mean']:.2f} steps = pre-queue {pred['pre_queue']:.2f}" in out


def test_actors_follow_replicas_and_resources():
    plan = compile_pipeline(REPO / "pipelines" / "bounded_async.yaml")
    rollouts = [a for a in plan["actors"] if a["role"] == "rollout"]
    assert [a["name"] for a in rollouts] == ["rollout-0", "rollout-1"]
    assert all(a["num_cpus"] == 0.5 for a in rollouts)
    roles = {a["role"] for a in plan["actors"]}
    assert {"trainer", "payload_store", "parameter_server"} <= roles


def test_a_reward_stage_dtype_reaches_its_model_scorers_only():
    plan = compile_pipeline(REPO / "pipelines" / "reward_model.yaml", ["stages.score.dtype=bfloat16"])
    (op,) = [o for o in plan["data_operators"] if o.get("scorers")]
    assert [p.get("dtype") for p in op["scorers"]] == [None, "bfloat16"]  # fn: none; the reward model: declared
    default = compile_pipeline(REPO / "pipelines" / "reward_model.yaml")
    (op,) = [o for o in default["data_operators"] if o.get("scorers")]
    assert [p.get("dtype") for p in op["scorers"]] == [None, "auto"]


def test_a_vllm_judge_without_vllm_is_named_at_compile(tmp_path, monkeypatch):
    import importlib.util

    import yaml

    from rlflow import reward_scorers
    from rlflow.compiler import check_pipeline
    from rlflow.errors import PipelineInvalid

    spec = yaml.safe_load((REPO / "pipelines" / "reward_model.yaml").read_text())
    spec["stages"]["score"]["scorers"][1] = {"weight": 0.2, "judge": {
        "model": "builtin:tiny-llama", "engine": "vllm", "template": "{completion}?", "verdict": "yes_no"}}
    path = tmp_path / "judge.yaml"
    path.write_text(yaml.safe_dump(spec))
    real = importlib.util.find_spec
    monkeypatch.setattr(reward_scorers.importlib.util, "find_spec", lambda name: None if name == "vllm" else real(name))
    with pytest.raises(PipelineInvalid) as e:
        check_pipeline(path)
    (p,) = [p for p in e.value.problems if p.loc[-1] == "engine"]
    assert p.rule == "missing-package" and "vllm" in p.fix
