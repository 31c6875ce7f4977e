"""`rlflow compile --gpus N`: the plan and its summary say where each stage runs, in which dtype, with which vLLM
settings, for a cluster of N GPUs, on a machine without any."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlflow import devices
from rlflow.cli import main
from rlflow.compiler import compile_pipeline, gpus_given
from rlflow.errors import PipelineInvalid
from rlflow.plan_model import Plan
from rlflow.schema import Pipeline

QUICKSTART = Path(__file__).resolve().parents[2] / "pipelines" / "quickstart.yaml"
VLLM = ["--set", "stages.rollout.engine=vllm"]


def compiled(tmp_path, capsys, *args) -> tuple[dict, str]:
    out = tmp_path / "plan.json"
    assert main(["compile", str(QUICKSTART), "-o", str(out), *args]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def actor(plan: dict, role: str) -> dict:
    return next(a for a in plan["actors"] if a["role"] == role)


def test_no_gpus_compiles_to_cpu_and_float32(tmp_path, capsys):
    plan, printed = compiled(tmp_path, capsys, "--gpus", "0", *VLLM)
    assert plan["pipeline"]["model"]["dtype"] == "float32" and plan["resources"]["num_gpus"] == 0
    assert actor(plan, "rollout")["engine_kwargs"].items() >= {"enforce_eager": True, "tensor_parallel_size": 1}.items()
    assert "gpu_memory_utilization" not in actor(plan, "rollout")["engine_kwargs"]
    assert "  devices: 0 GPUs (--gpus 0); dtype float32 (auto: the stages run on CPU)" in printed
    assert "vllm: tensor_parallel_size=1, eager" in printed


def test_two_gpus_one_each_in_bfloat16_with_cuda_graphs(tmp_path, capsys):
    plan, printed = compiled(tmp_path, capsys, "--gpus", "2", *VLLM)
    rollout, trainer = actor(plan, "rollout"), actor(plan, "trainer")
    assert rollout["num_gpus"] == trainer["num_gpus"] == 1
    assert rollout["engine_kwargs"]["dtype"] == trainer["trainer_kwargs"]["dtype"] == "bfloat16"
    assert rollout["engine_kwargs"].items() >= {"enforce_eager": False, "gpu_memory_utilization": 0.85,
                                                "tensor_parallel_size": 1, "enable_sleep_mode": False}.items()
    assert plan["resources"]["num_gpus"] == 2 and plan["resources"]["cluster"]["num_gpus"] == 2
    assert plan["devices"]["given_gpus"] == 2 and gpus_given(plan) == 2
    assert "devices: 2 GPUs (--gpus 2); dtype bfloat16 (auto: every stage runs on a GPU)" in printed
    assert "rollout  cuda, 1 GPU per instance  auto  vllm: tensor_parallel_size=1, CUDA graphs, " \
           "gpu_memory_utilization=0.85" in printed
    # every default resolved: the plan's pipeline validates again unchanged
    assert Pipeline.model_validate(plan["pipeline"]).model_dump(mode="json", by_alias=True) == plan["pipeline"]


def test_one_gpu_colocates_and_counts_the_evaluator(tmp_path, capsys):
    plan, printed = compiled(tmp_path, capsys, "--gpus", "1", *VLLM, "--set", "data.eval=0.1")
    shares = {a["role"]: a["num_gpus"] for a in plan["actors"] if a["num_gpus"]}
    assert shares == {"rollout": 0.3333, "trainer": 0.3333, "evaluator": 0.3333}
    assert plan["resources"]["num_gpus"] <= 1
    assert actor(plan, "evaluator")["engine_kwargs"]["enable_sleep_mode"] is True
    assert "colocated: 3 actors, trainer and rollout, share one GPU" in printed
    assert "evaluator  cuda, 0.3333 GPU" in printed


def test_tensor_parallel_from_a_stages_gpus(tmp_path, capsys):
    plan, printed = compiled(tmp_path, capsys, "--gpus", "8", *VLLM, "--set", "stages.rollout.num_gpus=4")
    assert actor(plan, "rollout")["engine_kwargs"]["tensor_parallel_size"] == 4
    assert "rollout  cuda, 4 GPU per instance  declared  vllm: tensor_parallel_size=4" in printed
    assert "devices: 8 GPUs (--gpus 8), 3 unused" in printed


def test_gpus_asked_for_without_gpus_exit_2_naming_the_rule(capsys):
    assert main(["validate", str(QUICKSTART), "--gpus", "0", "--set", "stages.train.num_gpus=1"]) == 2
    err = capsys.readouterr().err
    assert "stages.train.num_gpus" in err and "[no-gpus]" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exit_:
        main(["compile", str(QUICKSTART), "--gpus", "-1"])
    assert exit_.value.code == 2


def test_the_local_count_is_the_default(monkeypatch):
    monkeypatch.setattr(devices, "_nvidia_gpus", lambda: (2, "nvidia-smi -L"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    plan = compile_pipeline(QUICKSTART)
    assert plan["devices"]["gpus"] == 2 and plan["devices"]["counted_by"] == "nvidia-smi -L"
    assert gpus_given(plan) is None and plan["resources"]["cluster"]["num_gpus"] == 2


def test_run_refuses_a_plan_compiled_for_gpus_this_machine_lacks(monkeypatch):
    from rlflow.runtime.launch import check_local_gpus

    plan = Plan.of(compile_pipeline(QUICKSTART, gpus=2))
    monkeypatch.setattr(devices, "_nvidia_gpus", lambda: (0, "no NVIDIA driver found"))
    with pytest.raises(PipelineInvalid) as e:
        check_local_gpus(plan)
    assert e.value.problems[0].rule == "no-gpus" and "compiled for 2 GPU(s) (--gpus 2)" in e.value.render()
    check_local_gpus(Plan.of(compile_pipeline(QUICKSTART, gpus=0)))  # a CPU plan runs anywhere


SYNCHRONOUS = ["--set", "edges.3.policy={kind: barrier}"]


@pytest.mark.parametrize("gpus, policy, level, why", [
    ("1", SYNCHRONOUS, 2, "shares a GPU with the trainer in a synchronous run"),
    ("1", [], 0, "shares a GPU with the trainer, but the run is asynchronous: both stay resident"),
    ("2", SYNCHRONOUS, 0, "its own device"),
    ("0", SYNCHRONOUS, 0, "its own device"),
])
def test_the_engine_sleeps_during_train_steps_only_where_it_shares_a_gpu_in_a_synchronous_run(tmp_path, capsys, gpus,
                                                                                               policy, level, why):
    plan, printed = compiled(tmp_path, capsys, "--gpus", gpus, *VLLM, *policy)
    rollout = actor(plan, "rollout")
    assert (rollout["sleep_level"], rollout["sleep_reason"]) == (level, why)
    assert ("sleeps during train steps at level 2 (shares a GPU with the trainer in a synchronous run)" in printed) == bool(level)
    if gpus == "1":  # vLLM is started with sleep mode wherever it shares the GPU (its evaluator too)
        assert rollout["engine_kwargs"]["enable_sleep_mode"] is True


def test_sleep_declared_on_cpu_with_the_hf_engine_and_lora_keeps_the_base(tmp_path, capsys):
    plan, printed = compiled(tmp_path, capsys, "--gpus", "0", *SYNCHRONOUS, "--set", "stages.rollout.sleep_during_train=true")
    assert (actor(plan, "rollout")["sleep_level"], actor(plan, "rollout")["sleep_reason"]) == (2, "declared (sleep_during_train: true)")
    assert "rollout  cpu  auto  sleeps during train steps at level 2 (declared (sleep_during_train: true))" in printed
    plan, _ = compiled(tmp_path, capsys, "--gpus", "0", *SYNCHRONOUS, "--set", "stages.rollout.sleep_during_train=true",
                       "--set", "stages.train.lora={rank: 4}")
    assert actor(plan, "rollout")["sleep_level"] == 1  # a version carries only the adapters: the base must stay
    plan, _ = compiled(tmp_path, capsys, "--gpus", "1", *VLLM, *SYNCHRONOUS, "--set", "stages.rollout.sleep_during_train=false")
    assert actor(plan, "rollout")["sleep_level"] == 0


def test_auto_transport_is_the_object_store_with_the_reason_per_engine(tmp_path, capsys):
    """What `weight_sync.transport: auto` resolves to, and the reason the summary prints, per engine; a declared one
    is kept."""
    plan, printed = compiled(tmp_path, capsys, "--gpus", "0")
    assert actor(plan, "trainer")["weights"] | {"bucket_bytes": 0} == {
        "transport": "object_store", "declared": "auto", "bucket_bytes": 0,
        "reason": "auto: the engines copy from the object store where it lands"}
    assert "weights to rollout: object_store (auto: the engines copy from the object store where it lands)" in printed
    plan, printed = compiled(tmp_path, capsys, "--gpus", "0", *VLLM)
    assert actor(plan, "trainer")["weights"]["transport"] == "object_store"
    assert "weights to rollout: object_store (auto: vLLM's workers read each bucket from the store themselves, in memory)" in printed
    plan, printed = compiled(tmp_path, capsys, "--gpus", "0", *VLLM, "--set", "edges.4.policy.transport=collective")
    assert actor(plan, "trainer")["weights"]["transport"] == "collective" and "weights to rollout: collective," in printed


def test_cpu_threads_are_the_nodes_cores_in_turns_when_synchronous_else_each_stages_cpus(tmp_path, capsys):
    """A synchronous run alternates generation and training: each actor of a phase takes the node's cores, shared
    among the phase's actors; an asynchronous one runs them side by side, each on its num_cpus; declared wins."""
    sync = ["--set", "stages.rollout.replicas=2"]

    def synchronous(*args):
        out = tmp_path / "sync.json"
        assert main(["compile", str(QUICKSTART.with_name("synchronous.yaml")), "-o", str(out), "--gpus", "0", *args]) == 0
        return json.loads(out.read_text()), capsys.readouterr().out

    plan, printed = synchronous(*sync)
    assert (actor(plan, "rollout")["threads"], actor(plan, "rollout")["threads_share"]) == ("cores", 2)
    assert (actor(plan, "trainer")["threads"], actor(plan, "trainer")["threads_share"]) == ("cores", 1)
    assert "cpu threads per actor: rollout: the node's cores / 2 (synchronous:" in printed
    assert "train: the node's cores (synchronous:" in printed
    plan, printed = compiled(tmp_path, capsys, "--gpus", "0", "--set", "stages.train.num_cpus=2")
    assert (actor(plan, "rollout")["threads"], actor(plan, "trainer")["threads"]) == (1, 2)
    plan, printed = synchronous(*sync, "--set", "stages.train.threads=3")
    assert actor(plan, "trainer")["threads"] == 3 and "train: 3 (declared)" in printed
