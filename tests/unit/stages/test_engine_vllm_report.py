"""VLLMEngine's report of a pull: the version, the checksum of what it handed to vLLM's reload (a tied lm_head
standing in as the embedding vLLM uses) and no parameter left unloaded. One engine (20-50 s to start)."""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine_helpers import mixed_rows, perturbed_state, run_to_idle, trajectories  # noqa: E402

from rlflow.stages.checksum import checksum  # noqa: E402
from rlflow.stages.engine_vllm import VLLMEngine  # noqa: E402
from rlflow.stages.tiny_model import build_tiny_llama  # noqa: E402

# slow: a vLLM engine start; the default run verifies vLLM's reports on every pull of test_run.py's vLLM run
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU reload path")]


def test_vllm_engine_reports_version_and_checksum_of_a_complete_reload(tmp_path):
    untied = build_tiny_llama("repeat", progress=lambda line: None)
    base = transformers.AutoModelForCausalLM.from_pretrained(untied)
    torch.manual_seed(0)
    tied = transformers.LlamaForCausalLM(transformers.LlamaConfig(**(base.config.to_dict() | {"tie_word_embeddings": True})))
    tied.save_pretrained(tmp_path)
    for f in untied.glob("tokenizer*"):
        shutil.copy(f, tmp_path)
    engine = VLLMEngine(str(tmp_path), max_running=4, max_new_tokens=8, max_model_len=128, temperature=0.7)
    try:
        sent = perturbed_state(tied)
        sent["lm_head.weight"] = sent["model.embed_tokens.weight"]  # tied: the trainer's state dict holds both
        loaded = engine.load_weights(sent, version=3)
        assert loaded == {"version": 3, "checksum": checksum(sent)}  # no "missing": every parameter reloaded
        assert engine.version == 3
        for traj in trajectories(engine.tokenizer, mixed_rows(2)):
            engine.start(traj)
        assert len(run_to_idle(engine, limit=2000)) == 2  # still generates after the reload

        untied_head = dict(sent, **{"lm_head.weight": sent["lm_head.weight"] + 1})  # vLLM would use the embedding
        assert engine.load_weights(untied_head, version=4).checksum != checksum(untied_head)
    finally:
        engine.close()
