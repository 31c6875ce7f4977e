"""plan.json read as a typed Plan: every shipped pipeline's plan validates and round-trips byte for byte, and
`rlflow run` refuses a plan of another shape (an older rlflow's) with the way out, before the runtime reads it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlflow.cli import main
from rlflow.compiler import compile_pipeline, read_plan
from rlflow.errors import PipelineInvalid
from rlflow.plan_model import Plan, PlanOutdated

REPO = Path(__file__).resolve().parents[2]
PIPELINES = sorted((REPO / "pipelines").glob("*.yaml"))
VARIANTS = [[], ["stages.train.replicas=2"], ["data.eval=0.1"],
            ["stages.rollout.elastic={min_replicas: 1, max_replicas: 3}"]]


def _plan(path: Path, overrides: list[str]) -> str | None:
    try:
        return json.dumps(compile_pipeline(path, overrides, gpus=0), indent=2)
    except PipelineInvalid:  # an optional model not installed, or an override the pipeline has no field for
        return None


@pytest.mark.parametrize("path", PIPELINES, ids=lambda p: p.stem)
def test_every_plan_validates_and_round_trips_byte_for_byte(path):
    compiled = [text for overrides in VARIANTS if (text := _plan(path, overrides)) is not None]
    if "smollm2" not in path.stem:
        assert compiled, f"{path.name} compiles in no variant"
    for text in compiled:
        plan = Plan.of(json.loads(text))
        assert json.dumps(plan.model_dump(mode="json", exclude_unset=True), indent=2) == text


def test_accessors_name_the_actors_by_role():
    raw = json.loads(_plan(REPO / "pipelines" / "mixed.yaml", ["data.eval=0.1"]))
    plan = Plan.of(raw)
    assert plan.trainer.role == "trainer" and plan.trainer.steps == raw["pipeline"]["stages"]["train"]["steps"]
    assert [a.stage for a in plan.rollouts()] == [a["stage"] for a in raw["actors"] if a["role"] == "rollout"]
    assert [a.name for a in plan.rollouts("gen_repeat")] == ["gen_repeat-0"]
    assert plan.rollout_stages() == [n["name"] for n in raw["graph"]["nodes"] if n["kind"] == "rollout"]
    assert plan.evaluator is not None and plan.parameter_server.name == "parameter-server"
    assert plan.payload_store.name == "payload-store"
    assert [op.stage for op in plan.reward_operators()] == [o["stage"] for o in raw["data_operators"] if o["kind"] == "reward"]
    assert plan.staleness.batch_size == raw["control"]["staleness"]["batch_size"]
    assert plan.max_new_tokens() == {t: a["engine_kwargs"]["max_new_tokens"] for a in raw["actors"] if a["role"] == "rollout"
                                     for t in a["tasks"]}
    # the dict stays readable by key, as it was written
    assert plan.raw is raw and plan["name"] == raw["name"] and plan.get("nothing", 7) == 7
    trainer = next(a for a in raw["actors"] if a["role"] == "trainer")
    assert plan.trainer["save_every"] == trainer["save_every"]
    assert "episode" not in plan.rollouts()[0] and plan.rollouts()[0].get("episode", "absent") == "absent"
    assert Plan.of(plan) is plan


def test_a_plan_of_another_shape_is_named_with_what_is_missing():
    raw = json.loads(_plan(REPO / "pipelines" / "quickstart.yaml", []))
    del raw["control"]["staleness"]
    with pytest.raises(PlanOutdated, match=r"control\.staleness: field required"):
        Plan.checked(raw)


def test_run_refuses_an_outdated_plan_saying_to_recompile(tmp_path, capsys, monkeypatch):
    raw = json.loads(_plan(REPO / "pipelines" / "quickstart.yaml", []))
    for actor in raw["actors"]:  # as an older rlflow wrote them: no role
        del actor["role"]
    (tmp_path / "plan.json").write_text(json.dumps(raw))
    assert main(["run", str(tmp_path / "plan.json")]) == 2
    err = capsys.readouterr().err
    assert "[plan-outdated]" in err and "re-run `rlflow compile`" in err and "actors.0" in err
    assert "Traceback" not in err


def test_run_refuses_a_plan_with_the_old_trajectory_server_role(tmp_path, capsys):
    """The payload store's role was `trajectory_server` (the name of StaleFlow's routing queue, another thing): a
    plan written with it is of another shape, refused before the runtime reads it, with the way out."""
    raw = json.loads(_plan(REPO / "pipelines" / "quickstart.yaml", []))
    store = next(a for a in raw["actors"] if a["role"] == "payload_store")
    store["name"], store["role"] = "trajectory-server", "trajectory_server"
    (tmp_path / "plan.json").write_text(json.dumps(raw))
    assert main(["run", str(tmp_path / "plan.json")]) == 2
    err = capsys.readouterr().err
    assert "[plan-outdated]" in err and "re-run `rlflow compile`" in err and "'trajectory_server'" in err
    assert "Traceback" not in err


def test_read_plan_returns_the_typed_plan_keeping_the_json(tmp_path):
    text = _plan(REPO / "pipelines" / "quickstart.yaml", [])
    (tmp_path / "plan.json").write_text(text)
    plan = read_plan(tmp_path / "plan.json")
    assert isinstance(plan, Plan) and plan.raw == json.loads(text)
    assert plan.payload_store.name == "payload-store" and plan.trainer.stage == "train"
