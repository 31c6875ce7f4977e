"""How a benchmark reports: its table on stdout, and the same text in benchmarks/results/ (what the README quotes)."""

from __future__ import annotations

from pathlib import Path


def publish_table(path: Path, lines: list[str]) -> str:
    """Print `lines` as one text and write it to `path` (its folder made if missing); returns the text."""
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}")
    return text
