"""`rlflow run --resume` on the real stack when the newest checkpoint is damaged: it falls back to the previous one,
says so, and the ledger then holds every step trained once (unit-level drills: tests/unit/runtime/test_checkpoint_faults.py)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from runs import plan_for, run_plan

pytestmark = pytest.mark.integration


# two runs (about 90 s on a loaded 2-core machine); tests/unit/runtime/test_checkpoint_faults.py covers the fallback with a real
# DeepSpeed engine and the real ledger, and test_run.py's resume tests the driver's save and load through Ray
@pytest.mark.slow
def test_a_damaged_newest_checkpoint_falls_back_and_the_ledger_holds(ray_cluster, workdir):
    plan = plan_for("synchronous", "stages.train.steps=2", "stages.train.checkpoint_every=1")
    first = run_plan(plan)
    out = first.out_dir
    assert json.loads((out / "state.json").read_text())["checkpoint"]["tag"] == "step-2"
    db = sqlite3.connect(out / "ledger.sqlite")
    step2 = sorted(g for (g,) in db.execute("select gid from groups where state='trained' and step=2"))
    db.close()
    model_states = out / "checkpoint" / "step-2" / "mp_rank_00_model_states.pt"
    model_states.write_bytes(model_states.read_bytes()[:4096])  # a disk that filled up, a copy cut short

    said: list[str] = []
    second = run_plan(plan, resume=True, log=lambda *a, **k: said.append(" ".join(map(str, a))))
    assert any(m.startswith("checkpoint step-2 is damaged (mp_rank_00_model_states.pt has 4096 bytes") for m in said), said
    assert any(m.startswith("resuming from checkpoint step-1 (step 1), not the newest") for m in said), said
    assert [h["step"] for h in second.history] == [1, 2]
    # the run ended FINISHED, so Ledger.check passed in it; and from the ledger: step 2's groups, whose payloads the
    # step-2 checkpoint had let go, were generated again from their prompts and trained once more, at step 2
    db = sqlite3.connect(out / "ledger.sqlite")
    rows = dict(db.execute(f"select gid, attempt from groups where gid in ({','.join('?' * len(step2))})", step2).fetchall())
    per_step = dict(db.execute("select step, count(*) from groups where state='trained' group by step").fetchall())
    batch = plan["control"]["staleness"]["batch_size"]
    assert per_step == {1: batch, 2: batch}
    assert rows and all(a >= 2 for a in rows.values()), rows
    published = json.loads((out / "state.json").read_text())["checkpoint"]["tag"]
    assert published == "step-2.1" and Path(model_states).stat().st_size == 4096  # the damaged tag left as it was
