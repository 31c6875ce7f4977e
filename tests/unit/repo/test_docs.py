"""The docs site builds strictly, the README stays short with links that resolve, and every benchmark result is
shown in the docs (CI runs only the README's test command, so the docs' checks live here)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
README = REPO / "README.md"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_readme_is_under_200_lines():
    assert len(README.read_text().splitlines()) < 200


def test_readme_relative_links_resolve():
    links = [t for t in LINK.findall(README.read_text()) if "://" not in t and not t.startswith(("#", "mailto:"))]
    assert links, "the README links into docs/"
    missing = [t for t in links if not (REPO / t.split("#")[0]).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_readme_keeps_the_test_command_ci_runs():
    """.ci/run pastes the command between these markers; it must still be there and run pytest."""
    text = README.read_text()
    block = text[text.index("<!-- test-command -->"):text.index("<!-- /test-command -->")]
    assert "python -m pytest" in block


def test_every_results_file_is_included_in_the_docs():
    included = set()
    for page in (REPO / "docs").rglob("*.md"):
        included |= set(re.findall(r'--8<-- "benchmarks/results/([^"]+)"', page.read_text()))
    results = {p.name for p in (REPO / "benchmarks" / "results").glob("*.md")}
    assert results - included == set(), "results files no docs page includes"


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
                    reason="mkdocs-material is not installed (pip install -e '.[dev]')")
def test_mkdocs_build_strict(tmp_path):
    """Broken links, missing includes, pages outside the nav and a generator that fails all fail the build."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "reference" / "errors" / "index.html").exists()


def test_the_python_files_the_docs_name_exist():
    """A module renamed without its docs fails here: every `name.py` the README or docs/ names is a file."""
    names = set()
    for page in [README, *(REPO / "docs").rglob("*.md")]:
        names |= set(re.findall(r"`(?:[\w./-]*/)?(\w+\.py)`", page.read_text()))
    present = {p.name for d in ("rlflow", "stages", "operators", "tests", "benchmarks", "docs") for p in (REPO / d).rglob("*.py")}
    users = set(re.findall(r"<!-- own-task: (\w+\.py) -->", README.read_text()))  # the recipe's files, the user's
    assert names - present - users == set(), "docs name Python files that do not exist"
