"""Prompts for a run: read with Ray Data (JSONL, JSON, Parquet, or a built-in task), tokenized, checked."""

from __future__ import annotations

from pathlib import Path

from rlflow import registry
from rlflow.errors import PipelineInvalid, Problem

BUILTIN_TASK_ROWS = 4096


def read_prompts(plan: dict) -> list[dict]:
    """Rows with the prompt and answer columns, read through a Ray Data reader."""
    import ray.data

    data = plan["pipeline"]["data"]
    src, limit = data["source"], data["limit"]
    if src.startswith("builtin:"):
        rows = registry.resolve("task", src)(seed=data["seed"], count=limit or BUILTIN_TASK_ROWS)
        ds = ray.data.from_items(rows)
    else:
        path = Path(src)
        if not path.exists():
            raise PipelineInvalid(plan["source"], [Problem(("data", "source"), f"no such data file '{src}'", "missing-file",
                                                           "check the path, then re-run rlflow compile")])
        reader = ray.data.read_parquet if path.suffix == ".parquet" else ray.data.read_json
        ds = reader(str(path))
    if limit:
        ds = ds.limit(limit)
    rows = ds.take_all()
    fields = (data["prompt_field"], data["answer_field"])
    missing = [f for f in fields if rows and f not in rows[0]]
    if not rows or missing:
        what = "no rows" if not rows else f"no column {', '.join(repr(m) for m in missing)} (columns: {', '.join(rows[0])})"
        raise PipelineInvalid(plan["source"], [Problem(("data",), f"'{src}' has {what}", "bad-data",
                                                       "set data.prompt_field / data.answer_field to the right columns")])
    return [{"prompt": str(r[fields[0]]), "answer": str(r[fields[1]])} for r in rows]


def tokenize_prompts(rows: list[dict], tokenizer, *, max_model_len: int, max_new_tokens: int, source: str) -> list[dict]:
    """Add prompt_ids; a prompt too long for the model is an input error, reported before any compute."""
    too_long = []
    for i, row in enumerate(rows):
        ids = tokenizer(row["prompt"], add_special_tokens=True)["input_ids"]
        row["prompt_ids"] = list(ids)
        if len(ids) + max_new_tokens > max_model_len:
            too_long.append((i, len(ids)))
    if too_long:
        i, n = too_long[0]
        raise PipelineInvalid(source, [Problem(
            ("data",), f"{len(too_long)} prompt(s) too long: prompt {i} has {n} tokens, and with max_new_tokens "
                       f"{max_new_tokens} it exceeds model.max_model_len {max_model_len}",
            "prompt-too-long", "raise model.max_model_len, lower max_new_tokens, or shorten the prompts")])
    return rows
