"""On a CUDA GPU (skipped without one): the hf engine and the DeepSpeed trainer on the device, bf16 when
model.dtype says so; the 2-rank NCCL trainer and a short `rlflow run` where there are two GPUs and Ray."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from trainer_batches import GROUP, build_tiny_llama, load_hf, make_batch, mean_logprob

pytestmark = pytest.mark.gpu
ZERO1 = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0, "zero_optimization": {"stage": 1},
         "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}, "steps_per_print": 10**6}
ALGO = dict(clip_low=0.2, clip_high=0.28, loss_agg="token", kl_coef=0.0, max_importance_ratio=5.0)


@pytest.fixture(scope="module")
def builtin_model():
    from rlflow.stages.tiny_model import build_tiny_llama as build_builtin

    return build_builtin("repeat", progress=lambda line: None)


def test_hf_engine_generates_on_the_gpu_and_verifies_a_pull(builtin_model):
    from transformers import AutoTokenizer

    from rlflow.stages import tasks
    from rlflow.stages.checksum import checksum
    from rlflow.stages.engine_hf import HFEngine
    from rlflow.stages.trajectory import Trajectory

    engine = HFEngine(builtin_model, max_running=32, max_new_tokens=16, seed=0)
    assert engine.device.type == "cuda"
    tok = AutoTokenizer.from_pretrained(builtin_model)
    trajs = [Trajectory(group_id=f"g{i}", index=0, prompt=r["prompt"], answer=r["answer"], prompt_ids=tok(r["prompt"])["input_ids"])
             for i, r in enumerate(tasks.repeat(0, 32))]
    for t in trajs:
        engine.start(t)
    done = []
    while not engine.idle:
        done += engine.step()
    assert len(done) == 32 and all(np.isfinite(t.behaviour_logprobs).all() for t in done)
    state = {k: v.detach().cpu().numpy() + 0.01 for k, v in load_hf(builtin_model).state_dict().items()}
    report = engine.load_weights(state, 1)
    assert report.version == 1 and report.checksum == checksum(state)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trainer_learns_on_the_gpu(dtype, tmp_path):
    from rlflow.stages.trainer import DeepSpeedTrainer

    model_dir = build_tiny_llama(tmp_path / "tiny")
    initial = load_hf(model_dir)
    batch = make_batch(initial)
    tr = DeepSpeedTrainer(model_dir, ZERO1, lr=3e-3, micro_batch_size=5, dtype=dtype, **ALGO)
    try:
        assert tr.engine.device.type == "cuda"
        assert next(tr.engine.module.parameters()).dtype == getattr(torch, dtype)
        for _ in range(4):
            tr.train_step(batch, GROUP)
        trained = load_hf(model_dir, tr.state_numpy())
    finally:
        tr.close()

    assert mean_logprob(trained, batch, True) > mean_logprob(initial, batch, True) + 0.5


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a 2-rank NCCL trainer needs two GPUs")
def test_two_rank_nccl_trainer_matches_one_rank(tmp_path):
    pytest.importorskip("ray")
    import sys

    import ray

    sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))
    import test_trainer_ranks as ranks  # the CPU equivalence test, run with one GPU per rank

    ray.init(num_gpus=2, include_dashboard=False)
    try:
        model_dir = build_tiny_llama(tmp_path / "tiny")
        trajs = make_batch(load_hf(model_dir), n_groups=2, seed=3)
        b1, a1, m1 = ranks.train_once(ray, model_dir, trajs, 1, 1, options={"num_cpus": 1, "num_gpus": 1})
        b2, a2, m2 = ranks.train_once(ray, model_dir, trajs, 2, 1, options={"num_cpus": 1, "num_gpus": 1})
        for name in b1:
            np.testing.assert_allclose(a2[name] - b2[name], a1[name] - b1[name], rtol=1e-2, atol=1e-6, err_msg=name)
    finally:
        ray.shutdown()


def test_a_short_run_on_the_gpu(tmp_path, monkeypatch):
    pytest.importorskip("ray")
    pytest.importorskip("mlflow")
    import ray

    from rlflow.compiler import compile_pipeline
    from rlflow.runtime.driver import Run

    monkeypatch.chdir(tmp_path)
    plan = compile_pipeline(Path(__file__).parents[2] / "pipelines" / "quickstart.yaml", ["stages.train.steps=3", "stages.rollout.num_gpus=0.5", "stages.train.num_gpus=0.5",
                             "resources.num_gpus=1", "tracking.progress=false"])
    ray.init(num_gpus=1, include_dashboard=False)
    try:
        run = Run(plan, out_dir=tmp_path / "run", log=lambda *a: None)
        run.run()
        assert [h["step"] for h in run.history] == [1, 2, 3]
    finally:
        ray.shutdown()
