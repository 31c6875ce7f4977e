"""The head of a prompt file is checked before anything starts (rlflow/data_head.py): each problem is named by its
line or row, rows past the head are left to the stream, and the check reads only the head."""

from __future__ import annotations

import json

import pytest

from rlflow.data_head import first_bad, head_problem, row_problem
from rlflow.errors import PipelineInvalid
from rlflow.runtime.prompt_source import check_sources

FIELDS = ("prompt", "answer")


def jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def sums(n: int) -> list[dict]:
    return [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(n)]


def test_a_row_without_an_answer_is_named_by_its_line(tmp_path):
    rows = sums(6)
    rows[3] = {"prompt": "3+1="}
    rows[5]["answer"] = None
    path = jsonl(tmp_path / "p.jsonl", rows)
    assert head_problem(path, FIELDS) == (f"'{path}' line 4 has no answer ('answer' is missing or null)", "missing-answer",
                                          "give every row an answer, or remove the rows without one")
    assert head_problem(path, FIELDS, name="p.jsonl")[0].startswith("'p.jsonl' line 4 ")


def test_blank_lines_count_as_lines_and_a_null_prompt_is_named(tmp_path):
    path = jsonl(tmp_path / "p.jsonl", [sums(1)[0], "", {"prompt": None, "answer": "1"}])
    message, rule, _ = head_problem(path, FIELDS)
    assert (rule, message) == ("missing-prompt", f"'{path}' line 3 has no prompt ('prompt' is missing or null)")


@pytest.mark.parametrize("line, what", [('{"prompt": "9+1=", "answer": 10', "not JSON"), ("42", "a int, not a JSON object")])
def test_a_line_that_is_not_a_json_object_is_bad_data(tmp_path, line, what):
    path = jsonl(tmp_path / "p.jsonl", sums(3) + [line] + sums(2))
    message, rule, fix = head_problem(path, FIELDS)
    assert rule == "bad-data" and message.startswith(f"cannot read '{path}' line 4: {what}"), message
    assert "JSON lines" in fix


def test_a_file_that_is_not_text_is_bad_data_not_a_crash(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n\xff\xfe\x00junk\n')
    message, rule, _ = head_problem(path, FIELDS)
    assert rule == "bad-data" and message.startswith(f"cannot read '{path}': UnicodeDecodeError"), message
    assert head_problem(jsonl(tmp_path / "q.jsonl", ['"array"']), FIELDS)[0].endswith("a str, not a JSON object")


def test_columns_are_named_from_the_first_row(tmp_path):
    path = jsonl(tmp_path / "p.jsonl", [{"question": "q", "answer": "a"}] * 3)
    assert head_problem(path, FIELDS)[:2] == (f"'{path}' has no column 'prompt' (columns: question, answer)", "bad-data")
    assert head_problem(path, ("question", "answer")) is None


def test_an_empty_file_has_no_rows(tmp_path):
    path = jsonl(tmp_path / "p.jsonl", [""])
    assert head_problem(path, FIELDS)[:2] == (f"'{path}' has no rows", "bad-data")


def test_rows_past_the_head_are_left_to_the_stream(tmp_path):
    rows = sums(8)
    rows[6] = {"prompt": "6+1="}
    path = jsonl(tmp_path / "p.jsonl", rows)
    assert head_problem(path, FIELDS, rows=6) is None
    assert head_problem(path, FIELDS, rows=7)[1] == "missing-answer"
    assert first_bad(path, FIELDS, "missing-answer") == f"'{path}' line 7"  # the stream's error names the line all the same
    assert first_bad(path, FIELDS, "missing-prompt") is None


def test_a_json_array_file_is_left_to_the_stream(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(sums(3), indent=1))
    assert head_problem(path, FIELDS) is None


def test_parquet_rows_and_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "w.parquet"
    pq.write_table(pa.table({"q": ["a", "b", "c"], "a": ["x", None, "z"]}), path)
    assert head_problem(path, ("q", "a")) == (f"'{path}' row 2 has no answer ('a' is missing or null)", "missing-answer",
                                              "give every row an answer, or remove the rows without one")
    assert head_problem(path, ("q", "a"), rows=1) is None
    assert head_problem(path, FIELDS)[:2] == (f"'{path}' has no column 'prompt', 'answer' (columns: q, a)", "bad-data")
    (tmp_path / "junk.parquet").write_text("not parquet")
    assert head_problem(tmp_path / "junk.parquet", FIELDS)[1] == "bad-data"


def test_run_start_names_the_task_and_skips_builtin_tasks(tmp_path):
    rows = sums(5)
    rows[1] = {"prompt": "1+1=", "answer": None}
    path = jsonl(tmp_path / "p.jsonl", rows)
    check_sources({"main": {"source": "builtin:arith"}}, "pipe.yaml")
    with pytest.raises(PipelineInvalid) as e:
        check_sources({"arith": {"source": "builtin:arith"}, "sums": {"source": path}}, "pipe.yaml")
    (p,) = e.value.problems
    assert (p.loc, p.rule) == (("data", "tasks", "sums", "source"), "missing-answer")
    assert p.message == f"task 'sums': '{path}' line 2 has no answer ('answer' is missing or null)"


@pytest.mark.parametrize("row, rule, message", [
    ({"prompt": "", "answer": "2"}, "empty-prompt", "has an empty prompt ('prompt' is '')"),
    ({"prompt": " \n\t", "answer": "2"}, "empty-prompt", "has an empty prompt ('prompt' is ' \\n\\t')"),
    ({"prompt": "1+1=", "answer": "  "}, "empty-answer", "has an empty answer ('answer' is '  ')"),
    ({"prompt": ["1+1="], "answer": "2"}, "prompt-not-text", "has a prompt that is not text ('prompt' is a list)"),
    ({"prompt": 7, "answer": "2"}, "prompt-not-text", "has a prompt that is not text ('prompt' is a int)"),
    ({"prompt": "1+1=", "answer": {"v": 2}}, "answer-not-text", "has an answer that is not text ('answer' is a dict)"),
    ({"prompt": "1+1=", "answer": True}, "answer-not-text", "has an answer that is not text ('answer' is a bool)"),
])
def test_empty_or_non_text_prompts_and_answers_are_named_by_their_line(tmp_path, row, rule, message):
    path = jsonl(tmp_path / "p.jsonl", sums(3) + [row] + sums(2))
    got, got_rule, fix = head_problem(path, FIELDS)
    assert (got_rule, got) == (rule, f"'{path}' line 4 {message}")
    assert fix.startswith("give every row" if rule.startswith("empty") else "write every")
    assert first_bad(path, FIELDS, rule) == f"'{path}' line 4"  # found again, for a row drawn later in the run


@pytest.mark.parametrize("answer", ["2", 2, 2.5, "0"])
def test_numbers_are_answers(answer):
    assert row_problem({"prompt": "1+1=", "answer": answer}, FIELDS, "here") is None


def test_empty_strings_in_parquet_are_named_by_their_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "answer": ["x", "", "z"]}), tmp_path / "w.parquet")
    assert head_problem(tmp_path / "w.parquet", FIELDS)[:2] == (
        f"'{tmp_path / 'w.parquet'}' row 2 has an empty answer ('answer' is '')", "empty-answer")
