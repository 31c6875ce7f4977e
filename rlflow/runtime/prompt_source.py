"""Prompts as lazy Ray Data streams, one per task, drawn by smooth weighted round-robin over the tasks' weights.

Each task is a Ray Data dataset (a built-in task's rows, or a .jsonl/.json/.parquet file) iterated with
iter_batches: nothing is pulled whole into the driver, which holds at most a shuffle window and a few batches.
Files are read on the driver's node (`on_this_node`), so on a cluster they need to exist only there.
Order is deterministic for a seed (resume re-creates the streams and skips rows); when a task's rows run out
a new epoch re-reads them (or reshuffles them in memory when small), reshuffled with seed + epoch.
"""

from __future__ import annotations

import contextlib
import json
import random
from pathlib import Path

import ray
from ray.data import DataContext

from rlflow import registry
from rlflow.data_head import (READ_FIX, column_problem, first_missing, head_problem, missing, missing_problem,
                              no_rows_problem)
from rlflow.errors import PipelineInvalid, Problem
from rlflow.runtime.evaluation import held_out
from rlflow.runtime.ray_data_quiet import quiet_ray_data

BUILTIN_TASK_ROWS = 4096  # rows generated for a built-in task without a limit
BATCH_ROWS = 256  # rows per batch fetched into the driver
BLOCK_BYTES = 1 << 20  # read blocks of about 1 MiB: the driver fetches whole blocks
# A windowed shuffle, not a global one (iter_batches' local_shuffle_buffer_size/_seed): rows are drawn at random
# from a buffer of SHUFFLE_WINDOW rows refilled in file order, so the first prompts come from the first ~10,000
# rows. A global shuffle (random_shuffle, randomize_block_order) is an all-to-all barrier that reads the whole
# source before the first row comes out, breaking "starts in seconds with bounded memory" for 1,000,000 rows.
SHUFFLE_WINDOW = 10_000
# A task whose epoch has at most this many rows keeps them after its first epoch and reshuffles them in memory
# (seed + epoch) instead of re-reading: starting a read costs seconds (Parquet ~3 s here), once per epoch.
CACHE_ROWS = 4096


def wrr_pick(current: dict[str, float], weights: dict[str, float], tasks: list[str]) -> str:
    """Smooth weighted round-robin (nginx's): the next of `tasks`; updates `current` in place. Deterministic:
    ties go to the earlier task in `tasks`."""
    total = sum(weights[t] for t in tasks)
    for t in tasks:
        current[t] = current.get(t, 0.0) + weights[t]
    best = max(tasks, key=lambda t: current[t])
    current[best] -= total
    return best


def wrr_state(weights: dict[str, float], drawn: dict[str, int]) -> dict[str, float]:
    """The round-robin state after `drawn` picks with every task offered each time (exact then; resume)."""
    n, total = sum(drawn.values()), sum(weights.values())
    return {t: n * w - drawn.get(t, 0) * total for t, w in weights.items()}


@contextlib.contextmanager
def _stream_context():
    """Datasets created inside read ~1 MiB blocks in a fixed order, quietly (each Dataset keeps a copy of the
    DataContext current at its creation; restored afterwards)."""
    ctx = DataContext.get_current()
    saved = (ctx.target_max_block_size, ctx.execution_options.preserve_order, ctx.enable_progress_bars,
             ctx.print_on_execution_start)
    ctx.target_max_block_size, ctx.execution_options.preserve_order = BLOCK_BYTES, True
    ctx.enable_progress_bars = ctx.print_on_execution_start = False
    try:
        yield
    finally:
        (ctx.target_max_block_size, ctx.execution_options.preserve_order, ctx.enable_progress_bars,
         ctx.print_on_execution_start) = saved


def on_this_node() -> dict[str, str]:
    """The label selector that runs a read on the driver's node, where the data file is: a cluster's other nodes
    need no copy of it, nor a shared filesystem; only the rows travel, through the object store. (Ray Data's
    `local://` paths do the same but are deprecated in 2.60; `ray.io/node-id` is a default label of every node.)"""
    return {"ray.io/node-id": ray.get_runtime_context().get_node_id()}


def encode_prompt(tokenizer, prompt: str, prompt_format: str = "raw", system_prompt: str | None = None) -> list[int]:
    """A prompt's token ids as the model expects them. raw: the text with the tokenizer's special tokens (<s>);
    chat: the tokenizer's chat template around it as the user message (after `system_prompt` as a system message),
    generation prompt added; ValueError when the tokenizer has no chat template."""
    if prompt_format == "raw":
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if prompt_format != "chat":
        raise ValueError(f"unknown prompt_format {prompt_format!r}; use raw or chat")
    messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    ids = tokenizer.apply_chat_template(messages + [{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 returns a BatchEncoding


def _plain(row: dict) -> dict:
    """The row as plain JSON types (timestamps and the like become strings)."""
    return json.loads(json.dumps(row, default=str))


class _TaskRows:
    """One task's rows, in epochs: a lazy dataset, iterated a batch at a time."""

    def __init__(self, name: str, spec: dict, seed: int, source: str):
        self.name, self.spec, self.seed, self.source = name, spec, seed, source
        self.loc = ("data", "source") if name == "main" else ("data", "tasks", name, "source")
        self.fields = (spec.get("prompt_field", "prompt"), spec.get("answer_field", "answer"))
        self.holdout = spec.get("holdout")  # share of rows held out for evaluation (runtime/evaluation.py)
        self.epoch, self.in_epoch, self._rows = 0, 0, None
        self._first: list | None = []  # the first epoch's rows while there are at most CACHE_ROWS
        self._cached: list | None = None
        src = spec["source"]
        if not src.startswith("builtin:") and not Path(src).exists():
            self.fail(f"no such data file '{src}'", "missing-file", "check the path, then re-run rlflow compile")

    def fail(self, message: str, rule: str, fix: str):
        raise PipelineInvalid(self.source, [Problem(self.loc, f"task '{self.name}': {message}", rule, fix)])

    def check_head(self) -> None:
        """The file's first rows (data_head.py): a bad one fails the run before it starts an actor."""
        problem = None if self.spec["source"].startswith("builtin:") else head_problem(self.spec["source"], self.fields)
        if problem:
            self.fail(*problem)

    def _dataset(self):
        src, limit = self.spec["source"], self.spec.get("limit")
        with _stream_context():
            if src.startswith("builtin:"):
                rows = registry.resolve("task", src)(seed=self.seed, count=limit or BUILTIN_TASK_ROWS)
                ds = ray.data.from_items(rows)
            elif Path(src).suffix == ".parquet":
                ds = ray.data.read_parquet(src, label_selector=on_this_node())
            else:
                ds = ray.data.read_json(src, label_selector=on_this_node())
            return ds.limit(limit) if limit else ds

    def _open(self):
        if self._cached is not None:
            rows = list(self._cached)
            random.Random(self.seed + self.epoch).shuffle(rows)
            yield from rows
            return
        batches = iter(self._dataset().iter_batches(batch_size=BATCH_ROWS, batch_format="pyarrow", prefetch_batches=1,
                                                    local_shuffle_buffer_size=SHUFFLE_WINDOW,
                                                    local_shuffle_seed=self.seed + self.epoch))
        try:
            for batch in batches:
                yield from batch.to_pylist()
        finally:
            batches.close()  # ends this epoch's Ray Data execution (also when the source is closed early)

    def next_row(self) -> dict:
        """The next row (original columns), starting a new epoch when this one is used up."""
        while True:
            if self._rows is None:
                self._rows = self._open()
            try:
                row = next(self._rows, None)
            except ray.exceptions.RayTaskError as e:  # raised by the read: the file's content is the problem
                self._rows, cause = None, getattr(e, "cause", None) or e
                self.fail(f"cannot read '{self.spec['source']}': {type(cause).__name__}: "
                          f"{(str(cause).splitlines() or [''])[0][:200]}", "bad-data", READ_FIX)
            if row is not None:
                if self.in_epoch == 0:
                    self._check_columns(row)
                self._check_row(row)
                if self.holdout and held_out(str(row[self.fields[0]]), self.holdout):
                    continue  # an evaluation row: never trained on
                self.in_epoch += 1
                if self._first is not None:
                    self._first.append(row)
                    self._first = self._first if len(self._first) <= CACHE_ROWS else None
                return row
            self._rows = None
            if self.in_epoch == 0:
                self.fail(*no_rows_problem(self.spec["source"]))
            self._cached, self._first = self._cached or self._first, None
            self.epoch, self.in_epoch = self.epoch + 1, 0

    def _check_columns(self, row: dict) -> None:
        problem = column_problem(self.spec["source"], self.fields, row)
        if problem:
            self.fail(*problem)

    def _check_row(self, row: dict) -> None:
        """Every row needs a prompt and an answer: a missing or null one would be trained on as the text
        'None' (missing-prompt / missing-answer, naming the row)."""
        for field, what in zip(self.fields, ("prompt", "answer")):
            if missing(row.get(field)):
                self.fail(*missing_problem(self._where_missing(field), field, what))

    def _where_missing(self, field: str) -> str:
        """Where the file first lacks `field`: "'p.jsonl' line 7" (rows are drawn shuffled, so the row drawn is
        found again by reading the file; only on this error path). Falls back to the draw's position."""
        src = self.spec["source"]
        found = None if src.startswith("builtin:") else first_missing(src, field)
        return found or f"row {self.in_epoch + 1} drawn from '{src}' (rows are drawn shuffled)"

    def close(self) -> None:
        if self._rows is not None:
            self._rows.close()  # closes iter_batches: Ray Data shuts this stream's execution down
            self._rows = None


def check_sources(tasks: dict[str, dict], source: str) -> None:
    """Every task's prompt file exists and its first rows are usable: `rlflow run` checks this before anything
    starts (compile checked it too, but the file may have changed since)."""
    for name, spec in tasks.items():
        _TaskRows(name, spec, 0, source).check_head()


class PromptSource:
    """The next prompt for a set of tasks, as {"task", "n", "prompt", "answer", "prompt_ids", "row"}."""

    def __init__(self, tasks: dict[str, dict], tokenizer, *, max_new_tokens: dict[str, int], max_model_len: int,
                 seed: int, source: str, skip: dict[str, int] | None = None):
        quiet_ray_data()  # the run prints its own progress
        self.tokenizer, self.max_new_tokens, self.max_model_len = tokenizer, max_new_tokens, max_model_len
        self.weights = {name: float(spec.get("weight", 1.0)) for name, spec in tasks.items()}
        self.streams = {name: _TaskRows(name, spec, seed, source) for name, spec in tasks.items()}
        self.drawn = {name: 0 for name in tasks}
        self.to_skip = {name: int(n) for name, n in (skip or {}).items() if name in tasks}
        self.drawn.update(self.to_skip)
        self.current = wrr_state(self.weights, self.drawn)

    def next(self, tasks: list[str]) -> dict:
        """The next prompt of one of `tasks`, chosen by their weights."""
        task = wrr_pick(self.current, self.weights, list(tasks))
        stream = self.streams[task]
        for _ in range(self.to_skip.pop(task, 0)):  # resume: rows drawn before the checkpoint
            stream.next_row()
        row = stream.next_row()
        n = self.drawn[task]
        self.drawn[task] += 1
        prompt_field, answer_field = stream.fields
        prompt, answer = str(row[prompt_field]), str(row[answer_field])
        fmt = stream.spec.get("prompt_format") or "raw"
        try:
            ids = encode_prompt(self.tokenizer, prompt, fmt, stream.spec.get("system_prompt"))
        except ValueError as err:  # the model directory changed since compile (which checks for a chat template)
            stream.fail(f"cannot format prompt {n} as chat: {err}", "no-chat-template",
                        "use prompt_format: raw, or a model whose tokenizer has a chat template")
        budget = self.max_new_tokens[task]
        if len(ids) + budget > self.max_model_len:
            stream.fail(f"prompt {n} ({prompt[:40]!r}) has {len(ids)} tokens; with max_new_tokens {budget} that "
                        f"exceeds model.max_model_len {self.max_model_len}", "prompt-too-long",
                        "raise model.max_model_len, lower max_new_tokens, or shorten the prompts")
        return {"task": task, "n": n, "prompt": prompt, "answer": answer, "prompt_ids": ids, "row": _plain(row)}

    def position(self) -> dict[str, int]:
        """Rows drawn per task so far (a resumed source counts the skipped rows): pass as `skip` to resume."""
        return dict(self.drawn)

    def close(self) -> None:
        for stream in self.streams.values():
            stream.close()
