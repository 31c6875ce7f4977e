"""train.algo and its options, lowered into the trainer's kwargs of the plan (DeepSpeedTrainer's arguments)."""

from pathlib import Path

import pytest

from rlflow.compiler import compile_pipeline
from rlflow.schema import Pipeline

PIPELINE = Path(__file__).resolve().parents[2] / "pipelines" / "one_step.yaml"  # max_new_tokens 8


def trainer_kwargs(*overrides: str) -> tuple[dict, Pipeline]:
    plan = compile_pipeline(PIPELINE, list(overrides))
    (trainer,) = [a for a in plan["actors"] if a["role"] == "trainer"]
    return trainer["trainer_kwargs"], Pipeline.model_validate(plan["pipeline"])  # the resolved pipeline validates again


def test_grpo_plans_carry_no_new_keys():
    kwargs, _ = trainer_kwargs()
    assert kwargs["loss_agg"] == "token"
    assert not {"algo", "algo_options", "entropy_coef", "kl_estimator", "max_new_tokens", "overlong"} & set(kwargs)


@pytest.mark.parametrize("algo, loss_agg, extra", [
    ("dr_grpo", "seq-mean-token-sum-norm", {"max_new_tokens": 8}),
    ("rloo", "token-mean", {}),
    ("reinforce_pp", "token-mean", {"algo_options": {"kl_in_reward": True}}),
    ("gspo", "seq-mean-token-mean", {"algo_options": {"clip_low": 3e-4, "clip_high": 4e-4}}),
    ("cispo", "token-mean", {"algo_options": {"clip_low": None, "clip_high": 4.0}}),
    ("ppo", "token-mean", {"algo_options": {"gamma": 1.0, "lam": 0.95, "value_clip": 0.2, "critic_lr": None,
                                            "critic_epochs": 1, "critic_warmup_steps": 0, "critic_model": None,
                                            "normalize_advantages": True}}),
])
def test_each_algorithm_reaches_the_trainer_with_its_defaults(algo, loss_agg, extra):
    kwargs, spec = trainer_kwargs(f"stages.train.algo={algo}")
    assert kwargs["algo"] == algo and kwargs["loss_agg"] == loss_agg
    assert {k: kwargs[k] for k in extra} == extra
    assert spec.stages["train"].algo == algo


def test_shared_options_reach_the_trainer():
    kwargs, _ = trainer_kwargs("stages.train.entropy_coef=0.001", "stages.train.kl_coef=0.01",
                               "stages.train.kl_estimator=k2", "stages.train.overlong.cache_tokens=2")
    assert (kwargs["entropy_coef"], kwargs["kl_estimator"]) == (0.001, "k2")
    assert kwargs["overlong"] == {"max_tokens": 8, "cache_tokens": 2, "penalty_factor": 1.0}  # L_max: max_new_tokens


def test_the_schema_lists_the_algorithms_and_documents_their_options():
    defs = Pipeline.model_json_schema()["$defs"]
    train = defs["TrainStage"]["properties"]
    assert set(train["algo"]["enum"]) == {"grpo", "dr_grpo", "rloo", "reinforce_pp", "gspo", "cispo", "ppo"}
    for block in ("GspoOptions", "CispoOptions", "ReinforcePPOptions", "PpoOptions", "OverlongShaping"):
        assert all(field.get("description") for field in defs[block]["properties"].values()), block
    for field in ("loss_agg", "kl_estimator", "entropy_coef", "overlong", "gspo", "cispo", "reinforce_pp", "ppo"):
        assert train[field].get("description"), field


def test_a_separate_critic_model_is_found_like_the_pipeline_files(tmp_path):
    critic = tmp_path / "critic-model"
    critic.mkdir()
    kwargs, _ = trainer_kwargs("stages.train.algo=ppo", f"stages.train.ppo.critic_model={critic}",
                               "stages.train.ppo.critic_lr=1e-5")
    assert kwargs["algo_options"]["critic_model"] == str(critic) and kwargs["algo_options"]["critic_lr"] == 1e-5
