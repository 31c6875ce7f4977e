"""Prompts as lazy Ray Data streams, one per task, drawn by smooth weighted round-robin over the tasks' weights.

Each task is a Ray Data dataset (a built-in task's rows, or a .jsonl/.json/.parquet file) iterated with
iter_batches: nothing is pulled whole into the driver, which holds at most a shuffle window and a few batches. A
`datasets` directory or an Arrow file is memory-mapped in the driver and read a batch at a time, the same windowed
shuffle applied here (the table stays in the page cache, not the object store).
Files are read on the driver's node (`on_this_node`), so on a cluster they need to exist only there.
Order is deterministic for a seed (resume re-creates the streams and skips rows); when a task's rows run out
a new epoch re-reads them (or reshuffles them in memory when small), reshuffled with seed + epoch.
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Callable
from pathlib import Path

import ray
from ray.data import DataContext

from rlflow import registry
from rlflow.data_head import READ_FIX, column_problem, first_bad, first_row, head_problem, head_rows, no_rows_problem
from rlflow.data_sources import TableProblem, generated, is_table, read_table
from rlflow.errors import PipelineInvalid, Problem, RunFailed, format_loc
from rlflow.prompt_rows import (
    BUILTIN_TASK_ROWS,
    encode_prompt,
    held_out,
    plain,
    prompt_text,
    row_problem_as,
    row_prompt_answer,
)
from rlflow.runtime.messages import Prompt
from rlflow.runtime.ray_data_quiet import quiet_ray_data

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


def window_shuffled(rows, window: int, rng: random.Random):
    """`rows` in a windowed shuffle: each comes out of a buffer of up to `window` rows refilled in order, chosen by
    `rng` (deterministic for its seed), as Ray Data's local shuffle buffer does for the other sources."""
    buffer: list = []
    for row in rows:
        buffer.append(row)
        if len(buffer) >= window:
            i = rng.randrange(len(buffer))
            buffer[i], buffer[-1] = buffer[-1], buffer[i]
            yield buffer.pop()
    rng.shuffle(buffer)
    yield from buffer


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


class BadRow(RunFailed):
    """A row drawn during the run is unusable (past the head that compile and run start check, or the file changed
    since): the run stops with exit 3 and a checkpoint, naming the task, the file's line and the rule, as the head
    check names a bad row in the head (data_head.py). Stopping, not skipping: a row skipped silently is a prompt
    the user believes was trained on."""

    def __init__(self, loc: tuple, message: str, rule: str, fix: str):
        self.problem = Problem(loc, message, rule, fix)
        super().__init__(f"{format_loc(loc)}: {message} [{rule}]; {fix}, then `rlflow run --resume` continues from "
                         "the last checkpoint")

    def __reduce__(self):
        return (type(self), (self.problem.loc, self.problem.message, self.problem.rule, self.problem.fix))


class _TaskRows:
    """One task's rows, in epochs: a lazy dataset, iterated a batch at a time."""

    def __init__(self, name: str, spec: dict, seed: int, source: str):
        self.name, self.spec, self.seed, self.source = name, spec, seed, source
        self.loc = ("data", "source") if name == "main" else ("data", "tasks", name, "source")
        self.fields = (spec.get("prompt_field", "prompt"), spec.get("answer_field", "answer"))
        self.holdout = spec.get("holdout")  # share of rows held out for evaluation (runtime/evaluation.py)
        self.split, self.fmt = spec.get("split"), spec.get("prompt_format") or "raw"  # data_sources.py; prompt_rows.py
        self.epoch, self.in_epoch, self._rows = 0, 0, None
        self._first: list | None = []  # the first epoch's rows while there are at most CACHE_ROWS
        self._cached: list | None = None
        self._table = None  # a table source's memory-mapped pyarrow Table, read once (_table_rows)
        src = spec["source"]
        if not generated(src) and not Path(src).exists():
            self.fail(f"no such data file '{src}'", "missing-file", "check the path, then re-run rlflow compile")

    def fail(self, message: str, rule: str, fix: str):
        """Invalid input found before the run starts (exit 2)."""
        raise PipelineInvalid(self.source, [Problem(self.loc, f"task '{self.name}': {message}", rule, fix)])

    def stop(self, message: str, rule: str, fix: str):
        """A bad row drawn during the run (exit 3, with a checkpoint)."""
        raise BadRow(self.loc, f"task '{self.name}': {message}", rule, fix)

    def check_head(self) -> None:
        """The file's first rows (data_head.py): a bad one fails the run before it starts an actor."""
        problem = None if generated(self.spec["source"]) else head_problem(
            self.spec["source"], self.fields, split=self.split, prompt_format=self.fmt)
        if problem:
            self.fail(*problem)

    def _dataset(self):
        src, limit = self.spec["source"], self.spec.get("limit")
        with _stream_context():
            if generated(src):  # builtin:<task>, or a taskset through an adapter (verifiers:...)
                rows = registry.resolve("task", src)(seed=self.seed, count=limit or BUILTIN_TASK_ROWS)
                ds = ray.data.from_items(rows)
            elif Path(src).suffix == ".parquet":
                ds = ray.data.read_parquet(src, label_selector=on_this_node())
            elif _is_json_array(src):
                ds = ray.data.read_json(src, label_selector=on_this_node())
            else:  # JSON lines: each line as text, parsed here, so a bad one is named by its line (not a Ray traceback)
                ds = ray.data.read_text(src, label_selector=on_this_node())
            return ds.limit(limit) if limit else ds

    def _open(self):
        if self._cached is not None:
            rows = list(self._cached)
            random.Random(self.seed + self.epoch).shuffle(rows)
            yield from rows
            return
        if is_table(self.spec["source"]):
            yield from self._table_rows()
            return
        batches = iter(self._dataset().iter_batches(batch_size=BATCH_ROWS, batch_format="pyarrow", prefetch_batches=1,
                                                    local_shuffle_buffer_size=SHUFFLE_WINDOW,
                                                    local_shuffle_seed=self.seed + self.epoch))
        lines = not generated(self.spec["source"]) and Path(self.spec["source"]).suffix != ".parquet" \
            and not is_table(self.spec["source"]) and not _is_json_array(self.spec["source"])
        try:
            for batch in batches:
                yield from (map(self._parse, batch.column("text").to_pylist()) if lines else batch.to_pylist())
        finally:
            batches.close()  # ends this epoch's Ray Data execution (also when the source is closed early)

    def _table_rows(self):
        """A `datasets` directory's or an Arrow file's rows, read from the memory-mapped table in this process (not
        through Ray Data: `from_arrow` would copy the whole table into the object store, each epoch), shuffled in a
        window of SHUFFLE_WINDOW rows as the streams are (seed + epoch)."""
        if self._table is None:
            try:
                table = read_table(self.spec["source"], self.split)
            except TableProblem as err:  # changed since the head check
                self.stop(*err.problem)
            limit = self.spec.get("limit")
            self._table = table.slice(0, limit) if limit else table
        rows = (row for batch in self._table.to_batches(max_chunksize=BATCH_ROWS) for row in batch.to_pylist())
        yield from window_shuffled(rows, SHUFFLE_WINDOW, random.Random(self.seed + self.epoch))

    def next_row(self) -> dict:
        """The next row (original columns), starting a new epoch when this one is used up."""
        while True:
            if self._rows is None:
                self._rows = self._open()
            try:
                row = next(self._rows, None)
            except ray.exceptions.RayTaskError as e:  # raised by a Parquet or JSON-array read: the file's content
                self._rows, cause = None, getattr(e, "cause", None) or e
                self.stop(f"cannot read '{self.spec['source']}': {type(cause).__name__}: "
                          f"{(str(cause).splitlines() or [''])[0][:200]}", "bad-data", READ_FIX)
            if row is not None:
                if self.in_epoch == 0 and (Path(self.spec["source"]).suffix == ".parquet" or is_table(self.spec["source"])):
                    self._check_columns(row)  # one schema for the file (a JSON line's missing key is its own row's)
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
                self.stop(*no_rows_problem(self.spec["source"]))
            self._cached, self._first = self._cached or self._first, None
            self.epoch, self.in_epoch = self.epoch + 1, 0

    def _parse(self, text: str) -> dict:
        """A JSON line as a row; a line that is not a JSON object stops the run, naming its line."""
        try:
            row = json.loads(text)
        except ValueError as err:
            row = err
        if isinstance(row, dict):
            return row
        what = f"not JSON ({row})" if isinstance(row, Exception) else f"a {type(row).__name__}, not a JSON object"
        where = self.where(lambda r: not isinstance(r, dict) and str(r) == str(row), "bad-data")
        self.stop(f"cannot read {where}: {what}", "bad-data", READ_FIX)

    def _check_columns(self, row: dict) -> None:
        problem = column_problem(self.spec["source"], self.fields, row)
        if problem:
            self.stop(*problem)

    def _check_row(self, row: dict) -> None:
        """Every row needs a prompt and an answer with text (prompt_rows.row_problem: missing-*, *-not-text, empty-*):
        the run stops naming the row's line, as the head check does."""
        problem = row_problem_as(row, self.fields, "", self.fmt)
        if problem:
            where = self.where(lambda r: isinstance(r, dict) and all(r.get(f) == row.get(f) for f in self.fields),
                               problem[1])
            self.stop(*row_problem_as(row, self.fields, where, self.fmt))

    def where(self, same, rule: str) -> str:
        """Where the file holds this row: "'p.jsonl' line 7" (rows are drawn shuffled, so it is found again by
        reading the file, only on an error path): the first row `same` picks, else the first that breaks `rule`;
        else the draw's position."""
        src = self.spec["source"]
        if not generated(src):
            found = first_row(src, same, self.fields, split=self.split) or first_bad(
                src, self.fields, rule, split=self.split, prompt_format=self.fmt)
            if found:
                return found
        return f"row {self.in_epoch + 1} drawn from '{src}' (rows are drawn shuffled)"

    def close(self) -> None:
        if self._rows is not None:
            self._rows.close()  # closes iter_batches: Ray Data shuts this stream's execution down
            self._rows = None


def _is_json_array(src: str) -> bool:
    """A .json file that holds one JSON array (read whole by Ray Data), not JSON lines."""
    if Path(src).suffix != ".json":
        return False
    with open(src, encoding="utf-8", errors="replace") as f:
        return f.read(4096).lstrip().startswith("[")


def check_sources(tasks: dict[str, dict], source: str) -> None:
    """Every task's prompt file exists and its first rows are usable: `rlflow run` checks this before anything
    starts (compile checked it too, but the file may have changed since)."""
    for name, spec in tasks.items():
        _TaskRows(name, spec, 0, source).check_head()


def too_long(where: str, prompt: str, n_tokens: int, budget: int, max_model_len: int,
             chat_form: bool = False) -> tuple[str, str, str]:
    """(message, rule, fix) for a prompt that leaves no room for its completion (`chat_form`: measured as a stage with
    tools renders it, the tools block included)."""
    has = "renders in chat form, with the stage's tools, to" if chat_form else "has"
    return (f"the prompt at {where} ({prompt[:40]!r}) {has} {n_tokens} tokens; with max_new_tokens {budget} that "
            f"exceeds model.max_model_len {max_model_len}", "prompt-too-long",
            "raise model.max_model_len, lower max_new_tokens, " + ("shorten the prompts or offer fewer tools"
                                                                   if chat_form else "or shorten the prompts"))


def check_prompt_lengths(tasks: dict[str, dict], tokenizer, *, max_new_tokens: dict[str, int], max_model_len: int,
                         source: str, measure: dict[str, Callable[[str], int]] | None = None) -> None:
    """Every prompt in each file's head fits model.max_model_len with its task's max_new_tokens: `rlflow run` checks
    this once the model's tokenizer is at hand and before any actor starts (a row past the head is checked when
    drawn). Exit 2 naming the file's line. `measure`: tasks whose rollout stage renders the prompt itself (a stage
    with tools: runtime/chat_episodes.py prompt_measures) -> the rendered prompt's length."""
    measure = measure or {}
    for name, spec in tasks.items():
        if generated(spec["source"]):  # checked as drawn
            continue
        task = _TaskRows(name, spec, 0, source)
        fmt, budget = spec.get("prompt_format") or "raw", max_new_tokens[name]
        for where, row in head_rows(spec["source"], task.fields, split=task.split, prompt_format=task.fmt):
            prompt = row_prompt_answer(row, task.fields, task.fmt)[0]
            try:
                ids = encode_prompt(tokenizer, prompt, fmt, spec.get("system_prompt"))
            except ValueError as err:
                task.fail(f"cannot format the prompt at {where} as chat: {err}", "no-chat-template",
                          "use prompt_format: raw, or a model whose tokenizer has a chat template")
            n = measure[name](prompt_text(prompt)) if name in measure else len(ids)
            if n + budget > max_model_len:
                task.fail(*too_long(where, prompt_text(prompt), n, budget, max_model_len, name in measure))


class PromptSource:
    """The next prompt (messages.Prompt) for a set of tasks."""

    def __init__(self, tasks: dict[str, dict], tokenizer, *, max_new_tokens: dict[str, int], max_model_len: int,
                 seed: int, source: str, skip: dict[str, int] | None = None,
                 measure: dict[str, Callable[[str], int]] | None = None):
        quiet_ray_data()  # the run prints its own progress
        self.measure = dict(measure or {})  # as check_prompt_lengths: prompts a chat-form stage renders itself
        self.tokenizer, self.max_new_tokens, self.max_model_len = tokenizer, max_new_tokens, max_model_len
        self.weights = {name: float(spec.get("weight", 1.0)) for name, spec in tasks.items()}
        self.streams = {name: _TaskRows(name, spec, seed, source) for name, spec in tasks.items()}
        self.drawn = {name: 0 for name in tasks}
        self.to_skip = {name: int(n) for name, n in (skip or {}).items() if name in tasks}
        self.drawn.update(self.to_skip)
        self.current = wrr_state(self.weights, self.drawn)

    def next(self, tasks: list[str]) -> Prompt:
        """The next prompt of one of `tasks`, chosen by their weights."""
        task = wrr_pick(self.current, self.weights, list(tasks))
        stream = self.streams[task]
        for _ in range(self.to_skip.pop(task, 0)):  # resume: rows drawn before the checkpoint
            stream.next_row()
        row = stream.next_row()
        n = self.drawn[task]
        self.drawn[task] += 1
        prompt_field = stream.fields[0]
        prompt, answer = row_prompt_answer(row, stream.fields, stream.fmt)
        fmt = stream.fmt
        try:
            ids = encode_prompt(self.tokenizer, prompt, fmt, stream.spec.get("system_prompt"))
        except ValueError as err:  # the model directory changed since compile (which checks for a chat template)
            stream.stop(f"cannot format prompt {n} as chat: {err}", "no-chat-template",
                        "use prompt_format: raw, or a model whose tokenizer has a chat template")
        budget = self.max_new_tokens[task]
        n_tokens = self.measure[task](prompt_text(prompt)) if task in self.measure else len(ids)
        if n_tokens + budget > self.max_model_len:
            where = stream.where(lambda r: isinstance(r, dict) and r.get(prompt_field) == row[prompt_field], "prompt-too-long")
            stream.stop(*too_long(where, prompt_text(prompt), n_tokens, budget, self.max_model_len, task in self.measure))
        return Prompt(task, n, prompt_text(prompt), answer, ids, plain(row))

    def position(self) -> dict[str, int]:
        """Rows drawn per task so far (a resumed source counts the skipped rows): pass as `skip` to resume."""
        return dict(self.drawn)

    def close(self) -> None:
        for stream in self.streams.values():
            stream.close()
