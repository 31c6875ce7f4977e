"""What builtin:tiny-llama is warm-started on (rlflow/runtime/model.py warm_start_of) and how `rlflow compile` says
so (rlflow/compiler.py model_note): a pipeline on its own data starts from a model that has seen that data's
training rows, never silently from one warm-started on arithmetic."""

from __future__ import annotations

import json

from rlflow.compiler import compile_pipeline, model_note
from rlflow.plan_model import Plan
from rlflow.prompt_rows import held_out
from rlflow.runtime.model import warm_start_of


def own_task(tmp_path, *, extra: list[str] | None = None) -> dict:
    rows = [{"prompt": f"reverse {w} =", "answer": w[::-1]} for w in ("abc", "hello", "rlflow", "tiny", "model") * 20]
    (tmp_path / "words.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "p.yaml").write_text("""
name: own
model: {path: "builtin:tiny-llama", max_model_len: 128}
data: {source: words.jsonl}
stages:
  rollout: {kind: rollout, engine: hf, group_size: 4, max_new_tokens: 16}
  score:   {kind: reward, fn: exact_match}
  buffer:  {kind: buffer, batch_groups: 2}
  train:   {kind: train, deepspeed: configs/deepspeed/zero1.json, steps: 2}
edges:
  - {from: data,    to: rollout, policy: {kind: streaming}}
  - {from: rollout, to: score,   policy: {kind: streaming}}
  - {from: score,   to: buffer,  policy: {kind: streaming}}
  - {from: buffer,  to: train,   policy: {kind: staleness_bound, eta: 1}}
  - {from: train,   to: rollout, policy: {kind: weight_sync, mode: global}}
""")
    return compile_pipeline(tmp_path / "p.yaml", extra or [])


def test_a_pipeline_on_its_own_data_warm_starts_on_its_training_rows(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = own_task(tmp_path)
    what, rows = warm_start_of(Plan.of(plan))
    assert what == str(tmp_path / "words.jsonl") and len(rows) == 100
    assert rows[0] == {"prompt": "reverse abc =", "answer": "cba"}
    note = model_note(plan)
    assert note == ["builtin:tiny-llama: a 0.6M-parameter Llama built on this machine (about a minute, then cached), "
                    f"warm-started on the training rows of {tmp_path / 'words.jsonl'}"]


def test_held_out_rows_are_not_warm_started_on(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = own_task(tmp_path, extra=["data.eval=0.4"])
    _, rows = warm_start_of(Plan.of(plan))
    assert rows and not any(held_out(r["prompt"], 0.4) for r in rows)
    assert len(rows) < 100  # some of the five words hash as held out


def test_built_in_tasks_name_themselves(quickstart_plan):
    assert warm_start_of(Plan.of(quickstart_plan)) == ("repeat", None)
    assert model_note(quickstart_plan)[0].endswith("warm-started on builtin:repeat")


def test_a_bad_row_past_the_head_is_named_by_its_line(tmp_path, monkeypatch):
    import pytest

    from rlflow.errors import PipelineInvalid

    monkeypatch.chdir(tmp_path)
    plan = own_task(tmp_path)
    lines = (tmp_path / "words.jsonl").read_text().splitlines()
    lines[70] = json.dumps({"prompt": "reverse x ="})  # no answer, far past the head the run start checks
    (tmp_path / "words.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(PipelineInvalid) as err:
        warm_start_of(Plan.of(plan))
    (problem,) = err.value.problems
    assert (problem.loc, problem.rule) == (("data", "source"), "missing-answer") and "line 71" in problem.message
