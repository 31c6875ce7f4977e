"""The wheel ships rlflow, rlflow.stages, rlflow.operators and the default configs, and works from an install:
`rlflow --help`, and `rlflow compile` of a pipeline outside the repository that uses the default DeepSpeed config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

from rlflow.component_checks import SHIPPED_CONFIGS, resolve_path

REPO = Path(__file__).resolve().parents[3]


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


def test_wheel_ships_every_config_of_the_repo_unchanged(wheel):
    shipped = zipfile.ZipFile(wheel)
    files = [f for f in (REPO / "configs").rglob("*") if f.is_file()]
    assert any(f.name == "zero1.json" for f in files)
    for f in files:
        assert shipped.read(f"rlflow/{f.relative_to(REPO).as_posix()}") == f.read_bytes(), f


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A virtualenv with the wheel installed; system site packages give it its dependencies, and the wheel's own
    rlflow shadows the editable one."""
    env_dir = tmp_path_factory.mktemp("venv")
    venv.create(env_dir, with_pip=True, system_site_packages=True)
    # and this environment's packages after its own (typer, rich: the base interpreter need not have them); a
    # path line in a .pth does not run that directory's .pth files, so the editable rlflow stays out
    site = env_dir / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    (site / "test_env_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(env_dir / "bin" / "python"), "-m", "pip", "install", "--no-deps", "--quiet", str(wheel)],
                   check=True, capture_output=True)
    return env_dir


def test_rlflow_help_runs_from_the_installed_wheel(installed, tmp_path):
    proc = subprocess.run([str(installed / "bin" / "rlflow"), "--help"], capture_output=True, text=True, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "compile" in proc.stdout and "simulate" in proc.stdout
    where = subprocess.run([str(installed / "bin" / "python"), "-c", "import rlflow.operators.policy as p; print(p.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, check=True).stdout
    assert str(installed) in where


PIPELINE = """name: outside
model: {path: "builtin:tiny-llama", max_model_len: 128}
data: {source: "builtin:arith", prompts_per_step: 4}
stages:
  rollout: {kind: rollout, engine: hf, group_size: 4, max_new_tokens: 8}
  score:   {kind: reward, fn: exact_match}
  train:   {kind: train, steps: 1}
edges:
  - {from: data,    to: rollout, policy: {kind: streaming}}
  - {from: rollout, to: score,   policy: {kind: streaming}}
  - {from: score,   to: train,   policy: {kind: one_step}}
  - {from: train,   to: rollout, policy: {kind: weight_sync}}
"""


def test_a_pipeline_outside_the_repo_compiles_from_the_installed_wheel(installed, tmp_path):
    # the train stage names no deepspeed config: the default configs/deepspeed/zero1.json comes from the wheel
    (tmp_path / "pipeline.yaml").write_text(PIPELINE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(installed / "bin" / "rlflow"), "compile", "pipeline.yaml", "-o", "plan.json"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (trainer,) = [a for a in json.loads((tmp_path / "plan.json").read_text())["actors"] if a["role"] == "trainer"]
    ds = Path(trainer["deepspeed"])
    assert ds.is_relative_to(installed) and ds.parts[-3:] == ("configs", "deepspeed", "zero1.json")


def test_configs_beside_the_pipeline_win_over_the_shipped_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pipelines = tmp_path / "project" / "pipelines"
    pipelines.mkdir(parents=True)
    # nothing of the user's: the shipped copy (in a source checkout, the repo's configs/)
    shipped = resolve_path("configs/deepspeed/zero1.json", pipelines)
    assert shipped in {root / "deepspeed" / "zero1.json" for root in SHIPPED_CONFIGS}
    assert shipped.read_bytes() == (REPO / "configs" / "deepspeed" / "zero1.json").read_bytes()
    assert resolve_path("configs/deepspeed/zero9.json", pipelines) is None
    assert resolve_path("configs/../pyproject.toml", pipelines) is None  # the fallback serves configs/ only
    own = tmp_path / "project" / "configs" / "deepspeed" / "zero1.json"
    own.parent.mkdir(parents=True)
    own.write_text("{}")
    assert resolve_path("configs/deepspeed/zero1.json", pipelines) == own.resolve()
