"""The policy model directory a run starts from: a built-in model built locally, or a local HF directory (a Hub
id is one too: compile resolved it to its snapshot in the local Hub cache, rlflow/hub.py, and the plan names that).

A local directory is checked again when the run starts (`check_model_dir`): it was there at compile, but it
may have been moved or deleted since, or it may hold a config but no weights. Either is invalid input (exit 2
naming model.path) found before any actor starts, not an engine's traceback a minute in.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlflow import registry
from rlflow.errors import PipelineInvalid, Problem
from rlflow.plan_model import Plan

#: single-file weights `from_pretrained` loads, and the index files of sharded ones
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "consolidated.safetensors")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
#: files a Hugging Face tokenizer is loaded from (any one of them)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
FIX = "restore it, or point model.path at a directory saved with save_pretrained (weights, config and tokenizer), then re-run rlflow compile"


def check_model_dir(path: str | Path, *, source: str) -> Path:
    """`path` if it is a local Hugging Face model directory: config.json (a JSON object), the weights it names
    and a tokenizer; else PipelineInvalid at model.path (rule bad-model-path) saying what is missing (and, for a
    snapshot in the Hub cache that a Hub id resolved to at compile, the command that fetches it again)."""
    path = Path(path)
    from rlflow.hub import refetch_hint

    fix = refetch_hint(path) or FIX  # a snapshot of the Hub cache (a Hub id, resolved at compile): fetch it again

    def bad(message: str):
        raise PipelineInvalid(source, [Problem(("model", "path"), message, "bad-model-path", fix)])

    if not path.exists():
        bad(f"model directory '{path}' no longer exists (it did when the plan was compiled)")
    if not path.is_dir():
        bad(f"'{path}' is not a directory (a Hugging Face model is a directory)")
    config = path / "config.json"
    if not config.is_file():
        bad(f"'{path}' is not a Hugging Face model directory: it has no config.json")
    try:
        parsed = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        bad(f"'{config}' is not valid JSON ({err})")
    if not isinstance(parsed, dict) or "model_type" not in parsed:
        bad(f"'{config}' is not a Hugging Face model config (no \"model_type\")")
    weights = [f for f in WEIGHT_FILES if (path / f).is_file()]
    index = next((path / f for f in WEIGHT_INDEXES if (path / f).is_file()), None)
    if index is not None and not weights:
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
            bad(f"'{index}' is not a valid weight index ({type(err).__name__}: {err})")
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            bad(f"'{path}' lacks {len(missing)} of the {len(shards)} weight shards '{index.name}' names "
                f"(first: {missing[0]})")
        weights = shards
    if not weights:
        bad(f"'{path}' has no model weights (none of {', '.join(WEIGHT_FILES + WEIGHT_INDEXES)})")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        bad(f"'{path}' has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    return path


def prepare_model(plan: Plan, log=print) -> Path:
    """Local Hugging Face directory for plan's model (builds and caches builtin:tiny-llama on first use). The tiny
    model is warm-started on what the plan trains on (warm_start_of): its built-in tasks, or the training rows of
    its task files. A local directory is checked first (check_model_dir): PipelineInvalid naming model.path if it
    vanished or is not a model."""
    spec = plan.model
    if spec["path"].startswith("builtin:"):
        build = registry.resolve("model", spec["path"])
        if spec["path"] != "builtin:tiny-llama":
            return Path(build(progress=log))
        task, rows = warm_start_of(plan)
        if rows is not None:
            log(f"tiny-llama: warm start on {len(rows)} training rows of {task}")
            return Path(build(task="data", rows=rows, seed=plan.pipeline["seed"], progress=log))
        if task == "calc" and any(s.get("tools") or s.get("agent") for s in plan.pipeline["stages"].values()):
            # chat-form tools on the calculator task: the text-form build, warm-started further in chat form
            from rlflow.stages.tiny_tool_model import build_tiny_tool_llama

            return build_tiny_tool_llama(task, seed=plan.pipeline["seed"], progress=log)
        return Path(build(task=task, seed=plan.pipeline["seed"], progress=log))
    return check_model_dir(spec["path"], source=plan.source)


#: rows read from each task file for a warm start of builtin:tiny-llama (its 80 steps x 64 see about 5,000)
WARM_START_ROWS = 4096


def warm_start_of(plan: Plan) -> tuple[str, list[dict] | None]:
    """What builtin:tiny-llama is warm-started on: ("arith+repeat", None) for built-in tasks, or (a description,
    rows) when the plan reads task files: their training rows ({"prompt", "answer"}; held-out rows skipped, each
    task's limit kept), interleaved with rows of the built-in tasks beside them (rlflow compile says which:
    compiler.model_note)."""
    from rlflow.prompt_rows import held_out, row_problem
    from rlflow.runtime.evaluation import bad_row, read_file
    from rlflow.stages.tiny_model import task_rows

    builtin = sorted({t.source.removeprefix("builtin:") for t in plan.tasks.values() if t.source.startswith("builtin:")})
    files = {name: t for name, t in plan.tasks.items() if not t.source.startswith("builtin:")}
    if not files:
        return "+".join(builtin), None
    parts = []
    for t in files.values():
        rows = []
        for n, (where, row) in enumerate(read_file(t.source, ("data", "source"), "", split=t.split)):
            if (t.limit and n >= t.limit) or len(rows) >= WARM_START_ROWS:
                break
            if problem := row_problem(row, (t.prompt_field, t.answer_field), where):  # as training's reader judges it
                bad_row(problem, t.source, ("data", "source"), "")
            prompt = str(row[t.prompt_field])
            if not (t.holdout and held_out(prompt, t.holdout)):
                demo = {"demo": row["demo"]} if isinstance(row.get("demo"), str) else {}  # a tool-using transcript
                rows.append({"prompt": prompt, "answer": str(row[t.answer_field]), **demo})
        parts.append(rows)
    parts += [task_rows(name, plan.pipeline["seed"], WARM_START_ROWS) for name in builtin]
    mixed = [row for group in zip(*parts) for row in group] if len(parts) > 1 else parts[0]
    what = ", ".join(t.source for t in files.values()) + (f" and builtin:{'+'.join(builtin)}" if builtin else "")
    if not mixed:
        raise ValueError(f"no training rows in {what} to warm builtin:tiny-llama start on")
    return what, mixed
