"""The trainer with world size 2 (two Ray actors, one DeepSpeed process group over gloo) against world size 1,
on the same batch: the same update within fp32 tolerance, for ZeRO stages that shard gradients and parameters;
and a 2-rank checkpoint restored into fresh ranks."""

from __future__ import annotations

import numpy as np
import pytest
from trainer_batches import GROUP, build_tiny_llama, completion_logprobs, load_hf, make_batch

from rlflow.runtime.messages import TrainStep

pytestmark = pytest.mark.integration


# Adam with eps 1 takes a step of lr * g / (|g| + 1), about lr * g for these small gradients: unlike plain
# Adam (whose first step is lr * sign(g) whatever the scale) the update shows a wrongly scaled gradient.
# No clipping, for the same reason.
def ds_config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"eps": 1.0, "weight_decay": 0.0, "torch_adam": True}},
            "steps_per_print": 10**6}


KWARGS = dict(lr=0.1, clip_low=0.2, clip_high=0.28, loss_agg="token", kl_coef=0.0, max_importance_ratio=5.0)


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    """Two groups; one trajectory so long it costs more than all the others together, so with two ranks one
    rank trains it alone and runs masked padding micro-batches while the other runs four real ones."""
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    model = load_hf(model_dir)
    trajs = make_batch(model, n_groups=2, seed=3)
    long = trajs[1]
    long.completion_ids = [(5 * i + 1) % 60 for i in range(100)]
    long.behaviour_logprobs = completion_logprobs(model, long).tolist()
    return model_dir, trajs


def train_once(ray, model_dir, trajs, world_size, stage, save_to=None, load_from=None, options=None, kwargs=KWARGS,
               train=True):
    """Start a `world_size`-rank trainer, (restore a checkpoint,) train one step on `trajs` (unless not `train`:
    then after and metrics are None), (save,) and return (weights before, weights after, metrics)."""
    from rlflow.runtime.parameter_server import ParameterServer, fetch_state
    from rlflow.runtime.payload_store import PayloadStore
    from rlflow.runtime.trainer_worker import launch_trainer

    store, params = PayloadStore.remote(), ParameterServer.remote()
    leader, placement = launch_trainer(model_dir, ds_config(stage), kwargs, store, params, world_size=world_size,
                                       options=options or {"num_cpus": 0.5, "num_gpus": 0}, source="test", stage="train")
    try:
        ray.get(leader.ready.remote(), timeout=300)
        if load_from:
            ray.get(leader.load.remote(str(load_from), "step-1"), timeout=300)
        version = 1 if load_from else 0

        def weights(v):
            ray.get(leader.publish.remote(v), timeout=300)
            return {k: t.float().numpy() for k, t in fetch_state(ray.get(params.latest.remote())).items()}

        before = weights(version)
        if not train:
            return before, None, None
        ray.get(store.put.remote(trajs))
        rewards = {t.traj_id: t.reward for t in trajs}
        result = ray.get(leader.train.remote(TrainStep(rewards, GROUP, version)), timeout=300)
        metrics = {**result.metrics, "ranks": result.ranks}
        if save_to:
            ray.get(leader.save.remote(str(save_to), "step-1", {"step": 1}), timeout=300)
        after = {k: t.float().numpy() for k, t in fetch_state(ray.get(params.latest.remote())).items()}
        return before, after, metrics
    finally:
        from ray.util.placement_group import remove_placement_group

        for handle in (leader, store, params):
            ray.kill(handle)
        remove_placement_group(placement)


# ZeRO-3 shards the parameters and gathers them in every forward, and reduces in every backward: the
# strictest about equal pass counts across ranks (ZeRO-2 also reduces per backward; it passed here too,
# left out to keep the suite short)
@pytest.mark.parametrize("stage", [3])
def test_two_ranks_make_the_same_update_as_one(stage, batch, ray_cluster, tmp_path):
    model_dir, trajs = batch
    before1, after1, m1 = train_once(ray_cluster, model_dir, trajs, 1, stage)
    before2, after2, m2 = train_once(ray_cluster, model_dir, trajs, 2, stage, save_to=tmp_path / "ckpt" if stage == 3 else None)
    assert m2["ranks"] == 2 and m1["ranks"] == 1
    for name in before1:
        np.testing.assert_array_equal(before1[name], before2[name])
    moved = sum(float(np.abs(after1[n] - before1[n]).max()) > 1e-6 for n in before1)
    assert moved >= len(before1) // 2, "the step barely changed the weights: the comparison would prove nothing"
    for name in before1:
        np.testing.assert_allclose(after2[name] - before2[name], after1[name] - before1[name], rtol=1e-3, atol=1e-7,
                                   err_msg=name)
    # the loss normalisation is the whole batch's, whatever the sharding
    for key in ("loss", "pg_loss", "entropy", "grad_norm", "tokens", "reward_mean"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-7), key
    assert m1["micro_batches"] == 4 and m2["micro_batches"] == 4  # the lone long row's rank ran 3 padding passes
    if stage == 3:  # a 2-rank ZeRO-3 checkpoint restores into fresh ranks: the same weights, the next version
        restored, _, _ = train_once(ray_cluster, model_dir, trajs, 2, stage, load_from=tmp_path / "ckpt", train=False)
        for name in after2:
            np.testing.assert_array_equal(restored[name], after2[name])


def test_reinforce_pp_whitens_over_both_ranks_tokens(batch, ray_cluster):
    """REINFORCE++'s advantages are per-token returns (the KL folded in) whitened over the whole batch: the ranks
    add their moments, so two ranks make one rank's update."""
    kwargs = {**KWARGS, "algo": "reinforce_pp", "kl_coef": 0.05, "loss_agg": "token-mean"}
    two_ranks_as_one(ray_cluster, batch, kwargs, ("loss", "pg_loss", "kl", "grad_norm"))


def two_ranks_as_one(ray, batch, kwargs, keys) -> dict:
    """One step with `kwargs` on one rank and on two, ZeRO-1: the same update and the same metrics `keys`; returns
    the one rank's metrics."""
    model_dir, trajs = batch
    before1, after1, m1 = train_once(ray, model_dir, trajs, 1, 1, kwargs=kwargs)
    before2, after2, m2 = train_once(ray, model_dir, trajs, 2, 1, kwargs=kwargs)
    assert m2["ranks"] == 2
    for name in before1:
        np.testing.assert_allclose(after2[name] - before2[name], after1[name] - before1[name], rtol=1e-3, atol=1e-7,
                                   err_msg=name)
    for key in keys:
        assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-7), key
    return m1


def test_ppo_critic_averages_over_both_ranks(batch, ray_cluster):
    """PPO's GAE advantages are whitened over both ranks' tokens and its critic's gradients average like the
    policy's: two ranks make one rank's policy update and the same critic steps (critic_epochs 2: the second
    epoch's gradient norm is taken after the first epoch's update)."""
    kwargs = {**KWARGS, "algo": "ppo", "loss_agg": "token-mean", "algo_options": {"critic_epochs": 2, "critic_lr": 0.01}}
    m1 = two_ranks_as_one(ray_cluster, batch, kwargs, ("loss", "pg_loss", "grad_norm", "critic_loss", "value_mean",
                                                       "value_clip_frac", "critic_grad_norm"))
    assert m1["critic_grad_norm"] > 0


@pytest.mark.slow  # the ranks' equivalence and checkpoint test above covers the trainer; this is the plan's wiring
def test_a_pipeline_trains_with_two_ranks(ray_cluster, workdir):
    """`stages.train.replicas: 2` through rlflow run: both ranks train every step, from the plan."""
    from runs import plan_for, run_plan
    from test_run import assert_accounted

    plan = plan_for("quickstart", "stages.train.replicas=2", "stages.train.num_cpus=0.5")
    assert next(a for a in plan["actors"] if a["role"] == "trainer")["replicas"] == 2
    run = run_plan(plan)
    assert [h["step"] for h in run.history] == [1, 2, 3]
    assert all(h["ranks"] == 2 for h in run.history)
    assert_accounted(run)
