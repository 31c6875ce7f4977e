"""The rlflow command: schema, overrides, run before the runtime, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlflow.cli import main

REPO = Path(__file__).resolve().parents[3]
QUICKSTART = REPO / "pipelines" / "quickstart.yaml"


def test_schema_is_json_schema_with_every_field_documented(capsys):
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["title"] == "Pipeline"
    undocumented = []
    for name, model in {"Pipeline": schema, **schema["$defs"]}.items():
        for field, prop in model.get("properties", {}).items():
            if field != "kind" and not prop.get("description"):
                undocumented.append(f"{name}.{field}")
    assert undocumented == []
    assert {"StalenessBound", "WeightSync", "SkewAwareDispatch", "InFlightLimit"} <= set(schema["$defs"])


def test_set_override_changes_the_plan(tmp_path):
    out = tmp_path / "plan.json"
    assert main(["compile", str(QUICKSTART), "-o", str(out), "--set", "stages.train.lr=3e-4",
                 "--set", "edges.3.policy.eta=3"]) == 0
    plan = json.loads(out.read_text())
    assert plan["pipeline"]["stages"]["train"]["lr"] == 3e-4
    assert plan["control"]["staleness"]["eta"] == 3
    assert plan["overrides"] == ["stages.train.lr=3e-4", "edges.3.policy.eta=3"]


def test_bad_override_value_is_a_validation_error(capsys):
    assert main(["validate", str(QUICKSTART), "--set", "stages.buffer.batch_groups=lots"]) == 2
    assert "'batch_groups' must be an integer, got 'lots'" in capsys.readouterr().err


@pytest.mark.parametrize("override, message", [
    ("stages.train.lr", "is not dotted.key=value"),
    ("edges.9.policy.eta=1", "index 9 is out of range"),
    ("name.first=1", "'name' is not a mapping or list"),
])
def test_malformed_override_exits_2(override, message, capsys):
    assert main(["validate", str(QUICKSTART), "--set", override]) == 2
    assert message in capsys.readouterr().err


def test_override_of_unknown_field_is_caught(capsys):
    assert main(["validate", str(QUICKSTART), "--set", "stages.train.learning_rate=1e-5"]) == 2
    assert "unknown field 'learning_rate'" in capsys.readouterr().err


def test_run_without_a_plan_says_what_to_do(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["run"]) == 2
    assert "run `rlflow compile PIPELINE` first" in capsys.readouterr().err


def test_missing_pipeline_file(capsys):
    assert main(["validate", "no/such/pipeline.yaml"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_internal_error_exits_1_with_traceback(monkeypatch, capsys):
    import rlflow.compiler

    def boom(*a, **k):
        raise ZeroDivisionError("bug")

    monkeypatch.setattr(rlflow.compiler, "check_pipeline", boom)
    assert main(["validate", str(QUICKSTART)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError" in err


def test_schema_import_pulls_no_heavy_dependency():
    code = ("import sys, rlflow.schema, rlflow.compiler, rlflow.cli; "
            "print(','.join(m for m in ('torch', 'ray', 'vllm', 'deepspeed', 'transformers') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == ""
