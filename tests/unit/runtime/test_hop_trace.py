"""The hop trace (runtime/hop_trace.py): silent unless RLFLOW_HOP_TRACE names a directory, then one JSON line per
key crossing a hop, per process, which benchmarks/bench_step_latency.py reads back."""

from __future__ import annotations

import json
import os

from rlflow.runtime import hop_trace


def test_marks_are_written_only_when_the_trace_is_on(tmp_path, monkeypatch):
    monkeypatch.setattr(hop_trace, "_file", None)
    monkeypatch.delenv(hop_trace.ENV, raising=False)
    hop_trace.mark("routed", ["g1"])
    assert not hop_trace.enabled() and list(tmp_path.iterdir()) == []

    monkeypatch.setenv(hop_trace.ENV, str(tmp_path / "trace"))
    hop_trace.mark("routed", ["g1", "g2"], t=1.5)
    hop_trace.mark("published", 3)
    hop_trace._file.close()
    monkeypatch.setattr(hop_trace, "_file", None)
    lines = [json.loads(x) for x in (tmp_path / "trace" / f"{os.getpid()}.jsonl").read_text().splitlines()]
    assert [(m["hop"], m["key"]) for m in lines] == [("routed", "g1"), ("routed", "g2"), ("published", 3)]
    assert lines[0]["t"] == lines[1]["t"] == 1.5 and lines[2]["t"] > 1.5
