"""mkdocs hook: publishes the plots the benchmarks write beside their tables.

The results pages include benchmarks/results/*.md through pymdownx.snippets, but the .png files beside them live
outside docs/, so this hook adds them to the site under results/. The reference pages need no hook: their generated
text is written into the Markdown by `python docs/reference_pages.py` (tests/unit/repo/test_docs.py checks it is
current), so the site builds from the files as they are.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def on_files(files, config):
    """The plots the benchmarks write beside their tables, published under results/."""
    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"results/{png.name}", content=png.read_bytes()))
    return files
