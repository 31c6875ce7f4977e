"""Prompt tables from the Hugging Face ecosystem: a `datasets` directory or an Arrow file.

A directory written by `Dataset.save_to_disk` (one table) or `DatasetDict.save_to_disk` (a table per split,
chosen by the task's `split`) is read with `datasets.load_from_disk`; a `.arrow` file (Arrow IPC, file or stream
format: what `datasets` caches) with pyarrow alone. Either becomes one pyarrow Table, memory-mapped, that the head
check (data_head.py), the prompt stream (runtime/prompt_source.py) and the held-out reader (runtime/evaluation.py)
read as they read a Parquet file. Problems are (message, rule, fix) tuples, as the other readers' are.
"""

from __future__ import annotations

from pathlib import Path

from rlflow import registry

ARROW_SUFFIX = ".arrow"
INSTALL_DATASETS = "pip install datasets (or rlflow's `ecosystem` extra: pip install 'rlflow[ecosystem]')"


class TableProblem(ValueError):
    """A table source that cannot be read; `problem` is (message, rule, fix)."""

    def __init__(self, message: str, rule: str, fix: str):
        super().__init__(message)
        self.problem = (message, rule, fix)


def generated(src: str | Path) -> bool:
    """Whether a data source's rows are made by code, not read from a file: `builtin:<task>`, or a taskset through
    an adapter (`verifiers:package.module:load_taskset`, registry.ADAPTERS)."""
    src = str(src)
    return src.startswith("builtin:") or registry.adapter_target("task", src) is not None


def is_table(src: str | Path) -> bool:
    """Whether a data source names a `datasets` directory or an Arrow file (not builtin:, JSON lines or Parquet)."""
    src = str(src)
    return not generated(src) and (src.endswith(ARROW_SUFFIX) or Path(src).is_dir())


def read_table(path: str | Path, split: str | None = None, shown: str | None = None):
    """The source's rows as a pyarrow Table; TableProblem names what is wrong: not a `datasets` directory
    (bad-dataset-dir), a DatasetDict without `split` or with an unknown one (bad-split), an unreadable Arrow file
    (bad-data), `datasets` not installed (missing-package)."""
    path, shown = str(path), shown or str(path)
    if path.endswith(ARROW_SUFFIX):
        if split is not None:
            raise TableProblem(f"'{shown}' is one Arrow file, which has no splits (split: {split!r})", "bad-split",
                               "remove split, or point the source at a DatasetDict directory")
        return _read_arrow(path, shown)
    try:
        import datasets
    except ImportError:
        raise TableProblem(f"'{shown}' is a directory, read as a `datasets` directory, but the datasets package is "
                           "not installed", "missing-package", INSTALL_DATASETS) from None
    try:
        ds = datasets.load_from_disk(path)
    except Exception as err:  # noqa: BLE001 - FileNotFoundError and friends: the directory is not one save_to_disk wrote
        raise TableProblem(f"'{shown}' is not a `datasets` directory ({type(err).__name__}: "
                           f"{(str(err).splitlines() or [''])[0][:160]})", "bad-dataset-dir",
                           "point the source at a directory written by Dataset.save_to_disk or DatasetDict.save_to_disk, "
                           "or at a .jsonl/.json/.parquet/.arrow file") from None
    if isinstance(ds, datasets.DatasetDict):
        splits = ", ".join(ds)
        if split is None:
            raise TableProblem(f"'{shown}' holds several splits ({splits}); which one has the prompts?", "bad-split",
                               f"set split: to one of {splits}")
        if split not in ds:
            raise TableProblem(f"'{shown}' has no split {split!r} (splits: {splits})", "bad-split",
                               f"set split: to one of {splits}")
        ds = ds[split]
    elif split is not None:
        raise TableProblem(f"'{shown}' holds one Dataset, which has no splits (split: {split!r})", "bad-split",
                           "remove split (it names one split of a DatasetDict directory)")
    return ds.with_format("arrow")[:]


def _read_arrow(path: str, shown: str):
    import pyarrow as pa

    try:
        source = pa.memory_map(path)
    except OSError as err:
        raise TableProblem(f"cannot read '{shown}': {err}", "missing-file", "check the path") from None
    for opener in (pa.ipc.open_file, pa.ipc.open_stream):
        try:
            source.seek(0)
            return opener(source).read_all()
        except pa.ArrowInvalid:
            continue
    raise TableProblem(f"cannot read '{shown}': not an Arrow IPC file or stream", "bad-data",
                       "write it with pyarrow.ipc (or Dataset.save_to_disk), or use .jsonl/.json/.parquet")


def column_types_problem(shown: str, table, fields: tuple[str, str], prompt_format: str) -> tuple[str, str, str] | None:
    """A column of the wrong Arrow type, named before any row is read: the prompt must be text (a list of structs
    with prompt_format messages), the answer text or a number."""
    import pyarrow.types as t

    for field, what in zip(fields, ("prompt", "answer")):
        if field not in table.column_names:
            continue
        kind = table.schema.field(field).type
        chat = prompt_format == "messages" and field == fields[0]
        ok = (t.is_list(kind) or t.is_large_list(kind)) if chat else (
            t.is_string(kind) or t.is_large_string(kind) or t.is_null(kind)
            or (what == "answer" and (t.is_integer(kind) or t.is_floating(kind))))
        if not ok:
            want = "a list of {role, content} messages" if chat else ("text or a number" if what == "answer" else "text")
            return (f"'{shown}' column {field!r} is {kind}, but the {what} must be {want}", "bad-column-type",
                    f"point {what}_field at a column of {want}" + ("" if chat or what == "answer" else
                                                                   ", or set prompt_format: messages for chat rows"))
    return None
