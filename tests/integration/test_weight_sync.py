"""Weights to rollout on real Ray: publish with a checksum, a zero-copy pull, and a run whose engine loads the
wrong weights failing loudly with the instance and the version."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rlflow.errors import RunFailed
from runs import plan_for, run_plan

pytestmark = pytest.mark.integration


def corrupting_hf(model_dir, **kwargs):
    """The hf engine with a load bug: one element of the embedding goes wrong on every pull (used as `engine: test_weight_sync:corrupting_hf`)."""
    from rlflow.stages.engine_hf import HFEngine

    class Corrupting(HFEngine):
        def _copy_into(self, target, source):
            super()._copy_into(target, source)
            if target.dim() == 2 and target.shape[0] == self.model.config.vocab_size:
                target[0, 0] += 1e-3  # small enough that generation still looks plausible

    return Corrupting(model_dir, **kwargs)


def test_a_run_whose_engine_loads_wrong_weights_fails_naming_instance_and_version(ray_cluster, workdir, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    plan = plan_for("quickstart", "stages.rollout.engine=test_weight_sync:corrupting_hf")
    with pytest.raises(RunFailed) as err:
        run_plan(plan)
    message = str(err.value)
    # the first pull is version 1 (after train step 1); the only instance is 0
    assert "rollout stage 'rollout' instance 0 loaded weights version 1 with checksum b2m1:" in message, message
    assert "but version 1 was published with checksum b2m1:" in message, message
    loaded, published = (part.split("checksum ")[1].split()[0].rstrip(",:") for part in message.split(" but "))
    assert loaded != published


def test_publish_then_pull_is_verified_end_to_end(ray_cluster):
    """publish() (the trainer's helper) -> parameter server -> WeightSync -> the worker's pull -> verify_loaded."""
    import ray
    import torch
    import transformers

    from rlflow.runtime.weight_sync import ParameterServer, WeightSync, publish, state_views, verify_loaded
    from rlflow.stages.checksum import checksum
    from rlflow.stages.engine_hf import HFEngine
    from rlflow.stages.tiny_model import build_tiny_llama

    model_dir = build_tiny_llama("repeat", progress=lambda line: None)
    trainer_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    sync = WeightSync({"num_cpus": 0}, timeout_s=60)
    views = state_views(trainer_model.state_dict())
    assert all(np.shares_memory(views[k], t.numpy()) for k, t in trainer_model.state_dict().items())  # no copy
    out = publish(sync.server, 1, views)
    assert out["checksum"] == checksum(trainer_model.state_dict())
    assert out["bytes"] == sum(t.numel() * 4 for t in trainer_model.state_dict().values())
    with torch.no_grad():  # the trainer moves on: the store keeps what was published
        for p in trainer_model.parameters():
            p.add_(1.0)
    assert sync.refresh() == 1 and sync.checksum == out["checksum"]

    engine = HFEngine(str(model_dir))
    state = ray.get(sync.ref.ref[0])
    assert not next(iter(state.values())).flags.writeable  # zero-copy view into the object store
    loaded = engine.load_weights(state, sync.version)
    verify_loaded("rollout", 0, sync.ref, loaded)

    # a pusher that does not checksum (the trainer before it calls publish()): the server computes it
    server = ParameterServer.remote()
    ray.get(server.push.remote(2, [ray.put(views)]))
    assert ray.get(server.latest.remote()).checksum == checksum(trainer_model.state_dict())
