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
# How the README states the suite's time and last result ("32 min 27 s of pytest ... 15 slow deselected")
SUITE_FIGURES = re.compile(r"\d+ min \d+ s of pytest|\d+ min \d+ s idle|slow deselected")


def reference_pages():
    """docs/reference_pages.py, the generator of the reference pages (docs/ is not a package)."""
    spec = importlib.util.spec_from_file_location("reference_pages", REPO / "docs" / "reference_pages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    """Broken links, missing includes and pages outside the nav all fail the build."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    errors_page = (tmp_path / "site" / "reference" / "errors" / "index.html").read_text()
    assert "invalid pipelines break" in errors_page, "the site shows the catalogue written into errors.md"


def test_the_python_files_the_docs_name_exist():
    """A module renamed without its docs fails here: every `name.py` the README or docs/ names is a file."""
    names = set()
    for page in [README, *(REPO / "docs").rglob("*.md")]:
        names |= set(re.findall(r"`(?:[\w./-]*/)?(\w+\.py)`", page.read_text()))
    present = {p.name for d in ("rlflow", "stages", "operators", "tests", "benchmarks", "docs") for p in (REPO / d).rglob("*.py")}
    users = set(re.findall(r"<!-- own-task: (\w+\.py) -->", README.read_text()))  # the recipe's files, the user's
    assert names - present - users == set(), "docs name Python files that do not exist"


def test_reference_pages_hold_what_the_code_generates_now():
    """The CLI, schema and errors pages carry text generated from the code, so they read whole on GitHub; a change
    to the CLI, the schema or the invalid catalogue without a refresh of the pages fails here."""
    pages = reference_pages()
    stale = [str(page.relative_to(REPO)) for page in pages.stale_pages()]
    assert not stale, f"reference pages out of date with the code: {stale}; run `python docs/reference_pages.py`"


def test_refreshing_a_block_keeps_the_prose_around_it_and_changes_nothing_twice():
    fill = reference_pages().fill
    page = "# CLI\n\nprose\n\n<!-- rlflow:cli -->\nold text\n<!-- /rlflow:cli -->\n\nmore prose\n"
    once = fill(page, "cli", "new text")
    assert once.startswith("# CLI\n\nprose\n\n<!-- rlflow:cli -->\n")
    assert once.endswith("<!-- /rlflow:cli -->\n\nmore prose\n")
    assert "new text" in once and "old text" not in once
    assert fill(once, "cli", "new text") == once


def test_a_page_without_its_end_marker_is_refused():
    """Without the end marker the generator cannot tell generated text from prose; it must not guess."""
    with pytest.raises(ValueError, match="<!-- /rlflow:errors -->"):
        reference_pages().fill("<!-- rlflow:errors -->\nprose a refresh would eat\n", "errors", "table")


def test_the_suite_figures_are_stated_only_in_the_readme():
    """How long the suite takes and what its last run found change with every full run; docs pages that restated
    them went stale apart from the README, so docs/ points to the README's install section instead."""
    assert SUITE_FIGURES.search(README.read_text()), "the README no longer states the suite figures as SUITE_FIGURES reads them"
    copies = [str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*.md") if SUITE_FIGURES.search(p.read_text())]
    assert not copies, f"pages restating the README's suite figures (point to the README instead): {copies}"
