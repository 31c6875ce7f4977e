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


def test_a_reward_failing_on_30_percent_of_answers_trains_to_the_end(ray_cluster, workdir, monkeypatch):
    """Issue #45: a reward that returns NaN on about 30% of answers trains through, its failures counted per answer.
    4 steps of the quickstart's full batch (16 groups x 8) score at least 512 answers, one full FAILURE_WINDOW, so both
    stop rules are judged (the issue's 40 steps would take minutes here; tests/unit/runtime/test_reward_failures.py
    runs 40 steps' worth of seeded streams through the rule). Which answers fail is fixed by their order in the
    reward's process (rewards_for_tests.nan_on_30_percent: a seeded draw per call), not by what was generated, so
    the failure stream is the same in every run and one run stands for the issue's "5 of 5": the old rule (more than
    half of the last 64) stopped on this stream at its answers 172-216. A failed answer is recorded `failed`, never
    retried or trained; its group trains on the members that scored (conservation, from the ledger)."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    steps, batch, group = 4, 16, 8
    run = run_plan(plan_for("quickstart", "stages.score.fn=rewards_for_tests:nan_on_30_percent", f"stages.train.steps={steps}",
                            f"stages.buffer.batch_groups={batch}", f"stages.rollout.group_size={group}"))
    assert len(run.history) == steps  # trained to the end
    ledger = sqlite3.connect(run.out_dir / "ledger.sqlite")
    states = dict(ledger.execute("select state, count(*) from trajectories group by state"))
    scored = states.get("failed", 0) + states.get("trained", 0) + ledger.execute(
        "select count(*) from trajectories t join groups g on g.gid = t.gid "
        "where g.state = 'filtered' and t.state != 'failed'").fetchone()[0]
    assert scored >= 512, states  # a full window of answers was judged
    assert run.counts["reward_failed"] == states["failed"]
    assert 0.2 < states["failed"] / scored < 0.4, states
    trained = dict(ledger.execute("select gid, count(*) from trajectories where state = 'trained' group by gid"))
    assert len(trained) == steps * batch and all(1 <= n <= group for n in trained.values())
    partly = ledger.execute("select count(distinct t.gid) from trajectories t join groups g on g.gid = t.gid "
                            "where g.state = 'trained' and t.state = 'failed'").fetchone()[0]
    assert partly > 0  # groups with failed answers trained on the rest
    members = ledger.execute("select count(*) from trajectories t join groups g on g.gid = t.gid "
                             "where g.state = 'trained' and t.state not in ('trained', 'failed')").fetchone()[0]
    assert members == 0  # every member of a trained group was trained or failed: none lost
