"""Test modules live in folders without __init__.py (pytest's "prepend" import mode), so two with the same file name
anywhere under tests/ stop the whole default run at collection ("import file mismatch"); the fast lane, which
collects only tests/unit and tests/compile, would not see it."""

from __future__ import annotations

from collections import Counter


def test_no_two_test_modules_share_a_file_name(repo):
    names = Counter(p.name for p in (repo / "tests").rglob("test_*.py"))
    assert {n: c for n, c in names.items() if c > 1} == {}
