"""Export: a state dict written as a Hugging Face directory loads back with transformers, tensor for tensor."""

from __future__ import annotations

import json

import numpy as np
import pytest


def _model_dir(tmp_path, tied: bool):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied)
    model = LlamaForCausalLM(cfg)
    src = tmp_path / "src"
    model.save_pretrained(src)
    (src / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    (src / "tokenizer.json").write_text("{}")
    return src, model


@pytest.mark.parametrize("tied", [False, True])
def test_state_to_directory_to_from_pretrained_round_trip(tmp_path, tied):
    from transformers import AutoModelForCausalLM

    from rlflow.runtime import export

    src, model = _model_dir(tmp_path, tied)
    # a trained state: the published numpy arrays (every name, tied ones included, as module.state_dict() gives them)
    rng = np.random.default_rng(1)
    state = {k: (v.detach().numpy() + rng.standard_normal(v.shape).astype(np.float32)) for k, v in model.state_dict().items()}
    if tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    out = export.write(state, src, tmp_path / "run" / "export", info={"step": 3, "version": 3}, plan={"name": "p"})
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "plan.json",
            "rlflow_export.json"} <= {f.name for f in out.iterdir()}
    assert json.loads((out / "rlflow_export.json").read_text())["step"] == 3
    assert not list(out.parent.glob(".export.tmp-*"))  # the staging directory is gone
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.dtype.is_floating_point and str(loaded.dtype) == "torch.float32"
    got = {k: v.detach().numpy() for k, v in loaded.state_dict().items()}
    assert set(got) == set(state)
    for k, v in state.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)  # rtol 0: the very values


def test_rewrite_keeps_step_exports(tmp_path):
    from rlflow.runtime import export

    src, model = _model_dir(tmp_path, False)
    state = {k: v.detach() for k, v in model.state_dict().items()}  # tensors are accepted too
    root = tmp_path / "export"
    export.write(state, src, root / "step-2")
    export.write(state, src, root)
    export.write(state, src, root)  # a second final export replaces the files in place
    assert (root / "step-2" / "model.safetensors").is_file() and (root / "model.safetensors").is_file()
    np.testing.assert_array_equal(export.load_state(root)["lm_head.weight"], state["lm_head.weight"].numpy())
