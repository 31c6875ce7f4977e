"""The first rows of a prompt file, checked before anything starts.

A row without a prompt or an answer (or with one that is empty or not text), a line that is not JSON, or a
missing column is named by its line at
`rlflow compile`, and again when `rlflow run` starts (the file may have changed since), instead of after the
engines and the trainer have started. Only the head is read: a file of a million rows is still checked in
milliseconds. Rows past the head are checked as they are drawn (runtime/prompt_source.py), with the same messages.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlflow.data_sources import TableProblem, column_types_problem, generated, is_table, read_table
from rlflow.prompt_rows import row_problem as row_problem  # re-exported: the rule every reader judges a row by
from rlflow.prompt_rows import row_problem_as

HEAD_ROWS = 1000  # rows checked up front; the stream checks every row it draws

READ_FIX = "check that the file is JSON lines (.jsonl/.json) or Parquet"
COLUMN_FIX = "set prompt_field / answer_field to the right columns"
_ARRAY = object()  # _json_lines: the file is one JSON array, not JSON lines


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


def head_problem(path: str | Path, fields: tuple[str, str], rows: int | None = None, name: str | None = None, *,
                 split: str | None = None, prompt_format: str = "raw") -> tuple[str, str, str] | None:
    """(message, rule, fix) for the first problem among the first `rows` (default HEAD_ROWS) rows of a .jsonl /
    .json / .parquet file of prompts with (prompt, answer) columns `fields`; None if they are all usable. Messages
    call the file `name` (default: the path). A .json file holding one JSON array is left to the stream (it is
    parsed whole there). A `datasets` directory or .arrow file (data_sources.py) is read with its `split`; with
    prompt_format messages the prompt column holds chats (prompt_rows.row_problem_as)."""
    rows = rows or HEAD_ROWS
    shown = name or str(path)
    if generated(path):
        return _generated_head(str(path), fields, rows, prompt_format)
    if is_table(path):
        return _table_head(str(path), fields, rows, shown, split, prompt_format)
    if str(path).endswith(".parquet"):
        return _parquet_head(str(path), fields, rows, shown, prompt_format)
    try:
        return _json_head(str(path), fields, rows, shown, prompt_format)
    except (OSError, UnicodeDecodeError) as err:  # unreadable, or not text: the same problem for the user
        return (f"cannot read '{shown}': {type(err).__name__}: {err}"[:300], "bad-data", READ_FIX)


def _json_head(path: str, fields: tuple[str, str], rows: int, shown: str,
               prompt_format: str = "raw") -> tuple[str, str, str] | None:
    seen = 0
    for number, row in _json_lines(path):
        if isinstance(row, Exception):
            return (f"cannot read '{shown}' line {number}: not JSON ({row})", "bad-data", READ_FIX)
        if row is _ARRAY:
            return None
        if not isinstance(row, dict):
            return (f"cannot read '{shown}' line {number}: a {type(row).__name__}, not a JSON object", "bad-data", READ_FIX)
        problem = column_problem(shown, fields, row) if seen == 0 else None  # columns: named from the first row
        problem = problem or row_problem_as(row, fields, f"'{shown}' line {number}", prompt_format)
        if problem:
            return problem
        seen += 1
        if seen >= rows:
            return None
    return None if seen else no_rows_problem(shown)


def head_rows(path: str | Path, fields: tuple[str, str], rows: int | None = None, *, split: str | None = None,
              prompt_format: str = "raw") -> list[tuple[str, dict]]:
    """("'p.jsonl' line 7", row) for the usable rows among the first `rows` (default HEAD_ROWS) of a .jsonl /
    .parquet file or a table (data_sources.py); [] for a .json array file (parsed whole by the stream). head_problem
    names the unusable ones."""
    rows, path = rows or HEAD_ROWS, str(path)
    if is_table(path):
        head = read_table(path, split).select(list(dict.fromkeys(fields))).slice(0, rows).to_pylist()
        found = [(f"'{path}' row {i + 1}", row) for i, row in enumerate(head)]
    elif path.endswith(".parquet"):
        import pyarrow.parquet as pq

        file = pq.ParquetFile(path)
        if file.metadata.num_rows == 0:
            return []
        batch = next(file.iter_batches(batch_size=rows, columns=list(fields)))
        found = [(f"'{path}' row {i + 1}", row) for i, row in enumerate(batch.to_pylist())]
    else:
        found = []
        for number, row in _json_lines(path):
            if row is _ARRAY or len(found) >= rows:
                break
            found.append((f"'{path}' line {number}", row))
    return [(where, row) for where, row in found
            if isinstance(row, dict) and row_problem_as(row, fields, where, prompt_format) is None]


def first_bad(path: str | Path, fields: tuple[str, str], rule: str, *, split: str | None = None,
              prompt_format: str = "raw") -> str | None:
    """Where the file first breaks `rule` ("'p.jsonl' line 7", "'p.parquet' row 3"): a row_problem rule, or bad-data
    for a line that is not a JSON object; reads the whole file (only on an error path); None if no row does or the
    file cannot be read."""
    return first_row(path, lambda row: _breaks(row, fields, rule, prompt_format), fields, split=split)


def first_row(path: str | Path, pick, columns: tuple[str, ...] | None = None, *, split: str | None = None) -> str | None:
    """Where the file's first row that `pick(row)` is true of is ("'p.jsonl' line 7", "'p.parquet' row 3"); a JSON
    line that does not parse is passed as its ValueError. Parquet rows hold only `columns` (default: all). Reads the
    whole file (only on an error path); None if no row is picked or the file cannot be read."""
    path = str(path)
    try:
        if is_table(path):
            table = read_table(path, split)
            rows = table.select(list(dict.fromkeys(columns))).to_pylist() if columns else table.to_pylist()
            first = next((i for i, row in enumerate(rows) if pick(row)), None)
            return None if first is None else f"'{path}' row {first + 1}"
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            if columns and any(f not in pq.read_schema(path).names for f in columns):
                return f"'{path}' row 1"
            rows = pq.read_table(path, columns=list(columns) if columns else None).to_pylist()
            first = next((i for i, row in enumerate(rows) if pick(row)), None)
            return None if first is None else f"'{path}' row {first + 1}"
        return next((f"'{path}' line {n}" for n, row in _json_lines(path) if row is not _ARRAY and pick(row)), None)
    except Exception:  # noqa: BLE001 - only locating the row; the problem itself is already known
        return None


def _breaks(row, fields: tuple[str, str], rule: str, prompt_format: str = "raw") -> bool:
    if not isinstance(row, dict):  # a parse error, or a JSON value that is not an object
        return rule == "bad-data"
    problem = row_problem_as(row, fields, "", prompt_format)
    return problem is not None and problem[1] == rule


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


def _parquet_head(path: str, fields: tuple[str, str], rows: int, shown: str,
                  prompt_format: str = "raw") -> tuple[str, str, str] | None:
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
    batch = next(file.iter_batches(batch_size=rows, columns=list(dict.fromkeys(fields))))
    for i, row in enumerate(batch.to_pylist()):
        problem = row_problem_as(row, fields, f"'{shown}' row {i + 1}", prompt_format)
        if problem:
            return problem
    return None


def _generated_head(src: str, fields: tuple[str, str], rows: int, prompt_format: str) -> tuple[str, str, str] | None:
    """The head check of rows made by code (a taskset through an adapter): the first `rows` of them."""
    from rlflow import registry

    made = registry.resolve("task", src)(seed=0, count=rows)
    if not made:
        return no_rows_problem(src)
    for i, row in enumerate(made[:rows]):
        problem = (column_problem(src, fields, row) if i == 0 else None) or row_problem_as(
            row, fields, f"row {i + 1} of {src}", prompt_format)
        if problem:
            return problem
    return None


def _table_head(path: str, fields: tuple[str, str], rows: int, shown: str, split: str | None,
                prompt_format: str) -> tuple[str, str, str] | None:
    """The head check of a `datasets` directory or .arrow file: readable, the columns there and of the right types,
    the first rows usable."""
    try:
        table = read_table(path, split, shown)
    except TableProblem as err:
        return err.problem
    problem = column_problem(shown, fields, table.column_names) or column_types_problem(shown, table, fields, prompt_format)
    if problem:
        return problem
    if table.num_rows == 0:
        return no_rows_problem(shown)
    for i, row in enumerate(table.select(list(dict.fromkeys(fields))).slice(0, rows).to_pylist()):
        problem = row_problem_as(row, fields, f"'{shown}' row {i + 1}", prompt_format)
        if problem:
            return problem
    return None
