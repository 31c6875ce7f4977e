"""The first rows of a prompt file, checked before anything starts.

A row without a prompt or an answer, a line that is not JSON, or a missing column is named by its line at
`rlflow compile`, and again when `rlflow run` starts (the file may have changed since), instead of after the
engines and the trainer have started. Only the head is read: a file of a million rows is still checked in
milliseconds. Rows past the head are checked as they are drawn (runtime/prompt_source.py), with the same messages.
"""

from __future__ import annotations

import json
from pathlib import Path

HEAD_ROWS = 1000  # rows checked up front; the stream checks every row it draws

READ_FIX = "check that the file is JSON lines (.jsonl/.json) or Parquet"
COLUMN_FIX = "set prompt_field / answer_field to the right columns"
_ARRAY = object()  # _json_lines: the file is one JSON array, not JSON lines


def missing(value) -> bool:
    """No value: absent, null, or a float NaN (how Parquet/pandas often write a null)."""
    return value is None or (isinstance(value, float) and value != value)


def missing_problem(where: str, field: str, what: str) -> tuple[str, str, str]:
    """A row at `where` lacks its `what` (prompt or answer), held in column `field`."""
    return (f"{where} has no {what} ({field!r} is missing or null)", f"missing-{what}",
            f"give every row {'an' if what == 'answer' else 'a'} {what}, or remove the rows without one")


def column_problem(shown: str, fields: tuple[str, str], columns) -> tuple[str, str, str] | None:
    """The file's columns lack one of `fields`, or None."""
    columns = list(columns)
    absent = [f for f in fields if f not in columns]
    if not absent:
        return None
    return (f"'{shown}' has no column {', '.join(repr(f) for f in absent)} (columns: {', '.join(columns)})", "bad-data",
            COLUMN_FIX)


def no_rows_problem(shown: str) -> tuple[str, str, str]:
    return (f"'{shown}' has no rows", "bad-data", "point the task at a file with prompts")


def head_problem(path: str | Path, fields: tuple[str, str], rows: int | None = None,
                 name: str | None = None) -> tuple[str, str, str] | None:
    """(message, rule, fix) for the first problem among the first `rows` (default HEAD_ROWS) rows of a .jsonl /
    .json / .parquet file of prompts with (prompt, answer) columns `fields`; None if they are all usable. Messages
    call the file `name` (default: the path). A .json file holding one JSON array is left to the stream (it is
    parsed whole there)."""
    rows = rows or HEAD_ROWS
    shown = name or str(path)
    if str(path).endswith(".parquet"):
        return _parquet_head(str(path), fields, rows, shown)
    try:
        return _json_head(str(path), fields, rows, shown)
    except (OSError, UnicodeDecodeError) as err:  # unreadable, or not text: the same problem for the user
        return (f"cannot read '{shown}': {type(err).__name__}: {err}"[:300], "bad-data", READ_FIX)


def _json_head(path: str, fields: tuple[str, str], rows: int, shown: str) -> tuple[str, str, str] | None:
    seen = 0
    for number, row in _json_lines(path):
        if isinstance(row, Exception):
            return (f"cannot read '{shown}' line {number}: not JSON ({row})", "bad-data", READ_FIX)
        if row is _ARRAY:
            return None
        if not isinstance(row, dict):
            return (f"cannot read '{shown}' line {number}: a {type(row).__name__}, not a JSON object", "bad-data", READ_FIX)
        problem = column_problem(shown, fields, row) if seen == 0 else None  # columns: named from the first row
        problem = problem or _row_problem(row, fields, f"'{shown}' line {number}")
        if problem:
            return problem
        seen += 1
        if seen >= rows:
            return None
    return None if seen else no_rows_problem(shown)


def first_missing(path: str | Path, field: str) -> str | None:
    """Where the file first lacks `field` ("'p.jsonl' line 7", "'p.parquet' row 3"), reading the whole file; None
    if no row lacks it or the file cannot be read."""
    path = str(path)
    try:
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            if field not in pq.read_schema(path).names:
                return f"'{path}' row 1"
            column = pq.read_table(path, columns=[field]).column(field).to_pylist()
            first = next((i for i, v in enumerate(column) if missing(v)), None)
            return None if first is None else f"'{path}' row {first + 1}"
        return next((f"'{path}' line {n}" for n, row in _json_lines(path)
                     if isinstance(row, dict) and missing(row.get(field))), None)
    except Exception:  # noqa: BLE001 - only locating the row; the problem itself is already known
        return None


def _row_problem(row: dict, fields: tuple[str, str], where: str) -> tuple[str, str, str] | None:
    for field, what in zip(fields, ("prompt", "answer")):
        if missing(row.get(field)):
            return missing_problem(where, field, what)
    return None


def _json_lines(path: str):
    """(line number, parsed row or the parse error) for each non-blank line; (1, _ARRAY) for a JSON array file."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            text = line.strip()
            if not text:
                continue
            if number == 1 and text.startswith("["):
                yield number, _ARRAY
                return
            try:
                yield number, json.loads(text)
            except ValueError as err:
                yield number, err


def _parquet_head(path: str, fields: tuple[str, str], rows: int, shown: str) -> tuple[str, str, str] | None:
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except Exception as err:  # noqa: BLE001 - any unreadable file is the same problem for the user
        return (f"cannot read '{shown}': {type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}", "bad-data", READ_FIX)
    problem = column_problem(shown, fields, file.schema_arrow.names)
    if problem:
        return problem
    if file.metadata.num_rows == 0:
        return no_rows_problem(shown)
    batch = next(file.iter_batches(batch_size=rows, columns=list(fields)))
    for i, row in enumerate(batch.to_pylist()):
        problem = _row_problem(row, fields, f"'{shown}' row {i + 1}")
        if problem:
            return problem
    return None
