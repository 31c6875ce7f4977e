"""The plan carries what the executor needs: task routes, actors with their constructor arguments,
Ray Data operators in data-flow order, and per-stage coordination (plan version 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlflow import registry
from rlflow.cli import main
from rlflow.compiler import compile_pipeline
from rlflow.errors import PipelineInvalid

REPO = Path(__file__).resolve().parents[2]
PIPELINES = REPO / "pipelines"
TABLE4 = "configs/profiles/staleflow-table4-qwen3-30b-a3b.json"


def _write(tmp_path: Path, text: str, name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_mixed_plan_routes_each_task_through_its_own_stages():
    plan = compile_pipeline(PIPELINES / "mixed.yaml")
    assert plan["plan_version"] == 2
    assert plan["tasks"] == {
        "arith": {"source": "builtin:arith", "weight": 1.0, "limit": None, "prompt_field": "prompt", "answer_field": "answer",
                  "prompt_format": "raw", "system_prompt": None, "rollout": "gen_arith", "reward": "score_arith", "filter": None, "holdout": None},
        "repeat": {"source": "builtin:repeat", "weight": 1.0, "limit": None, "prompt_field": "prompt", "answer_field": "answer",
                   "prompt_format": "raw", "system_prompt": None, "rollout": "gen_repeat", "reward": "score_repeat", "filter": None, "holdout": None},
    }
    coord = plan["control"]["coordination"]
    assert coord["gen_arith"]["tasks"] == ["arith"] and coord["gen_repeat"]["tasks"] == ["repeat"]
    assert coord["gen_arith"]["allow_foreign_profile"] is False


def test_mixed_plan_actors_carry_their_constructor_arguments():
    plan = compile_pipeline(PIPELINES / "mixed.yaml")
    rollouts = {a["name"]: a for a in plan["actors"] if a["role"] == "rollout"}
    assert set(rollouts) == {"gen_arith-0", "gen_repeat-0"}
    arith, repeat = rollouts["gen_arith-0"], rollouts["gen_repeat-0"]
    assert (arith["stage"], arith["index"], arith["engine"], arith["num_cpus"], arith["tasks"]) == ("gen_arith", 0, "hf", 0.5, ["arith"])
    assert arith["engine_kwargs"] == {"max_running": 64, "max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0, "seed": 0,
                                      "dtype": "float32", "max_model_len": 128}
    assert repeat["engine_kwargs"]["max_new_tokens"] == 48 and repeat["tasks"] == ["repeat"]
    assert (arith["group_size"], arith["group_redundancy"]) == (8, 0)
    (trainer,) = [a for a in plan["actors"] if a["role"] == "trainer"]
    assert Path(trainer["deepspeed"]).is_absolute() and Path(trainer["deepspeed"]).exists()
    assert trainer["trainer_kwargs"] == {"lr": 3e-4, "clip_low": 0.2, "clip_high": 0.28, "loss_agg": "token", "kl_coef": 0.0,
                                         "max_importance_ratio": 5.0, "off_policy": "decoupled", "tis_cap": 2.0,
                                         "mask_low": 0.5, "mask_high": 2.0, "temperature": 1.0, "seed": 0, "dtype": "float32",
                                         "packing": True, "micro_batch_tokens": None, "gradient_checkpointing": False,
                                         "lr_schedule": {"kind": "constant", "warmup_steps": 0, "min_ratio": 0.1,
                                                         "total_steps": 20}}
    assert (trainer["steps"], trainer["checkpoint_every"]) == (20, 10)
    assert {a["role"] for a in plan["actors"]} == {"rollout", "trainer", "payload_store", "parameter_server"}


def test_data_operators_follow_the_data_flow():
    plan = compile_pipeline(PIPELINES / "mixed.yaml")
    ops = plan["data_operators"]
    assert [(o["name"], o["kind"]) for o in ops] == [("read:arith", "read"), ("read:repeat", "read"),
                                                     ("score_arith", "reward"), ("score_repeat", "reward")]
    assert ops[0] == {"name": "read:arith", "kind": "read", "task": "arith", "source": "builtin:arith", "weight": 1.0,
                      "limit": None, "prompt_field": "prompt", "answer_field": "answer", "seed": 0, "to": "gen_arith"}
    assert ops[2] == {"name": "score_arith", "kind": "reward", "stage": "score_arith", "fn": "numeric_close", "tasks": ["arith"],
                      "concurrency": 1, "num_cpus": 0.25, "resources": {}}
    plan = compile_pipeline(PIPELINES / "quickstart.yaml")
    assert [o["name"] for o in plan["data_operators"]] == ["read:main", "score", "filter:score->buffer"]
    assert plan["data_operators"][-1] == {"name": "filter:score->buffer", "kind": "filter", "after": "score", "fn": "drop_uniform_groups"}


def test_one_source_is_the_task_main():
    plan = compile_pipeline(PIPELINES / "quickstart.yaml")
    assert plan["tasks"] == {"main": {"source": "builtin:repeat", "weight": 1.0, "limit": None, "prompt_field": "prompt",
                                      "answer_field": "answer", "prompt_format": "raw", "system_prompt": None,
                                      "rollout": "rollout", "reward": "score", "filter": "drop_uniform_groups",
                                      "holdout": None}}
    assert plan["control"]["coordination"]["rollout"]["tasks"] == ["main"]


def test_overrides_reach_the_tasks():
    plan = compile_pipeline(PIPELINES / "mixed.yaml", ["data.tasks.arith.weight=3", "data.tasks.repeat.limit=100"])
    assert (plan["tasks"]["arith"]["weight"], plan["tasks"]["repeat"]["limit"]) == (3.0, 100)


def test_summary_lists_each_task_and_its_route(tmp_path, capsys):
    assert main(["compile", str(PIPELINES / "mixed.yaml"), "-o", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "arith:   gen_arith -> score_arith" in out and "repeat:  gen_repeat -> score_repeat" in out
    assert "data 2 task types" in out


def test_one_rollout_may_split_its_tasks_over_reward_stages(tmp_path):
    (tmp_path / "qa.jsonl").write_text(json.dumps({"question": "1+1=", "reply": "2"}) + "\n")
    path = _write(tmp_path, """
name: split
model: {path: "builtin:tiny-llama", max_model_len: 128}
data:
  tasks:
    arith: {source: "builtin:arith", weight: 2}
    qa:    {source: qa.jsonl, prompt_field: question, answer_field: reply, limit: 10}
stages:
  rollout: {kind: rollout, max_new_tokens: 8}
  exact:   {kind: reward, fn: exact_match}
  close:   {kind: reward, fn: numeric_close}
  buffer:  {kind: buffer, batch_groups: 4}
  train:   {kind: train, deepspeed: configs/deepspeed/zero1.json}
edges:
  - {from: data,    to: rollout, policy: {kind: streaming}}
  - {from: rollout, to: close,   tasks: [arith], policy: {kind: streaming}}
  - {from: rollout, to: exact,   tasks: [qa],    policy: {kind: streaming}}
  - {from: close,   to: buffer,  policy: {kind: streaming, filter: drop_uniform_groups}}
  - {from: exact,   to: buffer,  policy: {kind: streaming}}
  - {from: buffer,  to: train,   policy: {kind: in_flight_limit, eta: 1}}
  - {from: train,   to: rollout, policy: {kind: weight_sync}}
""")
    plan = compile_pipeline(path)
    qa = plan["tasks"]["qa"]
    assert qa["source"] == str((tmp_path / "qa.jsonl").resolve()) == plan["pipeline"]["data"]["tasks"]["qa"]["source"]
    assert (qa["prompt_field"], qa["answer_field"], qa["limit"], qa["reward"], qa["filter"]) == ("question", "reply", 10, "exact", None)
    assert (plan["tasks"]["arith"]["reward"], plan["tasks"]["arith"]["filter"], plan["tasks"]["arith"]["weight"]) == (
        "close", "drop_uniform_groups", 2.0)
    assert [a["tasks"] for a in plan["actors"] if a["role"] == "rollout"] == [["arith", "qa"]]
    assert {o["name"]: o.get("tasks") for o in plan["data_operators"] if o["kind"] == "reward"} == {"close": ["arith"], "exact": ["qa"]}


def test_a_foreign_profile_needs_an_explicit_choice():
    staleflow = PIPELINES / "staleflow.yaml"
    with pytest.raises(PipelineInvalid, match=r"allow_foreign_profile: true \[profile-mismatch\]"):
        compile_pipeline(staleflow, [f"stages.rollout.coordinator.profile={TABLE4}"])
    plan = compile_pipeline(staleflow, [f"stages.rollout.coordinator.profile={TABLE4}",
                                        "stages.rollout.coordinator.allow_foreign_profile=true"])
    coord = plan["control"]["coordination"]["rollout"]
    assert coord["allow_foreign_profile"] is True and coord["profile"].endswith("staleflow-table4-qwen3-30b-a3b.json")


def test_a_profile_matches_a_model_directory_by_its_name(tmp_path):
    model = tmp_path / "Qwen3-30B-A3B"
    model.mkdir()
    (model / "config.json").write_text("{}")
    plan = compile_pipeline(PIPELINES / "staleflow.yaml", [f"model.path={model}", "stages.rollout.engine=vllm",
                                                           f"stages.rollout.coordinator.profile={TABLE4}"])
    assert plan["control"]["coordination"]["rollout"]["profile"].endswith("staleflow-table4-qwen3-30b-a3b.json")


def test_the_oracle_ranker_is_not_reachable_from_a_pipeline():
    assert "oracle" not in registry.RANKERS
    with pytest.raises(registry.ComponentError):
        registry.check_reference("ranker", "oracle")
