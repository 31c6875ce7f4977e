"""Compile checks of train.distill (stages/distill.py): the teacher is a model here, and it scores the student's
tokens, so it must read them with the same vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

from rlflow.errors import Problem


def check_teacher(spec, teacher: str, loc: tuple, base_dir: Path, problems: list[Problem], resolve) -> None:
    """`bad-teacher` where the teacher is not a local model directory, `teacher-vocab-differs` where its vocabulary
    size is not the student's (known at compile for a local student; builtin students are built at run time)."""
    path = resolve(teacher, base_dir)
    if path is None or not (path / "config.json").is_file():
        problems.append(Problem(loc, f"'{teacher}' is not a local Hugging Face model directory (no config.json)",
                                "bad-teacher", "give the directory of a causal LM saved with save_pretrained (an "
                                "exported rlflow run: rlflow export RUN -o DIR)"))
        return
    student = None if spec.model.path.startswith("builtin:") else resolve(spec.model.path, base_dir)
    if student is None or not (student / "config.json").is_file():
        return
    theirs, ours = (_vocab(p / "config.json") for p in (path, student))
    if theirs is not None and ours is not None and theirs != ours:
        problems.append(Problem(loc, f"the teacher's vocabulary has {theirs} tokens and the student's {ours}: the "
                                "teacher could not score the student's tokens", "teacher-vocab-differs",
                                "distill from a teacher of the student's tokenizer (the same model family)"))


def _vocab(config: Path) -> int | None:
    try:
        return int(json.loads(config.read_text()).get("vocab_size"))
    except (OSError, ValueError, TypeError):
        return None
