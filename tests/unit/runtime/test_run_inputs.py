"""Inputs that changed after compile (the model directory, the DeepSpeed config, data rows) are invalid input
at run start: PipelineInvalid naming the field, exit 2 with one line, before Ray starts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rlflow.cli import main
from rlflow.compiler import compile_pipeline
from rlflow.errors import PipelineInvalid
from rlflow.plan_model import Plan
from rlflow.runtime.model import check_model_dir, prepare_model
from rlflow.runtime.train_sink import check_deepspeed_config

REPO = Path(__file__).resolve().parents[3]
QUICKSTART = REPO / "pipelines" / "quickstart.yaml"
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 128, "vocab_size": 384}


def model_dir(root: Path, *, config=CONFIG, weights=("model.safetensors",), tokenizer=True) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (root / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    for name in weights:
        (root / name).write_bytes(b"\0")
    if tokenizer:
        (root / "tokenizer.json").write_text("{}")
    return root


def problem_of(excinfo):
    (p,) = excinfo.value.problems
    return p


def test_a_model_directory_passes(tmp_path):
    assert check_model_dir(model_dir(tmp_path / "m"), source="p.yaml") == tmp_path / "m"
    sharded = model_dir(tmp_path / "s", weights=("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    assert check_model_dir(sharded, source="p.yaml") == sharded


@pytest.mark.parametrize("make, message", [
    (lambda d: d, "no longer exists"),
    (lambda d: (d.parent.mkdir(exist_ok=True), d.write_text("x"))[-1] and d, "is not a directory"),
    (lambda d: model_dir(d, config=None), "it has no config.json"),
    (lambda d: model_dir(d, config="{not json"), "is not valid JSON"),
    (lambda d: model_dir(d, config={"hidden_size": 8}), 'no "model_type"'),
    (lambda d: model_dir(d, weights=()), "has no model weights"),
    (lambda d: model_dir(d, tokenizer=False), "has no tokenizer"),
])
def test_not_a_model_names_model_path(tmp_path, make, message):
    path = tmp_path / "models" / "m"
    make(path)
    with pytest.raises(PipelineInvalid) as e:
        check_model_dir(path, source="p.yaml")
    p = problem_of(e)
    assert (p.loc, p.rule) == (("model", "path"), "bad-model-path") and message in p.message, p.message


def test_a_missing_shard_is_named(tmp_path):
    d = model_dir(tmp_path / "m", weights=("model-00001-of-00002.safetensors",))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(PipelineInvalid, match="lacks 1 of the 2 weight shards"):
        check_model_dir(d, source="p.yaml")


def test_prepare_model_checks_a_local_directory(tmp_path, quickstart_plan):
    quickstart_plan["pipeline"]["model"]["path"] = str(tmp_path / "gone")
    with pytest.raises(PipelineInvalid) as e:
        prepare_model(Plan.of(quickstart_plan))
    assert problem_of(e).render().startswith("model.path: model directory ")


def trainer_plan(path) -> Plan:
    """The compiled quickstart from p.yaml, its train stage called 'learn', reading the DeepSpeed config at `path`."""
    raw = compile_pipeline(QUICKSTART)
    trainer = next(a for a in raw["actors"] if a["role"] == "trainer")
    trainer["stage"], trainer["deepspeed"] = "learn", str(path)
    return Plan.of({**raw, "source": "p.yaml"})


def test_deepspeed_config_is_read_and_returned(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    assert check_deepspeed_config(trainer_plan(tmp_path / "ds.json")) == {"zero_optimization": {"stage": 1}}


@pytest.mark.parametrize("content, rule, message", [
    (None, "missing-file", "no longer exists"),
    ('{"zero_optimization": {"stage": 1},', "bad-json", "is not valid JSON"),
    ("[1, 2]", "bad-deepspeed-config", "is a JSON list, not an object"),
    ('{"optimizer": "adam"}', "bad-deepspeed-config", '"optimizer" is a str, not an object'),
    ('{"optimizer": {"params": 3}}', "bad-deepspeed-config", '"optimizer.params" is not an object'),
])
def test_bad_deepspeed_config_names_the_train_stage(tmp_path, content, rule, message):
    path = tmp_path / "ds.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(PipelineInvalid) as e:
        check_deepspeed_config(trainer_plan(path))
    p = problem_of(e)
    assert (p.loc, p.rule) == (("stages", "learn", "deepspeed"), rule) and message in p.message, p.message


# ------------------------------------------------------------------------------------------ through `rlflow run`
@pytest.fixture
def compiled(tmp_path, monkeypatch):
    """A quickstart plan compiled in a fresh working dir with its own DeepSpeed config and local model."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(REPO / "configs" / "deepspeed" / "zero1.json", tmp_path / "ds.json")
    model_dir(tmp_path / "model")
    assert main(["compile", str(QUICKSTART), "--set", f"stages.train.deepspeed={tmp_path / 'ds.json'}",
                 "--set", f"model.path={tmp_path / 'model'}"]) == 0
    return tmp_path


def run_exits_2(capsys, *argv) -> list[str]:
    from unittest import mock

    import ray

    capsys.readouterr()
    # as on a fresh machine (the suite's integration tests may have left a cluster up): rlflow run would
    # call ray.init, which tests/conftest.py forbids in unit tests, so exit 2 means it was refused before Ray
    with mock.patch.object(ray, "is_initialized", lambda: False):
        assert main(["run", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0].endswith("quickstart.yaml: 1 error"), err
    return lines


def test_run_with_a_vanished_model_exits_2(compiled, capsys):
    shutil.rmtree(compiled / "model")
    line = run_exits_2(capsys)[1]
    assert line.startswith("  model.path: model directory ") and "no longer exists" in line and line.endswith("[bad-model-path]")


def test_run_with_a_model_without_weights_exits_2(compiled, capsys):
    (compiled / "model" / "model.safetensors").unlink()
    assert "has no model weights" in run_exits_2(capsys)[1]


def test_run_with_a_deleted_deepspeed_config_exits_2(compiled, capsys):
    (compiled / "ds.json").unlink()
    line = run_exits_2(capsys)[1]
    assert line.startswith("  stages.train.deepspeed: DeepSpeed config ") and line.endswith("[missing-file]")


def test_run_with_a_corrupted_deepspeed_config_exits_2(compiled, capsys):
    (compiled / "ds.json").write_text('{"zero_optimization": ')
    line = run_exits_2(capsys)[1]
    assert line.startswith("  stages.train.deepspeed: DeepSpeed config ") and line.endswith("[bad-json]")
