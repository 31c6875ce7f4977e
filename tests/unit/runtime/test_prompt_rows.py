"""A data row drawn during the run without a prompt or an answer (or with one that is empty or not text), or a
line that is not JSON, stops the run (BadRow: exit 3, a checkpoint) naming the task and the file's line (no Ray
needed)."""

from __future__ import annotations

import json

import pytest

from rlflow.errors import RunFailed
from rlflow.runtime.prompt_source import BadRow, _TaskRows


def rows_of(path, name="main", **spec) -> _TaskRows:
    return _TaskRows(name, {"source": str(path), **spec}, 0, "pipe.yaml")


def problem(rows: _TaskRows, row: dict):
    with pytest.raises(BadRow) as e:
        rows._check_row(row)
    assert isinstance(e.value, RunFailed) and str(e.value).endswith("then `rlflow run --resume` continues from the "
                                                                    "last checkpoint")
    return e.value.problem


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
    rows._check_row({"prompt": "1+1=", "answer": "0"})
    assert problem(rows, {"prompt": "1+1=", "answer": float("nan")}).rule == "missing-answer"
    assert problem(rows, {"prompt": "1+1=", "answer": ""}).rule == "empty-answer"


def test_a_row_not_found_again_is_named_by_its_draw(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n')  # the file changed since: fall back to the draw
    rows = rows_of(path)
    rows.in_epoch = 6
    assert "row 7 drawn from" in problem(rows, {"prompt": "x"}).message


def test_a_bad_line_anywhere_is_named_by_its_own_line(tmp_path):
    """Line 5,000 of a file whose head is fine: named as line 5000, not by its place in a Ray block."""
    lines = [json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(6000)]
    lines[4999] = '{"prompt": "4999+1=", "answer": 5000'
    lines[5500] = json.dumps({"prompt": "   ", "answer": "1"})
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(lines) + "\n")
    rows = rows_of(path)
    with pytest.raises(BadRow) as e:
        rows._parse(lines[4999])
    p = e.value.problem
    assert (p.loc, p.rule) == (("data", "source"), "bad-data")
    assert p.message.startswith(f"task 'main': cannot read '{path}' line 5000: not JSON (")
    assert problem(rows, json.loads(lines[5500])).message == (f"task 'main': '{path}' line 5501 has an empty prompt "
                                                              "('prompt' is '   ')")
    assert rows._parse(lines[3]) == {"prompt": "3+1=", "answer": "4"}
