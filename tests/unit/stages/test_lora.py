"""LoRA (train.lora): only the adapters train and travel; the hf engine applies them in place; peft reads the export."""

import os
import shutil
from pathlib import Path

import pytest
import torch
from trainer_batches import GROUP, load_hf, make_batch, mean_logprob

from rlflow.stages import lora
from rlflow.stages.engine_hf import HFEngine
from rlflow.stages.trainer import DeepSpeedTrainer
from rlflow.stages.trajectory import Trajectory

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
ZERO1 = os.path.join(REPO, "configs", "deepspeed", "zero1.json")
ALGO = dict(clip_low=0.2, clip_high=0.28, loss_agg="token", kl_coef=0.0, max_importance_ratio=5.0)
LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"], "dropout": 0.0}


@pytest.fixture(scope="module")
def trained(tiny_llama_dir):
    """A LoRA trainer after 3 steps on a batch that rewards token 7, and that batch."""
    batch = make_batch(load_hf(tiny_llama_dir))
    tr = DeepSpeedTrainer(tiny_llama_dir, ZERO1, lr=3e-2, micro_batch_size=8, lora=LORA, **ALGO)
    base = {n: t.detach().clone() for n, t in tr.engine.module.state_dict().items() if not lora.is_adapter(n)}
    metrics = [tr.train_step(batch, GROUP) for _ in range(3)]
    yield tr, batch, base, metrics
    tr.close()


def test_only_the_adapters_train_and_are_published(trained):
    tr, _, base, metrics = trained
    assert [m["version"] for m in metrics] == [1, 2, 3]
    optimized = {id(p) for group in tr.engine.optimizer.bit16_groups for p in group}  # ZeRO-1's trained parameters
    named = dict(tr.engine.module.named_parameters())
    assert optimized == {id(p) for n, p in named.items() if lora.is_adapter(n)}  # the optimizer sees adapters alone
    now = tr.engine.module.state_dict()
    assert all(torch.equal(now[n], t) for n, t in base.items())  # the base did not move
    layouts = tr.weight_layouts()
    names = [n for layout in layouts for n in layout.names]
    assert names and all(lora.is_adapter(n) for n in names)
    adapter, rest = lora.adapter_bytes(tr.engine.module)
    assert sum(s.nbytes for layout in layouts for s in layout.slots) == adapter
    assert adapter * 10 < rest  # far below the model: 2 x rank x (d_in + d_out) per targeted matrix
    published = dict(tr.state_numpy())
    assert any(float(abs(published[n]).max()) > 0 for n in published if ".lora_B." in n)  # B left zero: it trained


def test_the_hf_engine_applies_a_published_adapter_in_place(trained, tiny_llama_dir, repeat_model_dir, tmp_path):
    tr, batch, _, _ = trained
    shutil.copytree(tiny_llama_dir, tmp_path / "model")  # the trained model, with a tokenizer for the engine
    for f in Path(repeat_model_dir).glob("*token*"):
        shutil.copy(f, tmp_path / "model" / f.name)
    engine = HFEngine(tmp_path / "model", lora=LORA, max_new_tokens=6, temperature=0.0, max_model_len=64)
    base_ids = {n: t.data_ptr() for n, t in engine.model.state_dict().items() if not lora.is_adapter(n)}
    prompt = batch[0].prompt_ids

    def greedy(index: int) -> list[int]:
        engine.start(Trajectory(group_id="g", index=index, prompt="", answer="", prompt_ids=list(prompt)))
        done = []
        while not done:
            done = engine.step()
        return done[0].completion_ids

    before = greedy(0)
    buckets = [{n: t.cpu() for n, t in zip(layout.names, tensors)} for layout, tensors in tr.weight_buckets()]
    loaded = engine.load_weights(buckets, 3)
    from rlflow.stages.checksum import Checksum

    sent = Checksum()
    for bucket in buckets:
        for n, t in bucket.items():
            sent.add(n, t)
    assert loaded.checksum == sent.hexdigest() and not loaded.missing
    assert {n: t.data_ptr() for n, t in engine.model.state_dict().items() if not lora.is_adapter(n)} == base_ids
    after = greedy(1)
    assert after != before  # the adapter changed what the engine generates
    # the engine's model now scores the rewarded completions as the trainer's does
    trainer_model = load_hf(tiny_llama_dir)
    lora.inject(trainer_model, LORA).load_state_dict({n: t for b in buckets for n, t in b.items()}, strict=False)
    assert mean_logprob(engine.model, batch, True) == pytest.approx(mean_logprob(trainer_model, batch, True), abs=1e-4)


def test_peft_loads_the_adapter_and_the_merge_is_base_plus_delta(trained, tiny_llama_dir, tmp_path):
    from peft import PeftModel

    tr, batch, _, _ = trained
    state = tr.state_numpy()
    model = lora.peft_model(tiny_llama_dir, LORA, state)
    model.save_pretrained(tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(load_hf(tiny_llama_dir), tmp_path / "adapter").eval()
    merged = lora.peft_model(tiny_llama_dir, LORA, state).merge_and_unload()
    base = load_hf(tiny_llama_dir).state_dict()
    name = "model.layers.0.self_attn.q_proj"
    a, b = (torch.from_numpy(state[f"{name}.lora_{x}.default.weight"]) for x in "AB")
    expected = base[f"{name}.weight"] + LORA["alpha"] / LORA["rank"] * b @ a  # LoRA §4.1: W0 + (alpha / r) B A
    assert torch.allclose(merged.state_dict()[f"{name}.weight"], expected, atol=1e-6)
    assert torch.equal(merged.state_dict()["model.layers.0.mlp.up_proj.weight"], base["model.layers.0.mlp.up_proj.weight"])
    with torch.no_grad():
        ids = torch.tensor([batch[0].prompt_ids + batch[0].completion_ids])
        assert torch.allclose(loaded(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-4)


def test_target_modules_that_match_nothing_are_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="no_such_proj"):
        lora.inject(load_hf(tiny_llama_dir), {**LORA, "target_modules": ["no_such_proj"]})


def test_a_checkpoint_resumes_the_adapters_and_their_optimizer_state(trained, tiny_llama_dir, tmp_path):
    tr, batch, _, _ = trained
    tr.save_checkpoint(str(tmp_path), tag="t")
    resumed = DeepSpeedTrainer(tiny_llama_dir, ZERO1, lr=3e-2, micro_batch_size=8, lora=LORA, **ALGO)
    try:
        resumed.load_checkpoint(str(tmp_path), tag="t")
        assert resumed.counters() == tr.counters()
        before = tr.state_numpy()
        assert all((resumed.state_numpy()[n] == a).all() for n, a in before.items())
        tr.train_step(batch, GROUP), resumed.train_step(batch, GROUP)  # Adam's moments came back: the same update
        after = tr.state_numpy()
        assert all(abs(resumed.state_numpy()[n] - a).max() < 1e-6 for n, a in after.items())
        assert any(abs(after[n] - before[n]).max() > 0 for n in after)
    finally:
        resumed.close()


@pytest.mark.vllm
def test_the_vllm_engine_serves_each_version_as_an_adapter(trained, tiny_llama_dir, repeat_model_dir, tmp_path):
    """engine vllm with train.lora: version 0 is the base model; a published adapter becomes a LoRA request whose
    tokens are the hf engine's (whose log-probs are the trainer's: the test above); a tensor left out is reported
    missing; the adapter directories go with the engine."""
    pytest.importorskip("vllm")
    from rlflow.stages.checksum import Checksum
    from rlflow.stages.engine_vllm import VLLMEngine

    tr, batch, _, _ = trained
    shutil.copytree(tiny_llama_dir, tmp_path / "model")
    for f in Path(repeat_model_dir).glob("*token*"):
        shutil.copy(f, tmp_path / "model" / f.name)
    prompt = batch[0].prompt_ids
    settings = dict(lora=LORA, max_new_tokens=6, temperature=0.0, max_model_len=64)
    vllm, hf = VLLMEngine(tmp_path / "model", **settings), HFEngine(tmp_path / "model", **settings)

    def greedy(engine, index: int) -> Trajectory:
        engine.start(Trajectory(group_id="g", index=index, prompt="", answer="", prompt_ids=list(prompt)))
        done = []
        while not done:
            done = engine.step()
        return done[0]

    try:
        before = greedy(vllm, 0).completion_ids
        assert before == greedy(hf, 0).completion_ids  # version 0: B = 0, the base model on both
        buckets = [{n: t.cpu() for n, t in zip(layout.names, tensors)} for layout, tensors in tr.weight_buckets()]
        sent = Checksum()
        for bucket in buckets:
            for n, t in bucket.items():
                sent.add(n, t)
        loaded = vllm.load_weights(buckets, 3)
        hf.load_weights(buckets, 3)
        assert loaded.checksum == sent.hexdigest() and not loaded.missing
        after = greedy(vllm, 1)
        assert after.completion_ids == greedy(hf, 1).completion_ids != before  # the adapter applies, as hf's does
        vllm.load_weights(buckets, 4)  # requests running at a pull are resubmitted under it (the interrupt path)
        again = greedy(vllm, 2)
        assert again.versions_seen == [4] and again.completion_ids == after.completion_ids

        partial = [{n: t for n, t in b.items() if not n.endswith("q_proj.lora_B.default.weight")} for b in buckets]
        assert any(n.endswith("q_proj.lora_B.default.weight") for n in vllm.load_weights(partial, 5).missing)
        dirs = list(vllm._adapter_dirs)
        assert len(dirs) == 2 and all(os.path.isdir(d) for d in dirs)  # this version's and the one before
    finally:
        vllm.close()
    assert not any(os.path.exists(d) for d in dirs)

