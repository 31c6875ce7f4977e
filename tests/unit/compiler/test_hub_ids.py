"""Hugging Face Hub ids as model.path, reward/judge models and data.source (rlflow/hub.py), resolved offline from a
Hub cache built here in the layout huggingface_hub writes (`models--org--name/refs/main`, `snapshots/<commit>/`,
`blobs/`): no network, the real huggingface_hub and datasets libraries read it."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub")
datasets = pytest.importorskip("datasets")

from rlflow import hub
from rlflow.cli import main
from rlflow.compiler import check_pipeline, compile_pipeline
from rlflow.errors import PipelineInvalid

MODEL, DATA, GSM = "rlflow-test/tiny-llama", "rlflow-test/qa", "rlflow-test/gsm"
C1, C2, D1, G1 = "1" * 40, "2" * 40, "d" * 40, "e" * 40
ROWS = [{"prompt": "12+7=", "answer": "19"}, {"prompt": "3+4=", "answer": "7"}, {"prompt": "10+10=", "answer": "20"}]
PIPELINE = """name: hub
model: {{path: "{model}", max_model_len: 128}}
data: {data}
stages:
  rollout: {{kind: rollout, engine: hf, group_size: 2, max_new_tokens: 16}}
  score:   {{kind: reward, fn: exact_match}}
  buffer:  {{kind: buffer, batch_groups: 2}}
  train:   {{kind: train, steps: 1}}
edges:
  - {{from: data,    to: rollout, policy: {{kind: streaming}}}}
  - {{from: rollout, to: score,   policy: {{kind: streaming}}}}
  - {{from: score,   to: buffer,  policy: {{kind: streaming}}}}
  - {{from: buffer,  to: train,   policy: {{kind: one_step}}}}
  - {{from: train,   to: rollout, policy: {{kind: weight_sync}}}}
"""


def put(cache: Path, repo_type: str, repo_id: str, commit: str, files: dict[str, bytes], refs=("main",)) -> Path:
    """One snapshot of a repo in the Hub cache layout: files as blobs named by their hash, symlinked from
    snapshots/<commit>/, and refs/<ref> holding the commit."""
    repo = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return repo / "snapshots" / commit


def parquet(rows: list[dict]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), out)
    return out.getvalue()


@pytest.fixture
def cache(tmp_path, monkeypatch, tiny_llama_dir) -> Path:
    """A Hub cache with the tiny Llama (two commits: main, and an older one tagged v1), a one-split prompt dataset
    and a two-config dataset (as openai/gsm8k: configs main and socratic, splits train and test)."""
    cache = tmp_path / "hub-cache"
    model = {f.name: f.read_bytes() for f in Path(tiny_llama_dir).iterdir() if f.is_file()}
    model["tokenizer_config.json"] = json.dumps({"model_max_length": 128}).encode()
    put(cache, "model", MODEL, C2, model)
    old = json.loads(model["config.json"]) | {"max_position_embeddings": 256}
    put(cache, "model", MODEL, C1, model | {"config.json": json.dumps(old).encode()}, refs=("v1",))
    put(cache, "dataset", DATA, D1, {"data/train.jsonl": "".join(json.dumps(r) + "\n" for r in ROWS).encode()})
    readme = ("---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train-*\n"
              "  - split: test\n    path: main/test-*\n- config_name: socratic\n  data_files:\n  - split: train\n"
              "    path: socratic/train-*\n---\n")
    qa = [{"question": r["prompt"], "answer": r["answer"]} for r in ROWS]
    put(cache, "dataset", GSM, G1, {"README.md": readme.encode(), "main/train-00000-of-00001.parquet": parquet(qa),
                                    "main/test-00000-of-00001.parquet": parquet(qa[:1]),
                                    "socratic/train-00000-of-00001.parquet": parquet(qa[1:])})
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))  # read at call time (huggingface_hub reads its own at import)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("RLFLOW_CACHE", str(tmp_path / "rlflow-cache"))
    return cache


def pipeline(tmp_path, model: str = MODEL, data: str = f'{{source: "{DATA}"}}') -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(PIPELINE.format(model=model, data=data))
    return path


def problems(path) -> dict[str, object]:
    with pytest.raises(PipelineInvalid) as e:
        check_pipeline(path)
    return {p.rule: p for p in e.value.problems}


# ------------------------------------------------------------------------------------------------- what is an id

@pytest.mark.parametrize("ref, expected", [
    ("Qwen/Qwen2.5-0.5B-Instruct", hub.HubRef("Qwen/Qwen2.5-0.5B-Instruct")),
    ("openai/gsm8k:main@e53f048", hub.HubRef("openai/gsm8k", "main", "e53f048")),
    ("org/name@v1.0", hub.HubRef("org/name", None, "v1.0")),
    ("builtin:tiny-llama", None), ("./org/name", None), ("/abs/name", None), ("name", None), ("a/b/c", None),
    ("data/train.jsonl", None), ("verifiers:pkg.mod:load_taskset", None), ("https://x/y", None),
])
def test_what_is_read_as_a_hub_id(ref, expected):
    assert hub.parse(ref) == expected


def test_a_local_path_of_that_name_wins(tmp_path):
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert hub.hub_ref("org/name", tmp_path) is None
    assert hub.hub_ref("org/other", tmp_path) == hub.HubRef("org/other")


def test_the_cache_is_read_from_the_environment_at_call_time(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub.cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert hub.cache_dir() == tmp_path / "c"


# ------------------------------------------------------------------------------------------------------- compile

def test_model_and_dataset_ids_in_the_cache_compile_to_their_snapshots(tmp_path, cache):
    plan = compile_pipeline(pipeline(tmp_path))
    snap = cache / f"models--{MODEL.replace('/', '--')}" / "snapshots" / C2
    assert plan["pipeline"]["model"]["path"] == str(snap)  # what Ray workers on this machine load
    assert plan["hub"]["model.path"] | {} == {"id": MODEL, "repo_type": "model", "revision": "main", "commit": C2,
                                               "snapshot": str(snap), "path": str(snap)}
    data = plan["hub"]["data.source"]
    assert (data["id"], data["revision"], data["commit"], data["split"]) == (DATA, "main", D1, "train")
    assert plan["tasks"]["main"]["source"] == data["path"] and "split" not in plan["tasks"]["main"]
    assert Path(data["path"]).is_relative_to(tmp_path / "rlflow-cache")
    from rlflow.data_sources import read_table

    assert read_table(data["path"]).to_pylist() == ROWS  # the readers of a `datasets` directory read it as it is


def test_a_revision_pin_resolves_that_snapshot(tmp_path, cache):
    for rev in ("v1", C1):
        plan = compile_pipeline(pipeline(tmp_path, model=f"{MODEL}@{rev}"))
        assert plan["hub"]["model.path"]["commit"] == C1 and plan["hub"]["model.path"]["revision"] == rev
        assert plan["pipeline"]["model"]["path"].endswith(f"snapshots/{C1}")
    found = problems(pipeline(tmp_path, model=f"{MODEL}@v9"))
    assert found["hub-not-cached"].message.count("revision 'v9' is not in the Hub cache")
    assert "--revision v9" in found["hub-not-cached"].fix and "bad-model-path" not in found


def test_a_dataset_config_and_split_are_chosen_or_named(tmp_path, cache):
    plan = compile_pipeline(pipeline(tmp_path, data=f'{{source: "{GSM}:main", split: test, prompt_field: question}}'))
    assert (plan["hub"]["data.source"]["config"], plan["hub"]["data.source"]["split"]) == ("main", "test")
    found = problems(pipeline(tmp_path, data=f'{{source: "{GSM}", prompt_field: question}}'))
    assert "main, socratic" in found["hub-dataset-config"].message and f"{GSM}:main" in found["hub-dataset-config"].fix
    found = problems(pipeline(tmp_path, data=f'{{source: "{GSM}:main", prompt_field: question}}'))
    assert "train, test" in found["bad-split"].message and found["bad-split"].loc == ("data", "source")
    assert set(found) == {"bad-split"}


def test_an_uncached_id_is_a_named_problem_with_the_fetch_command(tmp_path, cache, capsys):
    path = pipeline(tmp_path, model="nobody/no-model", data='{source: "nobody/no-data"}')
    found = problems(path)
    assert set(found) == {"hub-not-cached"}
    with pytest.raises(PipelineInvalid) as e:
        check_pipeline(path)
    model, data = sorted(e.value.problems, key=lambda p: p.loc[0], reverse=True)
    assert model.loc == ("model", "path") and data.loc == ("data", "source")
    assert f"not in the Hub cache at {cache}" in model.message and "does not download" in model.message
    assert "hf download nobody/no-model" in model.fix and "snapshot_download('nobody/no-model')" in model.fix
    assert "hf download nobody/no-data --repo-type dataset" in data.fix and "repo_type='dataset'" in data.fix
    assert main(["compile", str(path), "-o", str(tmp_path / "plan.json")]) == 2
    err = capsys.readouterr().err
    assert "[hub-not-cached]" in err and "Traceback" not in err and "bad-model-path" not in err


def test_a_missing_local_path_keeps_its_own_error(tmp_path, cache):
    assert "bad-model-path" in problems(pipeline(tmp_path, model="./no-such-model"))
    assert "hub-not-cached" not in problems(pipeline(tmp_path, data='{source: "data/missing.jsonl"}'))


def test_judge_and_reward_model_ids_resolve_too(tmp_path, cache):
    path = pipeline(tmp_path)
    judge = (f'{{kind: reward, judge: {{model: "{MODEL}", template: "{{prompt}}{{completion}} is", verdict: yes_no}}, '
             'eval_fn: exact_match}')
    path.write_text(path.read_text().replace("{kind: reward, fn: exact_match}", judge))
    plan = compile_pipeline(path)
    snap = plan["hub"]["stages.score.judge.model"]["snapshot"]
    assert snap.endswith(f"snapshots/{C2}") and snap in json.dumps(plan["data_operators"])
    path.write_text(path.read_text().replace(f'model: "{MODEL}"', 'model: "nobody/judge"'))
    found = problems(path)
    assert set(found) == {"hub-not-cached"} and found["hub-not-cached"].loc == ("stages", "score", "judge", "model")
    path.write_text(path.read_text().replace(judge.replace(MODEL, "nobody/judge"),
                                             '{kind: reward, scorers: [{model: "nobody/rm"}]}'))
    found = problems(path)
    assert set(found) == {"hub-not-cached"} and found["hub-not-cached"].loc == ("stages", "score", "scorers", 0, "model")


# ------------------------------------------------------------------------------------------------------- runtime

def test_the_run_loads_the_snapshot_the_plan_names_and_says_how_to_fetch_it_again(tmp_path, cache):
    from rlflow.plan_model import Plan
    from rlflow.runtime.model import prepare_model

    plan = Plan.of(compile_pipeline(pipeline(tmp_path)))
    assert prepare_model(plan) == Path(plan.raw["hub"]["model.path"]["snapshot"])
    shutil.rmtree(cache / f"models--{MODEL.replace('/', '--')}")
    with pytest.raises(PipelineInvalid) as e:
        prepare_model(plan)
    (problem,) = e.value.problems
    assert problem.rule == "bad-model-path" and f"hf download {MODEL} --revision {C2}" in problem.fix
