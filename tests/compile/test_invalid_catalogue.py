"""Every pipeline in tests/compile/invalid/ must fail with exit 2, no traceback, and exactly the
problems its header announces (`# expect: <text>` lines; `# expect-errors: N` when the count differs).
A `# gpus: N` line checks it for a cluster of N GPUs (`--gpus N`), whatever this machine has."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlflow.cli import main

CATALOGUE = sorted((Path(__file__).parent / "invalid").glob("*.yaml"))
PROBLEM_LINE = re.compile(r"^  \S.*: .+ \[[a-z-]+\]$")


def expectations(path: Path) -> tuple[list[str], int]:
    lines = path.read_text().splitlines()
    expects = [ln.removeprefix("# expect: ") for ln in lines if ln.startswith("# expect: ")]
    counts = [int(ln.split(":")[1]) for ln in lines if ln.startswith("# expect-errors:")]
    return expects, counts[0] if counts else len(expects)


def gpus(path: Path) -> list[str]:
    given = [ln.removeprefix("# gpus: ") for ln in path.read_text().splitlines() if ln.startswith("# gpus: ")]
    return ["--gpus", given[0]] if given else []


def test_catalogue_is_large_enough():
    assert len(CATALOGUE) >= 40


@pytest.mark.parametrize("path", CATALOGUE, ids=lambda p: p.stem)
def test_invalid_pipeline_reports_each_problem(path, capsys):
    expects, count = expectations(path)
    assert expects, f"{path.name} has no '# expect:' line"
    rc = main(["validate", str(path), *gpus(path)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    head, *problems = err.rstrip("\n").splitlines()
    assert head == f"{path}: {count} error{'s' if count != 1 else ''}"
    assert len(problems) == count, err
    for line in problems:
        assert PROBLEM_LINE.match(line), f"not '  path: message [rule]': {line!r}"
    for text in expects:
        assert text in err, f"expected {text!r} in:\n{err}"


def test_compile_also_rejects_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["compile", str(CATALOGUE[0]), "-o", str(out)])
    assert rc == 2
    assert not out.exists()


def test_invalid_pipeline_exits_2_without_traceback_from_the_console_script(tmp_path):
    bad = Path(__file__).parent / "invalid" / "cycle.yaml"
    proc = subprocess.run([sys.executable, "-m", "rlflow.cli", "compile", str(bad), "-o", str(tmp_path / "p.json")],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "cycle rollout -> score -> rollout" in proc.stderr
