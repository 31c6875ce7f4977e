"""train.lora lowered into the plan: the trainer, every rollout instance and the evaluator get the same block."""

from pathlib import Path

from rlflow.compiler import compile_pipeline
from rlflow.schema import Pipeline

PIPELINE = Path(__file__).resolve().parents[2] / "pipelines" / "quickstart.yaml"


def test_the_lora_block_reaches_the_trainer_the_engines_and_the_evaluator():
    plan = compile_pipeline(PIPELINE, ["stages.train.lora.rank=4", "data.eval=0.1", "stages.rollout.replicas=2"])
    expected = {"rank": 4, "alpha": 16.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "dropout": 0.0}
    (trainer,) = [a for a in plan["actors"] if a["role"] == "trainer"]
    assert trainer["trainer_kwargs"]["lora"] == expected
    engines = [a["engine_kwargs"] for a in plan["actors"] if a["role"] in ("rollout", "evaluator")]
    assert len(engines) == 3 and all(kw["lora"] == expected for kw in engines)


def test_plans_without_lora_carry_no_lora_key():
    plan = compile_pipeline(PIPELINE, [])
    assert not any("lora" in a.get("trainer_kwargs", a.get("engine_kwargs", {})) for a in plan["actors"])


def test_the_schema_documents_every_lora_field():
    defs = Pipeline.model_json_schema()["$defs"]
    assert defs["TrainStage"]["properties"]["lora"].get("description")
    assert set(defs["LoraSpec"]["properties"]) == {"rank", "alpha", "target_modules", "dropout"}
    assert all(field.get("description") for field in defs["LoraSpec"]["properties"].values())
