"""The wheel ships rlflow, rlflow.stages and rlflow.operators, and `rlflow --help` works from it."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_every_package_directory_is_listed_in_pyproject():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    mapping = config["package-dir"]
    found = set()
    for package, folder in mapping.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            found.add(".".join([package, *rel.parts]))
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(REPO)],
                   check=True, capture_output=True)
    return next(out.glob("rlflow-*.whl"))


def test_wheel_contains_stages_and_operators_inside_rlflow(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "rlflow/cli.py" in names
    assert "rlflow/operators/policy.py" in names
    assert "rlflow/stages/rewards.py" in names
    assert not any(n.startswith(("stages/", "operators/", "tests/")) for n in names)


def test_rlflow_help_runs_from_the_installed_wheel(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    # system site packages give the wheel its dependencies; the wheel's own rlflow shadows the editable one
    venv.create(env_dir, with_pip=True, system_site_packages=True)
    py = env_dir / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--quiet", str(wheel)], check=True, capture_output=True)
    proc = subprocess.run([str(env_dir / "bin" / "rlflow"), "--help"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "compile" in proc.stdout and "simulate" in proc.stdout
    where = subprocess.run([str(py), "-c", "import rlflow.operators.policy as p; print(p.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, check=True).stdout
    assert str(env_dir) in where
