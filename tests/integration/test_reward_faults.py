"""A reward that kills its process on some rows, on the real stack: those trajectories fail by name and the run
goes on to its last step (the reward runs in a child process of its Score actor, runtime/reward_process.py)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from runs import plan_for, run_plan

pytestmark = pytest.mark.integration


def test_a_poison_row_fails_its_trajectories_and_the_run_finishes(ray_cluster, workdir, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    data = workdir / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+2=", "answer": str(a + 2), "poison": a == 3}) + "\n"
                            for a in range(4)))  # one row in four calls os._exit(1); the first 4 draws hold it
    lines: list[str] = []
    # no group filter: the tiny model, warm-started on these four rows, answers them all right, and uniform groups
    # would all be dropped (the poison rows' groups are failed, and so never trained, either way)
    run = run_plan(plan_for("quickstart", f"data.source={data}", "stages.score.fn=rewards_for_tests:exits_on",
                            "stages.train.steps=2", "edges.2.policy.filter=null"), log=lambda m, **k: lines.append(str(m)))
    assert len(run.history) == 2  # the run went on
    named = [ln for ln in lines if "rewards_for_tests:exits_on killed its process (exit code 1) on trajectory" in ln]
    assert named and run.counts["reward_failed"] > 0, lines
    assert all("of task 'main' (prompt '" in ln and "twice; this trajectory fails" in ln for ln in named), named
    ledger = sqlite3.connect(run.out_dir / "ledger.sqlite")
    poison = [s for p, s in ledger.execute("select prompt, state from groups") if json.loads(p)["row"]["poison"]]
    assert "filtered" in poison and not {"buffered", "trained"} & set(poison), poison  # every member failed: never trained
