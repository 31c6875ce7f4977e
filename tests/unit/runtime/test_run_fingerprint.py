"""A resume knows what changed since the run started (rlflow/runtime/run_fingerprint.py): a changed batch, group size,
algorithm, model, tokenizer, replaced data file or edited reward module is refused before Ray starts (exit 2, the rule
named, old and new shown, the way out); an appended data file and harmless settings are applied and said in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rlflow.cli import main
from rlflow.compiler import compile_pipeline, read_plan
from rlflow.errors import PipelineInvalid
from rlflow.plan_model import Plan
from rlflow.runtime import launch, run_fingerprint
from rlflow.runtime.launch import new_run_dir
from rlflow.runtime.run_fingerprint import FINGERPRINT_FILE, check, compare, fingerprint

REPO = Path(__file__).resolve().parents[3]
QUICKSTART = REPO / "pipelines" / "quickstart.yaml"
ROWS = [{"prompt": f"repeat: w{i}", "answer": f"w{i}"} for i in range(40)]
REWARD = ("def score(completion, answer):\n    return float(completion.strip() == answer)\n\n\n"
          "def other(completion, answer):\n    return 0.0\n")
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 128, "vocab_size": 384}


def rows_text(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


@pytest.fixture
def started(tmp_path, monkeypatch):
    """A run of the quickstart started in a fresh working dir, with its own data file, reward module and model
    directory, and a checkpoint to resume: (working dir, run dir)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.jsonl").write_text(rows_text(ROWS))
    (tmp_path / "myrewards.py").write_text(REWARD)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    (model / "model.safetensors").write_bytes(b"\1" * 4096)
    (model / "tokenizer.json").write_text('{"version": "1.0"}')
    assert main(["compile", str(QUICKSTART), "--set", "data.source=prompts.jsonl", "--set", "stages.score.fn=myrewards:score",
                 "--set", f"model.path={model}"]) == 0
    run_dir = new_run_dir(read_plan(".rlflow/plan.json"))
    (run_dir / "state.json").write_text("{}")  # a checkpoint to resume
    return tmp_path, run_dir


def resume_refused(capsys, *sets: str) -> list[str]:
    """`rlflow run --resume [--set ...]` exits 2 before Ray starts; its problem lines."""
    from unittest import mock

    import ray

    capsys.readouterr()
    # as on a fresh machine: rlflow run would call ray.init, which tests/conftest.py forbids in unit tests
    with mock.patch.object(ray, "is_initialized", lambda: False):
        assert main(["run", "--resume", *[a for s in sets for a in ("--set", s)]]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "this is a bug" not in err, err
    return err.strip().splitlines()[1:]


def test_a_resume_with_a_changed_batch_or_group_size_exits_2_before_ray(started, capsys):
    _, run_dir = started
    lines = resume_refused(capsys, "stages.buffer.batch_groups=8", "stages.rollout.group_size=4")
    assert len(lines) == 2
    batch = next(line for line in lines if line.endswith("[resume-changed-batch]"))
    group = next(line for line in lines if line.endswith("[resume-changed-group-size]"))
    assert batch.startswith("  --resume: the batch changed since the run started: groups per step 16 -> 8; ")
    assert "stages.rollout.group_size 8 -> 4; " in group
    # the way out: a new run from the checkpoint's weights, with the new settings
    assert f"rlflow export {run_dir} -o {run_dir / 'checkpoint-export'} && rlflow run " in batch
    assert batch.split(" && rlflow run ")[1].split(" [")[0].endswith(
        "stages.buffer.batch_groups=8 stages.rollout.group_size=4 model.path=" + str(run_dir / "checkpoint-export"))
    assert json.loads((run_dir / FINGERPRINT_FILE).read_text())["settings"]["resume-changed-batch"] == {"groups per step": 16}


def test_a_resume_with_a_changed_algorithm_exits_2(started, capsys):
    (line,) = resume_refused(capsys, "stages.train.algo=gspo")
    assert "the algorithm changed since the run started: stages.train.algo 'grpo' -> 'gspo'" in line
    assert line.endswith("[resume-changed-algorithm]")


def test_a_resume_with_a_changed_model_or_tokenizer_exits_2(started, capsys):
    work, _ = started
    (work / "model" / "model.safetensors").write_bytes(b"\2" * 4096)  # fine-tuned in place: same size, new values
    (line,) = resume_refused(capsys)
    assert line.endswith("[resume-changed-model]") and "weights.model.safetensors.sha256_head_tail sha256 " in line
    assert "restore it to resume, or start a new run (rlflow run without --resume)" in line
    (work / "model" / "model.safetensors").write_bytes(b"\1" * 4096)
    (work / "model" / "tokenizer.json").write_text('{"version": "2.0"}')
    (line,) = resume_refused(capsys)
    assert line.endswith("[resume-changed-tokenizer]") and "tokenizer.json sha256 " in line
    (work / "model" / "tokenizer.json").write_text('{"version": "1.0"}')
    other = work / "model2"
    shutil.copytree(work / "model", other)
    (line,) = resume_refused(capsys, f"model.path={other}")
    assert f"path '{work / 'model'}' -> '{other}'" in line and line.endswith("[resume-changed-model]")


def test_a_resume_with_a_replaced_data_file_exits_2(started, capsys):
    work, _ = started
    (work / "prompts.jsonl").write_text(rows_text(reversed(ROWS)))  # same size, other order
    (line,) = resume_refused(capsys)
    assert f"the training data changed since the run started: task 'main': '{work / 'prompts.jsonl'}' was" in line
    assert line.endswith("[resume-changed-data]") and "rlflow export " in line
    (work / "prompts.jsonl").write_text(rows_text(ROWS[:10]))  # shortened
    (line,) = resume_refused(capsys)
    assert f"prompts.jsonl' was {len(rows_text(ROWS))} bytes, is {len(rows_text(ROWS[:10]))}" in line
    (work / "prompts.jsonl").unlink()
    (line,) = resume_refused(capsys)
    assert f"'{work / 'prompts.jsonl'}' is gone" in line


def test_a_resume_with_an_edited_reward_module_exits_2(started, capsys):
    work, _ = started
    (work / "myrewards.py").write_text(REWARD.replace("float(", "0.5 * float("))
    (line,) = resume_refused(capsys)
    assert ("the reward changed since the run started: user module 'myrewards' (named by myrewards:score): "
            "myrewards.py was edited") in line
    assert line.endswith("[resume-changed-reward]")
    (work / "myrewards.py").write_text(REWARD)
    (line,) = resume_refused(capsys, "stages.score.fn=myrewards:other")  # another function: refused by name too
    assert "stages.score.fn 'myrewards:score' -> 'myrewards:other'" in line


def test_an_appended_data_file_and_harmless_settings_are_applied_and_said(started, monkeypatch, capsys):
    """Rows appended to the data file keep the rows drawn so far (the file's head is unchanged): applied. So are
    more steps and another eval size; `rlflow run --resume` says so in one line and goes on to the run."""
    work, run_dir = started
    (work / "prompts.jsonl").write_text(rows_text(ROWS + [{"prompt": "repeat: new", "answer": "new"}]))
    went_on = []
    monkeypatch.setattr(launch, "_launch", lambda plan, *a, **k: went_on.append(plan) or {"stopped": False})
    capsys.readouterr()
    assert main(["run", "--resume", "--set", "stages.train.steps=200", "--set", "data.eval_size=64"]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("resume: ")]
    assert said == [f"resume: applied what changed since the run started: task 'main': '{work / 'prompts.jsonl'}' grew from "
                    f"{len(rows_text(ROWS))} to {(work / 'prompts.jsonl').stat().st_size} bytes, its first "
                    f"{len(rows_text(ROWS))} unchanged; data.eval_size 128 -> 64; stages.train.steps 100 -> 200"]
    assert went_on and went_on[0].trainer.steps == 200
    # the record is now the resumed run's: a second resume with the same inputs says nothing
    said = []
    check(went_on[0], run_dir, log=said.append)
    assert said == []


def test_compare_of_two_recorded_fingerprints(tmp_path):
    """compare() on two recorded fingerprints: each refused kind by its rule, the rest applied."""
    base = Plan.of(compile_pipeline(QUICKSTART))
    old = fingerprint(base)
    assert compare(old, json.loads(json.dumps(old))) == ([], [])
    changed = Plan.of(compile_pipeline(QUICKSTART, ["stages.buffer.batch_groups=8", "stages.rollout.group_size=4",
                                                    "stages.score.fn=numeric_close", "stages.train.checkpoint_every=5",
                                                    "edges.3.policy.eta=2"]))
    refused, applied = compare(old, fingerprint(changed))
    assert sorted(rule for rule, _ in refused) == ["resume-changed-batch", "resume-changed-group-size",
                                                   "resume-changed-reward"]
    assert {"stages.train.checkpoint_every 10 -> 5", "edges[3].policy.eta 1 -> 2"} <= set(applied)


def test_a_run_without_a_fingerprint_is_recorded_at_its_first_resume(tmp_path):
    plan = Plan.of(compile_pipeline(QUICKSTART))
    run_dir = new_run_dir(plan, tmp_path)
    (run_dir / FINGERPRINT_FILE).unlink()  # a run started by an older rlflow
    said = []
    check(plan, run_dir, log=said.append)
    assert len(said) == 1 and "has no fingerprint of its inputs, none recorded" in said[0]
    assert (run_dir / FINGERPRINT_FILE).is_file()
    with pytest.raises(PipelineInvalid) as e:
        check(Plan.of(compile_pipeline(QUICKSTART, ["stages.rollout.group_size=4"])), run_dir)
    assert [p.rule for p in e.value.problems] == ["resume-changed-group-size"]


def test_a_large_data_file_is_compared_by_its_hashed_head_and_size(tmp_path, monkeypatch):
    """Past HASHED_BYTES only the size is compared: an append is still told from a replacement by the head."""
    monkeypatch.setattr(run_fingerprint, "HASHED_BYTES", 64)
    monkeypatch.setattr(run_fingerprint, "CHUNK_BYTES", 16)
    f = tmp_path / "rows.jsonl"
    f.write_text(rows_text(ROWS))
    old = run_fingerprint._data_file(f)
    assert len(old["chunks"]) == 4
    f.write_text(rows_text(ROWS) + rows_text(ROWS[:1]))
    assert run_fingerprint._file_change("rows.jsonl", old, run_fingerprint._data_file(f, old))[0] == "appended"
    f.write_text("x" + rows_text(ROWS))
    kind, why = run_fingerprint._file_change("rows.jsonl", old, run_fingerprint._data_file(f, old))
    assert kind == "replaced" and "first different in bytes 0-16" in why, why
