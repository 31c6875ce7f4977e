"""A data row without a prompt or an answer is invalid input naming the task and the row (no Ray needed)."""

from __future__ import annotations

import json

import pytest

from rlflow.errors import PipelineInvalid
from rlflow.runtime.prompt_source import _TaskRows


def rows_of(path, name="main", **spec) -> _TaskRows:
    return _TaskRows(name, {"source": str(path), **spec}, 0, "pipe.yaml")


def problem(rows: _TaskRows, row: dict):
    with pytest.raises(PipelineInvalid) as e:
        rows._check_row(row)
    (p,) = e.value.problems
    return p


def test_a_row_without_an_answer_names_the_task_and_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2="},
                                                       {"prompt": "3+3=", "answer": None}]) + "\n")
    p = problem(rows_of(path), {"prompt": "2+2=", "answer": None})
    assert (p.loc, p.rule) == (("data", "source"), "missing-answer")
    assert p.message == f"task 'main': '{path}' line 2 has no answer ('answer' is missing or null)"
    assert p.fix == "give every row an answer, or remove the rows without one"


def test_a_null_prompt_in_parquet_names_the_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"q": ["a", "b", None], "a": ["x", "y", "z"]}), tmp_path / "w.parquet")
    rows = rows_of(tmp_path / "w.parquet", name="words", prompt_field="q", answer_field="a")
    p = problem(rows, {"q": None, "a": "z"})
    assert (p.loc, p.rule) == (("data", "tasks", "words", "source"), "missing-prompt")
    assert f"'{tmp_path / 'w.parquet'}' row 3 has no prompt ('q' is missing or null)" in p.message


def test_nan_is_missing_and_other_values_are_not(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": 2}\n')
    rows = rows_of(path)
    rows._check_row({"prompt": "1+1=", "answer": 2})
    rows._check_row({"prompt": "1+1=", "answer": ""})
    assert problem(rows, {"prompt": "1+1=", "answer": float("nan")}).rule == "missing-answer"


def test_a_row_not_found_again_is_named_by_its_draw(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n')  # the file changed since: fall back to the draw
    rows = rows_of(path)
    rows.in_epoch = 6
    assert "row 7 drawn from" in problem(rows, {"prompt": "x"}).message
