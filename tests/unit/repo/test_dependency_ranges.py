"""The runtime dependencies that have changed behaviour between minor versions (transformers, MLflow, Ray, DeepSpeed)
keep a tested range in pyproject.toml, a lower and an upper bound, so a fresh install cannot drift onto an untested
release; and the versions this environment runs on lie inside those ranges (#33). `.ci/run` runs the quickstart on
the versions a fresh install resolves."""

from __future__ import annotations

import tomllib
from importlib.metadata import PackageNotFoundError, version

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

HELD = ("transformers", "mlflow", "ray", "deepspeed")


def declared(repo) -> dict[str, Requirement]:
    deps = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["dependencies"]
    reqs = {r.name.lower(): r for r in map(Requirement, deps)}
    missing = [name for name in HELD if name not in reqs]
    assert not missing, f"{missing} left pyproject's dependencies: update HELD in this test"
    return {name: reqs[name] for name in HELD}


def bounds(spec: SpecifierSet) -> tuple[bool, bool]:
    """Whether a specifier set has a lower bound and an upper bound (a pin is both)."""
    ops = {s.operator for s in spec}
    return bool(ops & {"==", "===", "~=", ">=", ">"}), bool(ops & {"==", "===", "~=", "<", "<="})


def test_bounds_tells_an_open_range_from_a_closed_one():
    assert bounds(SpecifierSet(">=3")) == (True, False)
    assert bounds(SpecifierSet("")) == (False, False)
    assert bounds(SpecifierSet("==2.60.0")) == (True, True)
    assert bounds(SpecifierSet(">=5.17,<5.25")) == (True, True)


@pytest.mark.parametrize("name", HELD)
def test_each_held_dependency_has_both_bounds(repo, name):
    spec = declared(repo)[name].specifier
    assert bounds(spec) == (True, True), (
        f"pyproject.toml: {name}{spec or ' (no range)'} needs a lower and an upper bound: the lowest version tested "
        f"and the next minor (or major) release not yet run, with a comment saying what was tested")


@pytest.mark.parametrize("name", HELD)
def test_the_installed_version_is_inside_the_declared_range(repo, name):
    try:
        installed = version(name)
    except PackageNotFoundError:
        pytest.skip(f"{name} is not installed here")
    spec = declared(repo)[name].specifier
    assert spec.contains(installed, prereleases=True), (
        f"{name} {installed} is installed but pyproject.toml declares {name}{spec}: test {installed} (the full suite "
        f"and the quickstart) and widen the range with a comment, or install a version inside it")
