"""The device rules (rlflow/devices.py) with the GPU count as input: 0, 1, 2, 8 GPUs, declared vs auto, colocated,
tensor parallel, the evaluator counted, dtype resolution. No GPU needed."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from rlflow import devices
from rlflow.devices import GpuCount, place, resolve, split, vllm_settings
from rlflow.schema import Pipeline


def pipeline(rollout: dict | None = None, train: dict | None = None, *, resources: dict | None = None,
             dtype: str | None = None, eval: float | None = None) -> Pipeline:
    data = {"source": "builtin:arith", **({"eval": eval} if eval is not None else {})}
    doc = {"name": "t", "data": data,
           "stages": {"rollout": {"kind": "rollout", "engine": "vllm", **(rollout or {})},
                      "score": {"kind": "reward", "fn": "exact_match"},
                      "buffer": {"kind": "buffer", "batch_groups": 8},
                      "train": {"kind": "train", **(train or {})}},
           "edges": [{"from": "data", "to": "rollout", "policy": {"kind": "streaming"}},
                     {"from": "rollout", "to": "score", "policy": {"kind": "streaming"}},
                     {"from": "score", "to": "buffer", "policy": {"kind": "streaming"}},
                     {"from": "buffer", "to": "train", "policy": {"kind": "staleness_bound", "eta": 1}},
                     {"from": "train", "to": "rollout", "policy": {"kind": "weight_sync"}}]}
    if resources is not None:
        doc["resources"] = resources
    if dtype is not None:
        doc["model"] = {"dtype": dtype}
    return Pipeline.model_validate(doc)


def decide(spec: Pipeline, gpus: int | None):
    """(devices, problems, the resolved pipeline) on a cluster of `gpus` GPUs."""
    d, problems = place(spec, GpuCount(gpus, f"--gpus {gpus}"))
    return d, problems, resolve(spec, d)


def gpus_of(d) -> dict[str, float]:
    return {n: p.gpus for n, p in d.stages.items()}


# ---------------------------------------------------------------------------------------------- 0, 1, 2, 8 GPUs
def test_no_gpus_runs_everything_on_cpu_in_float32_eagerly():
    d, problems, spec = decide(pipeline(), 0)
    assert problems == [] and gpus_of(d) == {"rollout": 0, "train": 0}
    assert d.dtype == "float32" and d.dtype_reason == "auto: the stages run on CPU"
    assert spec.model.dtype == "float32" and spec.resources.num_gpus == 0
    assert vllm_settings(spec, "rollout") == {"tensor_parallel_size": 1, "enforce_eager": True, "enable_sleep_mode": False}


def test_one_gpu_colocates_trainer_and_rollout_with_sleep_mode():
    d, problems, spec = decide(pipeline(), 1)
    assert problems == [] and gpus_of(d) == {"rollout": 0.5, "train": 0.5}
    assert d.split.startswith("colocated") and d.dtype == "bfloat16"
    assert vllm_settings(spec, "rollout") == {"tensor_parallel_size": 1, "enforce_eager": False,
                                              "gpu_memory_utilization": 0.42, "enable_sleep_mode": True}


def test_two_gpus_give_each_side_its_own():
    d, problems, spec = decide(pipeline(), 2)
    assert problems == [] and gpus_of(d) == {"rollout": 1, "train": 1} and d.split == "one GPU each"
    assert vllm_settings(spec, "rollout") == {"tensor_parallel_size": 1, "enforce_eager": False,
                                              "gpu_memory_utilization": 0.85, "enable_sleep_mode": False}
    assert d.as_dict()["unused_gpus"] == 0


def test_eight_gpus_one_each_and_the_rest_reported_unused():
    d, problems, _ = decide(pipeline({"replicas": 3}, eval=0.1), 8)
    assert problems == [] and gpus_of(d) == {"rollout": 1, "train": 1} and d.evaluator.gpus == 1
    assert d.as_dict()["unused_gpus"] == 3  # 3 instances + 1 rank + the evaluator


def test_too_few_gpus_for_one_each_the_trainer_keeps_a_whole_one_and_rollout_shares_the_rest():
    d, _, spec = decide(pipeline({"replicas": 4}, eval=0.1), 3)
    assert gpus_of(d) == {"rollout": 0.3333, "train": 1} and d.evaluator.gpus == 0.3333  # 5 on 2 GPUs: 3 to a GPU
    assert 3 * 0.3333 <= 1
    assert vllm_settings(spec, "rollout")["enable_sleep_mode"] is False  # not on the trainer's GPU
    assert vllm_settings(spec, "rollout")["gpu_memory_utilization"] == 0.28


@pytest.mark.parametrize("left, ranks, rest, expected", [
    (0, 1, 2, (0, 0)), (3, 1, 2, (1, 1)), (8, 1, 2, (1, 1)), (1, 1, 1, (0.5, 0.5)), (1, 1, 3, (0.25, 0.25)),
    (2, 1, 3, (1, 0.3333)), (2, 0, 3, (0, 0.5)), (2, 2, 1, (0, 0)), (4, 2, 4, (1, 0.5)), (1, 0, 0, (0, 0)),
])
def test_the_default_split(left, ranks, rest, expected):
    assert split(left, ranks, rest)[:2] == expected


def test_several_ranks_without_a_gpu_each_stay_on_cpu_and_say_why():
    d, problems, _ = decide(pipeline(train={"replicas": 2}), 2)
    assert problems == [] and gpus_of(d) == {"rollout": 0, "train": 0}
    assert "2 trainer ranks need a GPU each (NCCL)" in d.split and d.dtype == "float32"
    d, _, _ = decide(pipeline(train={"replicas": 2}), 3)
    assert gpus_of(d) == {"rollout": 1, "train": 1}


def test_an_elastic_stage_counts_at_its_max_replicas():
    d, _, _ = decide(pipeline({"elastic": {"max_replicas": 3}}), 3)
    assert gpus_of(d) == {"rollout": 0.5, "train": 1}  # 3 instances on the 2 GPUs the trainer leaves


# ---------------------------------------------------------------------------------------------- declared vs auto
def test_declared_gpus_are_kept_and_the_auto_stages_take_what_is_left():
    d, problems, _ = decide(pipeline({"num_gpus": 2, "replicas": 2}), 8)
    assert problems == [] and gpus_of(d) == {"rollout": 2, "train": 1}
    assert d.stages["rollout"].declared and not d.stages["train"].declared
    d, _, _ = decide(pipeline({"num_gpus": 1}, {"num_gpus": 0}), 8)
    assert gpus_of(d) == {"rollout": 1, "train": 0}
    assert (d.dtype, d.dtype_reason) == ("float32", "auto: some stages run on CPU")


def test_declared_zero_keeps_a_stage_on_cpu_on_a_gpu_machine():
    d, problems, _ = decide(pipeline({"num_gpus": 0}, {"num_gpus": 0}), 8)
    assert problems == [] and gpus_of(d) == {"rollout": 0, "train": 0} and d.dtype == "float32"


def test_tensor_parallel_over_an_instances_gpus():
    _, problems, spec = decide(pipeline({"num_gpus": 4}), 8)
    assert problems == []
    assert vllm_settings(spec, "rollout") == {"tensor_parallel_size": 4, "enforce_eager": False,
                                              "gpu_memory_utilization": 0.85, "enable_sleep_mode": False}


def test_declared_fractions_that_may_share_a_gpu_with_the_trainer_get_sleep_mode():
    _, problems, spec = decide(pipeline({"num_gpus": 0.5, "gpu_memory_utilization": 0.3}, {"num_gpus": 0.5}), 1)
    assert problems == []
    assert vllm_settings(spec, "rollout")["enable_sleep_mode"] is True
    assert vllm_settings(spec, "rollout")["gpu_memory_utilization"] == 0.3  # declared: kept


def test_other_engines_get_no_vllm_settings():
    _, _, spec = decide(pipeline({"engine": "hf"}), 2)
    assert vllm_settings(spec, "rollout") == {}


# ---------------------------------------------------------------------------------------------- dtype
@pytest.mark.parametrize("gpus, declared, expected", [
    (0, None, "float32"), (1, None, "bfloat16"), (8, None, "bfloat16"),
    (8, "float32", "float32"), (0, "bfloat16", "bfloat16"), (2, "float16", "float16"),
])
def test_dtype_auto_follows_the_devices_and_a_declared_one_is_kept(gpus, declared, expected):
    d, _, spec = decide(pipeline(dtype=declared), gpus)
    assert d.dtype == spec.model.dtype == expected
    assert d.dtype_reason.startswith("declared" if declared else "auto")


def test_auto_is_the_default_dtype_and_gpu_count():
    spec = pipeline()
    assert spec.model.dtype == "auto" and spec.resources.num_gpus == "auto"
    assert spec.stages["rollout"].num_gpus is None and spec.stages["train"].num_gpus is None


# ---------------------------------------------------------------------------------------------- rules
def rules(problems) -> list[tuple[str, str]]:
    return sorted((".".join(map(str, p.loc)), p.rule) for p in problems)


def test_gpus_asked_on_a_cluster_without_any_are_rejected_by_name():
    _, problems, _ = decide(pipeline({"num_gpus": 1}, {"num_gpus": 1}), 0)
    assert rules(problems) == [("stages.rollout.num_gpus", "no-gpus"), ("stages.train.num_gpus", "no-gpus")]
    assert "--gpus N" in problems[0].fix
    _, problems, _ = decide(pipeline(resources={"num_gpus": 2}), 0)
    assert rules(problems) == [("resources.num_gpus", "no-gpus")]


def test_the_evaluator_is_counted():
    _, problems, _ = decide(pipeline({"num_gpus": 1}, {"num_gpus": 1}), 2)
    assert problems == []
    _, problems, _ = decide(pipeline({"num_gpus": 1}, {"num_gpus": 1}, eval=0.1), 2)
    assert rules(problems) == [("resources.num_gpus", "cluster-too-small")]
    assert "3 GPU(s) (rollout 1 x 1, train 1 x 1, evaluator 1)" in problems[0].message


def test_more_gpus_declared_than_the_cluster_has():
    _, problems, _ = decide(pipeline(resources={"num_gpus": 4}), 2)
    assert rules(problems) == [("resources.num_gpus", "more-gpus-than-cluster")]
    d, problems, spec = decide(pipeline(resources={"num_gpus": 1}), 8)  # fewer than there are: the plan uses 1
    assert problems == [] and d.gpus == spec.resources.num_gpus == 1 and gpus_of(d) == {"rollout": 0.5, "train": 0.5}


def test_more_than_one_gpu_per_actor_comes_whole():
    _, problems, _ = decide(pipeline({"num_gpus": 1.5}), 2)
    assert rules(problems) == [("stages.rollout.num_gpus", "whole-gpus")]


def test_a_joined_cluster_is_not_counted_and_guessed_at():
    spec = pipeline({"num_gpus": 1}, resources={"address": "ray://head:10001"})
    count = devices.gpu_count(spec)
    assert count.gpus is None and "not counted" in count.counted_by
    d, problems = place(spec, count)
    assert problems == [] and gpus_of(d) == {"rollout": 1, "train": 0} and "not counted" in d.split
    assert resolve(spec, d).resources.num_gpus == "auto"
    assert devices.gpu_count(spec, 4) == GpuCount(4, "--gpus 4")


# ---------------------------------------------------------------------------------------------- counting, engine
def test_local_count_honours_cuda_visible_devices(monkeypatch):
    monkeypatch.setattr(devices, "_nvidia_gpus", lambda: (4, "nvidia-smi -L"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert devices.local_gpus().gpus == 4
    for visible, n in [("", 0), ("0,2", 2), ("1,-1,2", 1), ("0,1,2,3,4,5", 4)]:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert devices.local_gpus().gpus == n


def test_devices_module_imports_without_torch():
    code = "import sys, rlflow.devices; sys.exit(int('torch' in sys.modules or 'ray' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_the_vllm_engine_takes_the_plans_settings():
    from rlflow.stages.engine_vllm import VLLMEngine, device_args

    _, _, spec = decide(pipeline({"num_gpus": 2}), 2)
    settings = vllm_settings(spec, "rollout")
    inspect.signature(VLLMEngine.__init__).bind(None, "model", **settings)  # every key is a constructor argument
    assert device_args(**settings) == {**settings, "distributed_executor_backend": "mp"}
    cpu = device_args(gpu_memory_utilization=0.5, enforce_eager=True, tensor_parallel_size=1, enable_sleep_mode=False)
    assert cpu == {"gpu_memory_utilization": 0.5, "enforce_eager": True, "tensor_parallel_size": 1,
                   "enable_sleep_mode": False}
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        device_args(gpu_memory_utilization=0.5, enforce_eager=True, tensor_parallel_size=0, enable_sleep_mode=False)
