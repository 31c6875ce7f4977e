"""builtin:tiny-llama: a real local build (tokenizer, Llama, warm start), its cache, and its accuracy."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rlflow.stages import tasks  # noqa: E402
from rlflow.stages.tiny_model import EVAL_SEED_OFFSET, accuracy, build_tiny_llama, encode_row, model_dir  # noqa: E402


@pytest.fixture(scope="module")
def quick_build(tmp_path_factory):
    """A fresh build into an empty cache with a short warm start: exercises the whole build path."""
    cache = tmp_path_factory.mktemp("models")
    lines: list[str] = []
    path = build_tiny_llama("arith", cache_dir=cache, seed=3, sft_steps=4, progress=lines.append)
    return cache, path, lines


def test_build_writes_a_loadable_hf_directory(quick_build):
    cache, path, lines = quick_build
    assert path.parent == cache and path.name.startswith("tiny-llama-arith-seed3-")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "rlflow_build.json"):
        assert (path / name).is_file(), name
    assert not [p for p in cache.iterdir() if p.name.startswith(".build-")], "temp build directory left behind"
    assert path.stat().st_mode & 0o777 == 0o755  # readable by every process, not private like a mkdtemp
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == "LlamaForCausalLM"
    config = model.config
    assert config.hidden_size // config.num_attention_heads == 64 == config.head_dim  # a head size vLLM CPU accepts
    assert config.tie_word_embeddings is False
    assert any("step 4/4" in line for line in lines) and any("held-out" in line for line in lines)
    assert json.loads((path / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_tokenizer_round_trips_task_text(quick_build):
    _, path, _ = quick_build
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert 256 < len(tok) <= 512
    rows = tasks.arith(11, 50) + tasks.repeat(11, 50)
    for row in rows:
        prompt, answer = encode_row(tok, row)
        assert prompt[0] == tok.bos_token_id and answer[-1] == tok.eos_token_id
        assert tok.decode(prompt, skip_special_tokens=True) == row["prompt"]
        assert tok.decode(answer, skip_special_tokens=True) == row["answer"]
        assert prompt + answer[:-1] == tok(row["prompt"] + row["answer"])["input_ids"]  # the split is a token boundary
    assert tok.convert_ids_to_tokens(tok("305", add_special_tokens=False)["input_ids"]) == ["3", "0", "5"]
    assert tok.decode(tok("Any text, even ünïcode!")["input_ids"], skip_special_tokens=True) == "Any text, even ünïcode!"


def test_cache_hit_returns_the_same_directory_without_building(quick_build):
    cache, path, _ = quick_build
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    lines: list[str] = []
    again = build_tiny_llama("builtin:arith", cache_dir=cache, seed=3, sft_steps=4, progress=lines.append)
    assert again == path and lines == []
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp


def test_cache_key_separates_task_seed_and_settings(quick_build):
    cache, path, _ = quick_build
    assert model_dir("arith", cache_dir=cache, seed=3, sft_steps=4) == path
    others = {model_dir("arith", cache_dir=cache, seed=4, sft_steps=4), model_dir("arith", cache_dir=cache, seed=3, sft_steps=5),
              model_dir("repeat", cache_dir=cache, seed=3, sft_steps=4), model_dir("arith", cache_dir=cache, seed=3)}
    assert len(others) == 4 and path not in others


def test_unknown_task_names_the_choices():
    with pytest.raises(ValueError, match="arith, calc, code, countdown, repeat, word_problems"):
        build_tiny_llama("sorting")


def test_warm_start_accuracy_is_in_a_sane_band(repeat_model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(repeat_model_dir)
    tok = transformers.AutoTokenizer.from_pretrained(repeat_model_dir)
    held_out = tasks.repeat(EVAL_SEED_OFFSET + 1, 128)
    greedy = accuracy(model, tok, held_out, 48, temperature=0.0)
    sampled = accuracy(model, tok, held_out, 48, temperature=1.0)
    report = json.loads((repeat_model_dir / "rlflow_build.json").read_text())
    assert 0.05 <= sampled <= 0.95, (sampled, report)
    assert 0.05 <= greedy <= 0.98, (greedy, report)


def test_a_concurrent_winner_is_used_and_the_temp_build_removed(tmp_path):
    final = model_dir("arith", cache_dir=tmp_path, seed=5, sft_steps=2)
    lines: list[str] = []

    def progress(line: str) -> None:  # another process finishes first, while this one is still training
        if not final.exists():
            final.mkdir()
            (final / "config.json").write_text("{}")
        lines.append(line)

    assert build_tiny_llama("arith", cache_dir=tmp_path, seed=5, sft_steps=2, progress=progress) == final
    assert (final / "config.json").read_text() == "{}"  # the winner's files, untouched
    assert any("another process built" in line for line in lines)
    assert [p.name for p in tmp_path.iterdir()] == [final.name]


def test_a_build_on_few_rows_says_its_accuracy_is_on_rows_it_trained_on(tmp_path):
    """A pipeline's own rows too few to hold any aside (a 200-row file less its held-out split): the build line
    counts the rows it measured and does not call them held out; the built-in task's prompts are held out."""
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(40)]
    lines: list[str] = []
    path = build_tiny_llama("data", cache_dir=tmp_path, rows=rows, sft_steps=2, progress=lines.append)
    (said,) = [line for line in lines if "greedy" in line]
    assert "exact match on 40 of the 40 rows it trained on" in said and "held-out prompts" not in said, said
    report = json.loads((path / "rlflow_build.json").read_text())
    assert report["eval_prompts"] == 40 and report["eval_held_out"] is False


def test_a_built_in_task_build_measures_on_held_out_prompts(quick_build):
    _, path, lines = quick_build
    report = json.loads((path / "rlflow_build.json").read_text())
    assert any(f"exact match on {report['eval_prompts']} held-out prompts: greedy" in line for line in lines), lines
    assert report["eval_held_out"] is True
