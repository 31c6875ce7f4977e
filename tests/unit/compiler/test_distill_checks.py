"""train.distill's compile checks (rlflow/distill_checks.py) and its plan entry."""

from __future__ import annotations

import json
from types import SimpleNamespace

from rlflow.component_checks import resolve_path
from rlflow.distill_checks import check_teacher


def _model(directory, vocab: int):
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"vocab_size": vocab}))
    return directory


def test_a_teacher_of_another_vocabulary_is_refused(tmp_path):
    spec = SimpleNamespace(model=SimpleNamespace(path="student"))
    _model(tmp_path / "student", 512)
    loc = ("stages", "train", "distill", "teacher")
    problems = []
    check_teacher(spec, str(_model(tmp_path / "same", 512)), loc, tmp_path, problems, resolve_path)
    assert problems == []
    check_teacher(spec, str(_model(tmp_path / "other", 32000)), loc, tmp_path, problems, resolve_path)
    [p] = problems
    assert p.rule == "teacher-vocab-differs" and "32000 tokens and the student's 512" in p.message


def test_the_plan_carries_the_teacher_resolved_beside_the_pipeline(tmp_path):
    from pathlib import Path

    from rlflow.compiler import compile_pipeline

    repo = Path(__file__).resolve().parents[3]
    _model(tmp_path / "teacher", 512)
    text = (repo / "tests" / "compile" / "invalid" / "distill_bad_teacher.yaml").read_text()
    (tmp_path / "p.yaml").write_text(text.replace("no/such/teacher", "teacher"))
    plan = compile_pipeline(tmp_path / "p.yaml")
    [trainer] = [a for a in plan["actors"] if a["role"] == "trainer"]
    assert trainer["trainer_kwargs"]["distill"] == {"teacher": str((tmp_path / "teacher").resolve()), "coef": 1.0,
                                                    "reward_weight": 1.0}
