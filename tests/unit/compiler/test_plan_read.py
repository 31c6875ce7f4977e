"""rlflow.plan_read: each rollout stage's coordination block and its profile, read without the simulator."""

import subprocess
import sys
from pathlib import Path

import pytest

from rlflow.compiler import compile_pipeline
from rlflow.operators.cost_profile import CostProfile, ProfileError
from rlflow.plan_read import named_profile, rollout_stages, stage_coordination

PIPELINES = Path(__file__).resolve().parents[3] / "pipelines"


def _two_rollout_stages() -> dict:
    """The staleflow plan with a second rollout stage for task 'repeat', as a multi-task plan writes it."""
    plan = compile_pipeline(PIPELINES / "staleflow.yaml", [])
    stages = plan["pipeline"]["stages"]
    stages["rollout_repeat"] = dict(stages["rollout"])
    coord = plan["control"]["coordination"]
    coord["rollout"]["tasks"] = ["arith"]
    coord["rollout_repeat"] = {**coord["rollout"], "routing": "least_loaded", "migration": "none", "profile": None,
                               "weight_sync": None, "tasks": ["repeat"], "allow_foreign_profile": True}
    return plan


def test_each_rollout_stage_has_its_own_coordination():
    plan = _two_rollout_stages()
    assert rollout_stages(plan) == ["rollout", "rollout_repeat"]
    first, second = (stage_coordination(plan, s) for s in rollout_stages(plan))
    assert (first.routing, first.migration, first.sync, first.tasks, first.allow_foreign_profile) == (
        "cost_model", "threshold", "throughput_aware", ("arith",), False)
    assert (second.routing, second.migration, second.sync, second.partial_rollout) == (
        "least_loaded", "none", "global", False)  # no weight_sync block: a global barrier
    assert second.tasks == ("repeat",) and second.allow_foreign_profile and second.vanilla


def test_a_plan_without_the_new_keys_reads_as_before():
    plan = compile_pipeline(PIPELINES / "staleflow.yaml", [])
    for key in ("tasks", "allow_foreign_profile"):  # a plan compiled before stages had tasks
        plan["control"]["coordination"]["rollout"].pop(key, None)
    pc = stage_coordination(plan, "rollout")
    assert pc.tasks is None and pc.allow_foreign_profile is False
    assert (pc.mu, pc.phi_wait, pc.phi_throughput) == (0.3, 3, 5.0)


def test_an_unknown_stage_names_the_rollout_stages():
    with pytest.raises(ValueError, match="no rollout stage 'score'.*rollout, rollout_repeat"):
        stage_coordination(_two_rollout_stages(), "score")


def test_load_profile_has_no_default():
    with pytest.raises(ProfileError, match="no cost-model profile"):
        named_profile(None)
    assert named_profile("staleflow-table4-qwen3-30b-a3b") == CostProfile.load("staleflow-table4-qwen3-30b-a3b")
    with pytest.raises(ProfileError, match="no file"):
        named_profile("no-such-profile")


def test_reading_a_plan_imports_neither_the_simulator_nor_heavy_dependencies():
    code = ("import sys, rlflow.plan_read; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'torch', 'numpy') or m.startswith('rlflow.sim')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
