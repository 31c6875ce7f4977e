"""Reward models on Ray Data in a real run (#35 item 2): builtin:tiny-reward and a generative judge score a run in
the stage's actor pool, beside a function; a remote endpoint on 127.0.0.1 that fails, times out and recovers loses
no trajectory and scores none twice, and its failures are recorded."""

from __future__ import annotations

import json
import math
import sqlite3
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import yaml
from reward_endpoint import Endpoint
from runs import REPO

from rlflow.compiler import compile_pipeline
from rlflow.errors import RunFailed
from rlflow.runtime.hooks import RunHooks
from rlflow.runtime.messages import Rewarded

pytestmark = pytest.mark.integration

#: a fixed path, so the data rows (and the tiny Llama warm-started on them, cached by their fingerprint) stay the same
PROBE = Path(tempfile.gettempdir()) / "rlflow-reward-models-probe.jsonl"


def pipeline(workdir: Path, score: dict, steps: int = 2) -> dict:
    """pipelines/reward_model.yaml, small, on 16 sums whose rows carry PROBE, with `score` as its reward stage."""
    data = workdir / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b), "probe": str(PROBE)}) + "\n"
                            for a in range(4) for b in range(4)))
    spec = yaml.safe_load((REPO / "pipelines" / "reward_model.yaml").read_text())
    spec["data"] = {"source": str(data)}
    spec["stages"]["score"] = {"kind": "reward", **score}
    spec["stages"]["rollout"] |= {"group_size": 4}
    spec["stages"]["buffer"]["batch_groups"] = 2
    spec["stages"]["train"]["steps"] = steps
    spec["edges"][2]["policy"].pop("filter")  # every group trains, whatever its rewards
    spec["tracking"] = {"progress": False}
    path = workdir / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec))
    return compile_pipeline(path)


def run(plan: dict, lines: list | None = None):
    """Run `plan`; returns (the Run, every scored row the driver received, in order)."""
    from rlflow.runtime.driver import Run

    scored = []

    def on_event(run, event):
        if isinstance(event, Rewarded):
            scored.extend(event.batch.rows)

    r = Run(plan, out_dir=Path(".rlflow") / "runs" / plan["name"], hooks=RunHooks(on_event=on_event),
            log=(lambda m, **k: lines.append(str(m))) if lines is not None else (lambda *a, **k: None))
    try:
        r.run()
    finally:
        r.scored = scored
    return r, scored


def recorded() -> list[dict]:
    return [json.loads(line) for line in PROBE.read_text().splitlines()] if PROBE.exists() else []


def assert_exactly_once(r, scored, steps: int) -> None:
    """Every trajectory was scored once, and every trained one without error (the run itself ends by checking the
    ledger's invariants: each step trained its batch, no group twice)."""
    assert len(r.history) == steps
    ids = Counter(str(t.traj_id) for t in scored)
    assert max(ids.values()) == 1, [t for t, n in ids.items() if n > 1]
    db = sqlite3.connect(r.out_dir / "ledger.sqlite")
    trained = {tid for (tid,) in db.execute("select tid from trajectories where state='trained'")}
    errors = {str(t.traj_id): t.reward_error for t in scored}
    assert trained and trained <= set(ids) and not any(errors[t] for t in trained)


def test_a_reward_model_scores_a_run_beside_a_function(ray_cluster, workdir, monkeypatch):
    from transformers import AutoTokenizer

    from rlflow.stages.reward_model import build_tiny_reward, is_digit_share

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    PROBE.unlink(missing_ok=True)
    plan = pipeline(workdir, {"scorers": [{"fn": "exact_match", "weight": 1.0}, {"model": "builtin:tiny-reward", "weight": 0.2},
                                          {"fn": "rewards_for_tests:records", "weight": 0.0}],
                              "batch_size": 8, "num_cpus": 0.5})
    r, scored = run(plan)
    assert len(r.history) == 2
    assert_exactly_once(r, scored, 2)
    tok = AutoTokenizer.from_pretrained(build_tiny_reward())
    # every text the stage scored (the recorder is one of its parts; bundles in flight when the run ended were scored
    # too, but never delivered): each reward the driver got is the one expected of a text the stage saw
    texts = recorded()
    assert len(texts) >= len(scored) and all(not t.reward_error for t in scored)
    want = [float(t["completion"].strip() == t["answer"]) + 0.2 * is_digit_share(
        tok(t["prompt"] + t["completion"])["input_ids"], tok) for t in texts]
    for got in sorted(float(t.reward) for t in scored):
        match = next((w for w in want if abs(w - got) < 1e-3), None)
        assert match is not None, (got, sorted(want))
        want.remove(match)


JUDGE = {"model": "builtin:tiny-llama", "template": "{completion}+0=", "verdict": "regex:^\\s*(\\d+)", "max_new_tokens": 4,
         "timeout_s": 20}  # the policy's own start, asked to add 0 to the completion: a verdict that is a number, or not


def test_a_judge_scores_a_run(ray_cluster, workdir, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    PROBE.unlink(missing_ok=True)
    plan = pipeline(workdir, {"scorers": [{"judge": JUDGE, "weight": 0.01}, {"fn": "rewards_for_tests:records", "weight": 0}],
                              "batch_size": 16})
    r, scored = run(plan)
    assert_exactly_once(r, scored, 2)
    ok = [t for t in scored if not t.reward_error]
    assert len(recorded()) >= len(scored) and ok and all(math.isfinite(t.reward) and t.reward >= 0 for t in ok)
    for t in scored:  # a verdict with no number is a failing reward, named by the rule
        assert not t.reward_error or "does not match" in t.reward_error, t.reward_error


def test_a_judge_that_times_out_fails_its_rewards_and_stops_the_run_by_name(ray_cluster, workdir):
    lines: list[str] = []
    with pytest.raises(RunFailed, match="timed out on every trajectory of 3 bundles in a row"):
        run(pipeline(workdir, {"judge": JUDGE | {"timeout_s": 1e-4}}), lines)


def test_a_remote_endpoint_that_fails_then_recovers_loses_nothing_and_records_its_failures(ray_cluster, workdir):
    server = Endpoint([("status", 503)] * 6 + [("sleep", 1.5)] * 4)  # 503s, then replies after the timeout, then well
    try:
        plan = pipeline(workdir, {"http": {"url": server.url, "timeout_s": 0.5, "retries": 1, "backoff_s": 0.05,
                                           "concurrency": 2}, "concurrency": 2}, steps=3)
        r, scored = run(plan)
    finally:
        server.close()
    assert_exactly_once(r, scored, 3)
    failed = [t.reward_error for t in scored if t.reward_error]
    assert failed and r.counts["reward_failed"] == len(failed)  # recorded, each once
    assert all(("answered HTTP 503 (2 attempts)" in e or "timed out after 0.5 s (2 attempts)" in e) for e in failed), failed
    assert len(failed) <= 5  # 10 bad replies, two attempts per trajectory: the rest recovered on their retry
    assert server.requests >= len(scored) + len(failed)  # each failure cost its retry
    db = sqlite3.connect(r.out_dir / "ledger.sqlite")
    ended = {tid for (tid,) in db.execute("select t.tid from trajectories t join groups g on t.gid = g.gid "
                                          "where g.state in ('trained', 'filtered')")}
    assert ended <= {str(t.traj_id) for t in scored}  # nothing reached an end without its reward
