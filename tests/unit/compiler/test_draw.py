"""The plan picture (rlflow/draw.py): no edge label lies under a stage box, whatever the pipeline's labels."""

from __future__ import annotations

import re

import pytest

from rlflow.compiler import compile_pipeline
from rlflow.draw import CHAR_W, render_svg
from rlflow.plan_model import Plan

RECT = re.compile(r'<rect x="([\d.]+)" y="([\d.]+)" width="([\d.]+)" height="([\d.]+)"')
TEXT = re.compile(r'<text x="([\d.]+)" y="([\d.]+)" text-anchor="middle"[^>]*paint-order[^>]*>([^<]+)</text>')


@pytest.mark.parametrize("pipeline", ["quickstart", "streamrl", "mixed", "staleflow"])
def test_no_edge_label_lies_under_a_stage_box(repo, pipeline):
    svg = render_svg(Plan.of(compile_pipeline(repo / "pipelines" / f"{pipeline}.yaml")))
    boxes = [tuple(map(float, m)) for m in RECT.findall(svg)]
    labels = [(float(x), float(y), text) for x, y, text in TEXT.findall(svg)]
    assert boxes and labels
    for x, y, text in labels:
        half = CHAR_W * len(text.replace("&gt;", ">").replace("&lt;", "<")) / 2
        for bx, by, bw, bh in boxes:
            overlaps = x - half < bx + bw and x + half > bx and by < y < by + bh + 4
            assert not overlaps, f"label {text!r} at ({x}, {y}) lies under the box at ({bx}, {by})"
    assert svg.rindex("<rect") < svg.index("paint-order")  # labels drawn last: on top, even where a box reaches
