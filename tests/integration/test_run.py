"""`rlflow run` on the real stack: Ray actors, Ray Data reward stream, DeepSpeed GRPO, MLflow, tiny model."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from runs import REPO, SMALL, WeightFileWatch, plan_for, run_plan

from rlflow.compiler import compile_pipeline
from rlflow.errors import PipelineInvalid
from rlflow.runtime.hooks import RunHooks

pytestmark = pytest.mark.integration


def assert_accounted(run) -> None:
    c = run.buffer.counters
    assert c.conserved(), vars(c)
    assert c.consumed == len(run.history) * run.control["batch_size"]
    eta = run.control["eta"]
    if eta is not None:
        assert max(run.staleness_all) <= eta
    assert_ledger(run.out_dir, steps=len(run.history), batch=run.control["batch_size"], eta=eta)  # and durably


def assert_as_compiled(run, plan) -> None:
    """The run's one fleet, its coordinator strategies and the staleness policy are the plan's."""
    from rlflow.operators.policy_kinds import make_policy

    assert [f.stage for f in run.fleets] == ["rollout"]
    assert len(run.fleets[0].instances) == plan["pipeline"]["stages"]["rollout"]["replicas"]
    cfg = run.fleets[0].coordination.coord.cfg
    coord = plan["control"]["coordination"]["rollout"]
    assert (cfg.routing, cfg.migration) == (coord["routing"], coord["migration"])
    assert type(run.buffer.policy) is type(make_policy(**plan["control"]["staleness"]))


# quickstart runs in the failing-reward, killed-trainer and vLLM tests below. Slow here (the rest of this test is the
# same for every pipeline): bounded_async runs whole in test_dead_rollout_instance_loses_no_trajectory and
# test_elastic_run.py; one_step (its own data and reward) in test_killed_reward_worker_loses_nothing and laminar (the
# collective transport) in test_weight_sync.py::test_a_run_over_the_collective_transport_verifies_every_pull, both
# with assert_as_compiled and assert_accounted
@pytest.mark.parametrize("pipeline", ["synchronous", pytest.param("bounded_async", marks=pytest.mark.slow),
                                      pytest.param("one_step", marks=pytest.mark.slow), "staleflow",
                                      pytest.param("laminar", marks=pytest.mark.slow)])
def test_pipeline_runs_end_to_end(pipeline, ray_cluster, workdir):
    """Every shipped single-task pipeline runs as compiled: one fleet per rollout stage in the plan, with the
    plan's actors, its coordinator strategies and its staleness policy."""
    plan = plan_for(pipeline, "stages.train.checkpoint_every=3")
    lines: list[str] = []
    run = run_plan(plan, log=lambda *a, **k: lines.extend(map(str, a)))
    # the last step's checkpoint_every save is the final checkpoint: not written a second time at exit
    assert [line.split(":")[0] for line in lines if line.startswith("checkpoint at")] == ["checkpoint at step 3"]
    assert_as_compiled(run, plan)
    tokens, seconds = run.fleets[0].decode_rate()
    assert tokens > 0 and seconds > 0 and run.summary()["engine_tokens_per_s"] == tokens / seconds
    assert [h["step"] for h in run.history] == [1, 2, 3]
    assert_accounted(run)
    if pipeline == "synchronous":
        assert set(run.staleness_all) == {0}
    import mlflow

    data = mlflow.get_run(run.tracker.run_id).data
    assert data.params["stages.train.steps"] == "3"
    assert {"reward/mean_trained", "train/loss", "staleness/mean", "train/tokens_per_s", "rollout/idle_ratio",
            "rollout/length_prompt_share"} <= set(data.metrics)  # grouped names (rlflow/runtime/metric_names.py)
    assert not {"step", "version"} & set(data.metrics) and "None" not in data.params.values()
    assert all(0 <= h["length_prompt_share"] <= 1 for h in run.history)
    measured = run.summary()["workload_measured"]  # what simulate / tune would otherwise assume, from the trained groups
    assert measured["groups"] == 2 * len(run.history)  # SMALL: 2 groups a step
    assert 0 < measured["mean_length"] <= plan["pipeline"]["stages"]["rollout"]["max_new_tokens"]
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(run.tracker.run_id, "plots")}
    assert {"plots/staleness.png", "plots/instance_load.png", "plots/learning_curves.png"} <= artifacts
    if pipeline == "synchronous":  # the export is this run's MLflow model, with the plan under rlflow/
        (uri,) = [w.rstrip(";") for line in lines for w in line.split() if w.startswith("models:/")]
        model_id = mlflow.models.get_model_info(uri).model_id
        files = {a.path for a in mlflow.MlflowClient().list_logged_model_artifacts(model_id, "rlflow")}
        assert {"rlflow/plan.json", "rlflow/rlflow_export.json"} <= files


def test_failing_reward_is_counted_and_loses_nothing(ray_cluster, workdir, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    plan = plan_for("quickstart", "stages.score.fn=rewards_for_tests:flaky_exact")
    run = run_plan(plan)
    assert run.counts["reward_failed"] > 0
    assert len(run.history) == 3
    assert_accounted(run)
    import sqlite3

    failed = sqlite3.connect(run.out_dir / "ledger.sqlite").execute(
        "select count(*) from trajectories where state='failed'").fetchone()[0]
    assert failed == run.counts["reward_failed"]  # each failed trajectory is on record, none trained


def test_dead_rollout_instance_loses_no_trajectory(ray_cluster, workdir):
    import ray

    from rlflow.runtime.driver import Run

    killed = []

    def kill_after_routing(run):
        """Kills an instance right after work was routed to it (deterministic: the work is in flight)."""
        fleet = run.fleets[0]
        send = fleet.send

        def send_after_kill():
            if not killed and run.history:
                victim = next((i for i in fleet.instances if i.alive and i.routes), None)
                if victim is not None:
                    killed.append(victim)
                    ray.kill(victim.handle)
            return send()
        fleet.send = send_after_kill

    plan = plan_for("bounded_async", "stages.train.steps=4")
    run = Run(plan, out_dir=Path(".rlflow/runs/x"), log=lambda *a: None, hooks=RunHooks(on_started=kill_after_routing))
    run.run()
    victim = killed[0] if killed else None
    assert victim is not None and not victim.alive
    assert run.counts["rerouted"] > 0
    assert len(run.history) == 4
    assert_accounted(run)


# quickstart resumes in test_driver_killed_with_sigkill_resumes_losing_nothing; streamrl adds skew-aware dispatch
@pytest.mark.parametrize("pipeline", ["streamrl"])
def test_ctrl_c_checkpoints_and_resume_continues(pipeline, ray_cluster, workdir):
    """Ctrl-C saves a checkpoint; --resume continues the same MLflow run. Groups the ledger shows buffered at
    the checkpoint go back into the buffer; the others drawn but not trained (in flight or drawn ahead) are
    generated again first."""
    from rlflow.runtime.driver import Run

    drawn_again: list[str] = []  # the groups the resumed run draws, in order

    def record_draws(run):
        fleet = run.fleets[0]
        draw = fleet._draw

        def recording():
            gid, rows = draw()
            drawn_again.append(gid)
            return gid, rows
        fleet._draw = recording

    plan = plan_for(pipeline, "stages.train.steps=4", *(["stages.buffer.batch_groups=8"] if pipeline == "streamrl" else []))
    out = Path(".rlflow/runs") / plan["name"]
    first = Run(plan, out_dir=out, log=lambda *a: None)

    signal_after(first, 2, signal.SIGINT)
    first.run()
    stopped_at = len(first.history)
    assert first.stop_requested and 2 <= stopped_at < 4
    assert (out / "state.json").exists()
    open_groups, drawn = ledger_open_groups(out)
    assert open_groups  # in flight, buffered or drawn ahead at the checkpoint: never trained
    second = Run(plan, out_dir=out, resume=True, log=lambda *a: None, hooks=RunHooks(on_started=record_draws))
    second.run()
    assert [h["step"] for h in second.history] == list(range(1, 5))
    assert second.tracker.run_id == first.tracker.run_id
    regenerated = [g for g in open_groups if g not in second.restored]
    # generated again first, under their own ids (a run may end before it needs all of them: many are drawn
    # ahead under streamrl; those stay open in the ledger for the next resume)
    first_drawn = drawn_again[:len(regenerated)]
    assert first_drawn == regenerated[:len(first_drawn)]
    assert not set(second.restored) & set(drawn_again)  # restored groups are not generated again
    if len(drawn_again) > len(regenerated):
        assert drawn_again[len(regenerated)] == f"main-{drawn}"  # then the prompts after the first run's last
    assert_ledger(out, steps=4, batch=plan["control"]["staleness"]["batch_size"], eta=plan["control"]["staleness"]["eta"])


def signal_after(run, steps: int, signum: int) -> None:
    """Send this process `signum` (its handler runs in the main thread, inside run.run()) once `run` has trained
    `steps` steps."""
    def send():
        while len(run.history) < steps:
            time.sleep(0.1)
        os.kill(os.getpid(), signum)

    threading.Thread(target=send, daemon=True).start()


def test_sigterm_stops_like_ctrl_c_with_a_checkpoint(ray_cluster, workdir):
    """SIGTERM, what Slurm, Kubernetes and `docker stop` send, finishes the step and checkpoints as Ctrl-C does
    (it used to abort the driver with no checkpoint and no message); the previous handler is back afterwards."""
    from rlflow.runtime.driver import Run

    plan = plan_for("synchronous", "stages.train.steps=6")
    out = Path(".rlflow/runs") / plan["name"]
    lines: list[str] = []
    run = Run(plan, out_dir=out, log=lambda *a, **k: lines.extend(map(str, a)))
    before = signal.getsignal(signal.SIGTERM)

    signal_after(run, 1, signal.SIGTERM)
    run.run()
    assert run.stop_requested and 1 <= len(run.history) < 6
    assert any("stopping on SIGTERM" in line for line in lines), lines
    assert run.stop_signal == signal.SIGTERM  # `rlflow run` exits 143 (tests/unit/runtime/test_stop_signal.py)
    assert run.grace.done.is_set()  # the stop finished within its grace, which no longer runs
    state = json.loads((out / "state.json").read_text())
    assert state["step"] == len(run.history)  # the checkpoint is of the last step trained
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_second_sigterm_during_the_final_writes_quits_143_saying_what_was_left(ray_cluster, workdir, capsys):
    """rlflow's handler stays installed through the shutdown's writes (it used to be swapped back for Ray's first,
    which exited 15 saying nothing): SIGTERM twice just before the final export quits at once, 143, naming the
    export it left out; the checkpoint of the last step is already published, and the previous handler is back."""
    from rlflow.runtime.driver import Run
    from rlflow.runtime.hooks import RunHooks
    from rlflow.runtime.stop_signal import StoppedAgain

    def twice(run):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, in the main thread: a stop requested
        os.kill(os.getpid(), signal.SIGTERM)  # and now a second one: quit

    plan = plan_for("synchronous", "stages.train.steps=2")
    out = Path(".rlflow/runs") / plan["name"]
    before = signal.getsignal(signal.SIGTERM)
    run = Run(plan, out_dir=out, log=print, hooks=RunHooks(before_export=twice))
    with pytest.raises(StoppedAgain) as stopped:
        run.run()
    assert stopped.value.exit_code == 143
    assert stopped.value.describe() == ("SIGTERM again: quit at once, without the export of step 2 (its checkpoint is "
                                        "saved); rlflow run --resume continues from the last checkpoint")
    assert json.loads((out / "state.json").read_text())["step"] == 2 and not run.exported
    assert signal.getsignal(signal.SIGTERM) is before and run.grace.done.is_set()


def ledger_open_groups(out: Path) -> tuple[list[str], int]:
    """Groups the ledger has drawn but not finished, in draw order, and how many prompts were drawn."""
    import sqlite3

    from rlflow.runtime.ledger import TERMINAL

    db = sqlite3.connect(out / "ledger.sqlite")
    rows = db.execute(f"select gid from groups where state not in ({','.join('?' * len(TERMINAL))}) order by seq",
                      TERMINAL).fetchall()
    return [g for (g,) in rows], db.execute("select max(n) + 1 from groups").fetchone()[0]


def assert_ledger(out: Path, *, steps: int, batch: int, eta) -> None:
    """From the durable ledger: each step trained `batch` groups, no group twice, none above the bound."""
    import sqlite3

    db = sqlite3.connect(out / "ledger.sqlite")
    per_step = dict(db.execute("select step, count(*) from groups where state='trained' group by step").fetchall())
    assert per_step == {s: batch for s in range(1, steps + 1)}, per_step
    worst = db.execute("select max(staleness), min(staleness) from groups where state='trained'").fetchone()
    assert worst[1] >= 0 and (eta is None or worst[0] <= eta), worst
    trained = db.execute("select count(*) from trajectories where state='trained'").fetchone()[0]
    assert trained >= steps * batch  # every trained group's trajectories are on record


KILL_SCRIPT = """
import os, sys
from pathlib import Path
import ray
from rlflow.compiler import compile_pipeline
from rlflow.runtime.driver import Run
plan = compile_pipeline(sys.argv[1], sys.argv[5:])
# a driver of its own joining the session's cluster (starting one per driver cost ~10 s each); killing this
# process kills its job, whose actors Ray then reclaims
ray.init(address=sys.argv[4], log_to_driver=False,
         runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
Run(plan, out_dir=Path(sys.argv[2]), resume=sys.argv[3] == "1", log=lambda *a: print(*a, flush=True)).run()
"""


def ledger_restorable(out: Path) -> set[str]:
    """Groups a resume from the run's checkpoint must put back into the buffer: buffered, or trained after the
    checkpoint, with a payload on record whose every member was generated by weights up to the checkpoint's."""
    import json
    import sqlite3

    from rlflow.stages.trajectory import Trajectory

    ckpt = json.loads((out / "state.json").read_text())["step"]
    rows = sqlite3.connect(out / "ledger.sqlite").execute(
        "select g.gid, g.v_traj, p.rows from payloads p join groups g on g.gid = p.gid "
        "where g.state = 'buffered' or (g.state = 'trained' and g.step > ?)", (ckpt,)).fetchall()
    return {gid for gid, v, members in rows if v <= ckpt and all(Trajectory.from_dict(m).version_span()[1] <= ckpt for m in json.loads(members))}


def trained_per_step(out: Path) -> dict[int, list[str]]:
    import sqlite3

    rows = sqlite3.connect(out / "ledger.sqlite").execute("select step, gid from groups where state='trained'").fetchall()
    steps: dict[int, list[str]] = {}
    for step, gid in rows:
        steps.setdefault(step, []).append(gid)
    return {k: sorted(v) for k, v in steps.items()}


def test_driver_killed_with_sigkill_resumes_losing_nothing(ray_cluster, workdir):
    """kill -9 of the driver at a random step after a checkpoint, then --resume: from the ledger, every step
    trained one batch, no group twice, none above the bound (synchronous: 0), the groups buffered (or trained
    after the checkpoint) by weights the checkpoint kept were restored, the other groups open at the kill were
    generated again — and the run trained the same prompts at the same steps as a run that never crashed."""
    import random
    import sqlite3
    import subprocess
    import sys

    # 6 steps, the kill after step 2 or 3: a step of this tiny model can take well under a second on a loaded
    # machine, and a kill landing after the last step (CI saw it with 4) would leave nothing to resume
    small = SMALL + ["stages.train.steps=6", "stages.train.checkpoint_every=1"]
    reference = run_plan(compile_pipeline(REPO / "pipelines" / "synchronous.yaml", small))
    expected = trained_per_step(reference.out_dir)

    out = workdir / "run"
    args = [str(REPO / "pipelines" / "synchronous.yaml"), str(out)]
    address = ray_cluster.get_runtime_context().gcs_address
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    kill_after = random.Random().randint(2, 3)
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, *args, "0", address, *small], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if (out / "ledger.sqlite").exists():
            # the file appears a moment before its tables do: not created yet reads as no step yet
            with contextlib.closing(sqlite3.connect(out / "ledger.sqlite")) as db:
                try:
                    step = db.execute("select max(step) from groups").fetchone()[0]
                except sqlite3.OperationalError:
                    step = None
            if step is not None and step >= kill_after:
                proc.kill()  # SIGKILL: no handler runs, nothing is flushed beyond what was committed
                break
        time.sleep(0.05)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stdout.read()
    with contextlib.closing(sqlite3.connect(out / "ledger.sqlite")) as db:
        last = db.execute("select max(step) from groups where state='trained'").fetchone()[0]
    assert last is not None and last < 6, f"the kill came after step {last} of 6: nothing left to resume"
    open_groups, _ = ledger_open_groups(out)
    restorable = ledger_restorable(out)
    done = subprocess.run([sys.executable, "-c", KILL_SCRIPT, *args, "1", address, *small], check=False, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"{len(restorable)} buffered group(s) restored from the ledger" in done.stdout, done.stdout[-3000:]
    assert_ledger(out, steps=6, batch=2, eta=0)
    assert trained_per_step(out) == expected  # same prompts, same steps, crash or not
    db = sqlite3.connect(out / "ledger.sqlite")
    gids = sorted(set(open_groups) | restorable)
    rows = db.execute(f"select gid, state, attempt from groups where gid in ({','.join('?' * len(gids))})", gids).fetchall()
    assert len(rows) == len(gids) > 0
    assert all((s, a) == ("trained", 1) for g, s, a in rows if g in restorable), rows  # restored, trained once
    again = [(g, a) for g, s, a in rows if s == "trained" and g not in restorable]
    assert all(a >= 2 for _, a in again), rows  # generated again after the kill, then trained
    assert restorable or again


class Crash(Exception):
    """The driver dies here: no checkpoint is taken, what the ledger committed stays (as under kill -9)."""


def test_buffered_groups_are_restored_not_generated_again(ray_cluster, workdir):
    """one_step keeps groups in the buffer across checkpoints. The driver dies after the checkpoint at step 2
    with groups buffered or step 3 in flight; --resume puts those groups back (payloads from the ledger, their
    original versions, so their staleness counts from the restored trainer version) instead of generating them
    again: each ends trained (or dropped, were it now above the bound) with ledger attempt 1. With keep_checkpoints 2,
    the checkpoints of steps 1 and 2 (the one resumed from) are pruned once steps 3 and 4 are saved."""
    import sqlite3

    from rlflow.runtime.driver import Run

    def dies_after_step_2(run, _event):
        if run.step >= 2 and (run.buffer.kept or run.sink.ref is not None):
            raise Crash(f"the driver dies at step {run.step}")

    plan = plan_for("one_step", "stages.train.steps=4", "stages.train.checkpoint_every=1", "stages.train.keep_checkpoints=2")
    out = Path(".rlflow/runs/restored")
    with pytest.raises(Crash):
        Run(plan, out_dir=out, log=lambda *a: None, hooks=RunHooks(on_event=dies_after_step_2)).run()
    restorable = ledger_restorable(out)
    assert restorable
    resumed = Run(plan, out_dir=out, resume=True, log=lambda *a: None)
    resumed.run()
    assert set(resumed.restored) == restorable
    assert resumed.counts["resume_restored_groups"] == len(restorable)
    assert [h["step"] for h in resumed.history] == [1, 2, 3, 4]
    assert_ledger(out, steps=4, batch=2, eta=1)
    assert sorted(d.name for d in (out / "checkpoint").iterdir() if d.is_dir()) == ["step-3", "step-4"]  # none half pruned
    assert resumed.summary()["checkpoints"] | {"bytes": None} == {"kept": ["step-3", "step-4"], "pruned": 2, "bytes": None}
    db = sqlite3.connect(out / "ledger.sqlite")
    rows = db.execute(f"select gid, state, attempt, step from groups where gid in ({','.join('?' * len(restorable))})",
                      sorted(restorable)).fetchall()
    assert all(a == 1 and (s == "dropped" or (s == "trained" and step > 2)) for _, s, a, step in rows), rows
    assert any(s == "trained" for _, s, _, _ in rows), rows
    spans = db.execute("select count(*), sum(v_min <= v_max) from trajectories where state = 'trained'").fetchone()
    assert spans[0] == spans[1] > 0  # every trained trajectory has its version span on record


def assert_ledger_conserves(run) -> None:
    """From the ledger, one state per group: every admitted group is trained, dropped, aborted or filtered (or
    still open at the end), and those counts match the staleness policy's."""
    import sqlite3

    states = dict(sqlite3.connect(run.out_dir / "ledger.sqlite").execute(
        "select state, count(*) from groups group by state").fetchall())
    c = run.buffer.counters
    assert states.get("trained", 0) == c.consumed, (states, vars(c))
    ended = sum(states.get(k, 0) for k in ("dropped", "aborted", "filtered"))
    assert ended == c.dropped + c.aborted + c.filtered, (states, vars(c))
    assert sum(states.get(k, 0) for k in ("routed", "generated", "buffered")) == c.in_flight + c.pending, (states, vars(c))


def test_killed_reward_worker_loses_nothing(ray_cluster, workdir, monkeypatch):
    """A reward worker (the Score actor of the reward stream's Ray Data actor pool) is SIGKILLed mid-run, in the
    middle of a bundle; Ray restarts it and retries the bundle. From the ledger: every admitted group is trained,
    dropped, aborted or filtered exactly once, none above the bound, and no group's reward counted twice."""
    import json

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    data, marker = workdir / "sums.jsonl", workdir / "reward-worker-killed"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b), "die_once": str(marker)}) + "\n"
                            for a in range(10) for b in range(10)))
    plan = plan_for("one_step", f"data.source={data}", "stages.score.fn=rewards_for_tests:dies_once")
    run = run_plan(plan)
    assert marker.exists()  # the worker died, scoring this prompt
    assert len(run.history) == 3
    assert_as_compiled(run, plan)  # one_step as shipped, but for its data and reward
    assert_accounted(run)
    assert_ledger_conserves(run)
    import sqlite3

    states = [s for p, s in sqlite3.connect(run.out_dir / "ledger.sqlite").execute("select prompt, state from groups")
              if json.loads(p)["prompt"] == marker.read_text()]
    assert states and all(s in ("buffered", "trained", "dropped", "filtered") for s in states), states  # scored after all


def test_missing_data_file_is_a_clear_error(ray_cluster, workdir):
    (workdir / "prompts.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    plan = plan_for("quickstart", f"data.source={workdir / 'prompts.jsonl'}")
    (workdir / "prompts.jsonl").unlink()
    with pytest.raises(PipelineInvalid, match="no such data file"):
        run_plan(plan)


@pytest.mark.vllm
# the staleness policy is engine-independent; staleflow on vLLM is slow (and in 3 steps throughput-aware sync
# may legitimately leave every instance on version 0: seen once) — quickstart covers the engine in a run
@pytest.mark.parametrize("pipeline", ["quickstart", pytest.param("staleflow", marks=pytest.mark.slow)])
def test_pipeline_runs_on_the_vllm_engine(pipeline, ray_cluster, workdir):
    """The same pipelines with `engine: vllm`: AsyncLLM inside the RolloutWorker actors, weights pulled in
    flight; staleflow also drives vLLM through the rollout coordinator."""
    pytest.importorskip("vllm")
    # staleflow's profile was measured on the hf engine: using it for vLLM is an explicit choice
    foreign = ["stages.rollout.coordinator.allow_foreign_profile=true"] if pipeline == "staleflow" else []
    # quickstart: the weights over the collective, into vLLM's workers over their own link; staleflow: auto
    transport = ["edges.4.policy.transport=collective"] if pipeline == "quickstart" else []
    plan = plan_for(pipeline, "stages.rollout.engine=vllm", *foreign, *transport)
    with WeightFileWatch() as files:
        run = run_plan(plan)
    assert not files.seen, f"weights were written to files on the way to vLLM: {sorted(files.seen)[:5]}"
    assert [h["step"] for h in run.history] == [1, 2, 3]
    assert_accounted(run)
    fleet = run.fleets[0]
    assert fleet.pull_s > 0, "no instance pulled a new weights version"
    # every pull verified: the checksum the workers computed from what they received is the trainer's
    assert {v for _, v in fleet.verified} >= {1} and len(fleet.verified) == len(set(fleet.verified))
    if transport:
        assert run.weights.ref.transport == "collective"
    # at least one instance moved on (throughput-aware sync may leave a lightly used one on old weights)
    assert max(inst.version for inst in fleet.instances if inst.alive) >= 1


def small_chunk_hf(model_dir, **kwargs):
    """The hf engine decoding 4 tokens per step instead of 16, so the tiny model's short answers span
    several steps and a snapshot finds them mid-generation (used as `engine: test_run:small_chunk_hf`)."""
    from rlflow.stages.engine_hf import HFEngine

    return HFEngine(model_dir, chunk_size=4, **kwargs)


@pytest.mark.parametrize("variant", [pytest.param("as_planned", marks=pytest.mark.slow), "migrating"])  # as planned: test_pipeline_runs_end_to_end[staleflow]
def test_staleflow_runs_through_the_rollout_coordinator(variant, ray_cluster, workdir, monkeypatch):
    """staleflow.yaml selects cost-model routing, throughput-aware sync with partial rollout and threshold
    migration: routing, sync and migration go through the rollout coordinator (StaleFlow §5.2,
    Algorithm 1), every snapshot validates against the speculative state (Eq. 1), and the invariants hold.

    On the tiny model most answers finish within one 16-token engine step, so snapshots rarely find work
    in flight. "migrating" decodes 4 tokens per step, takes a snapshot every 0.05 s and migrates on any
    throughput gap (phi_throughput = 1 instead of 5), so partial trajectories are interrupted, go back to
    the TS and resume elsewhere, keeping their oldest V_traj.
    """
    migrating = variant == "migrating"
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    extra = ["stages.rollout.engine=test_run:small_chunk_hf", "stages.rollout.coordinator.interval_s=0.05",
             "stages.rollout.coordinator.phi_throughput=1",
             "stages.rollout.coordinator.allow_foreign_profile=true"]  # the hf profile, on the same engine in smaller chunks
    plan = plan_for("staleflow", *(extra if migrating else []))
    run = run_plan(plan)
    assert [h["step"] for h in run.history] == [1, 2, 3]
    assert_accounted(run)
    coord = run.fleets[0].coordination
    assert coord is not None
    assert (coord.coord.cfg.routing, coord.coord.cfg.sync, coord.coord.cfg.migration) == (
        "cost_model", "throughput_aware", "threshold")
    assert coord.coord.cfg.phi_throughput == (1.0 if migrating else 5.0)
    n = run.counts
    assert n["coord_cycles"] > 0 and n["coord_rejected"] == 0 and n["coord_resyncs"] == 0, n
    # every trained trajectory was routed by a Route command; instances were pulled onto newer weights
    assert n["coord_routed"] >= len(run.history) * run.control["batch_size"] * run.fleets[0].group_size, n
    assert n["coord_pulls"] > 0 and max(inst.version for inst in run.fleets[0].instances) >= 1, n
    if migrating:
        assert n["coord_interrupted"] > 0, n
    assert run.history[-1]["coord_routed"] > 0  # the counts are logged with every step (MLflow metrics)


def record_placements(run) -> list:
    """Every lane check the driver makes (it raises InvariantViolation on a group outside its lane)."""
    dispatch = run.fleets[0].dispatch
    placed, check = [], dispatch.check_lane

    def recording(gid, inst, lanes):
        check(gid, inst, lanes)
        placed.append((dispatch.lane(gid), inst))
    dispatch.check_lane = recording
    return placed


def test_streamrl_dispatches_the_predicted_long_tail_to_its_own_instance(ray_cluster, workdir):
    """streamrl.yaml: the learned ranker refits from completed groups, Algorithm 2 splits the two
    instances into a long-tail and a regular lane, and every group runs in its lane (StreamRL §5.3)."""
    from rlflow.runtime.driver import Run

    recorded: dict = {}  # placed: (lane, instance) of each group, from record_placements

    plan = compile_pipeline(REPO / "pipelines" / "streamrl.yaml",
                            ["stages.train.steps=4", "stages.rollout.group_size=4", "tracking.progress=false"])
    run = Run(plan, out_dir=Path(".rlflow/runs/streamrl"), log=lambda *a: None,
              hooks=RunHooks(on_started=lambda run: recorded.update(placed=record_placements(run))))
    run.run()
    assert len(run.history) == 4
    assert_accounted(run)
    n = run.counts
    assert n["ranker_observed"] > 0 and n["dispatch_plans"] > 0, n
    assert n["dispatch_long_groups"] > 0 and n["dispatch_long_instances"] == 1, n
    assert {inst for lane, inst in recorded["placed"] if lane == "long"} == {0}  # the first alive instance is the lane
    assert 0.0 <= run.history[-1]["ranker_recall_top20"] <= 1.0


def test_mixed_tasks_run_on_their_own_rollout_and_reward_stages(ray_cluster, workdir):
    """pipelines/mixed.yaml: two task types, each with its own rollout stage (its own max_new_tokens) and
    reward stage, one buffer and one trainer. Every task is generated, scored and trained, and per-task
    metrics reach MLflow."""
    plan = compile_pipeline(REPO / "pipelines" / "mixed.yaml",
                            ["stages.train.steps=3", "stages.buffer.batch_groups=4", "tracking.progress=false"])
    run = run_plan(plan)
    tasks = plan["tasks"]
    assert len(tasks) == 2 and len({t["rollout"] for t in tasks.values()}) == 2
    assert sorted(f.stage for f in run.fleets) == sorted({t["rollout"] for t in tasks.values()})
    assert len(run.streams) == len({t["reward"] for t in tasks.values()}) == 2
    assert [h["step"] for h in run.history] == [1, 2, 3]
    assert_accounted(run)
    for name, task in tasks.items():
        trained = sum(h[f"task/{name}/trained"] for h in run.history)
        assert trained > 0, (name, run.history)
        cap = plan["pipeline"]["stages"][task["rollout"]]["max_new_tokens"]
        assert all(h[f"task/{name}/length_mean"] is None or h[f"task/{name}/length_mean"] <= cap for h in run.history)
    import mlflow

    metrics = mlflow.get_run(run.tracker.run_id).data.metrics
    assert {f"reward/{name}/mean" for name in tasks} <= set(metrics)


def test_killed_trainer_stops_with_a_clear_message_and_resumes(ray_cluster, workdir):
    """The trainer actor dies mid-run: the run stops with RunFailed naming it and the way to resume (no
    checkpoint can be taken from a dead trainer); --resume continues from the last periodic checkpoint."""
    import ray

    from rlflow.errors import RunFailed
    from rlflow.runtime.driver import Run

    def kill_trainer(run):
        if run.step == 1:  # step 2 is in flight: kill the trainer under it
            ray.kill(run.sink.actor)

    plan = plan_for("quickstart", "stages.train.steps=3", "stages.train.checkpoint_every=1")
    out = Path(".rlflow/runs/trainer-killed")
    with pytest.raises(RunFailed, match=r"trainer died during step 2.*--resume"):
        Run(plan, out_dir=out, log=lambda *a: None, hooks=RunHooks(on_consumed=kill_trainer)).run()
    resumed = Run(plan, out_dir=out, resume=True, log=lambda *a: None)
    resumed.run()
    assert [h["step"] for h in resumed.history] == [1, 2, 3]
    assert_ledger(out, steps=3, batch=2, eta=1)


def test_a_full_disk_during_a_checkpoint_stops_named_and_the_resume_trains_every_step_once(ray_cluster, workdir,
                                                                                           monkeypatch):
    """ENOSPC in the driver's part of step 2's save (fault_points, enospc:state_written@2): the run stops with
    DiskFull (rule disk-full, `rlflow run` exits 3) naming the checkpoint path and the bytes step 1's checkpoint
    took, without a second save attempt; the unpublished tag is gone, state.json names step 1; the resume, space
    back, trains steps 2-3 once each (tests/unit/runtime/test_checkpoint_faults.py fills the disk at every write
    point of a save)."""
    from rlflow.runtime.disk_space import DiskFull
    from rlflow.runtime.driver import Run
    from rlflow.runtime.fault_points import ENV

    plan = plan_for("quickstart", "stages.train.steps=3", "stages.train.checkpoint_every=1")
    out = Path(".rlflow/runs/disk-full")
    monkeypatch.setenv(ENV, "enospc:state_written@2")
    with pytest.raises(DiskFull) as stopped:
        Run(plan, out_dir=out, log=lambda *a: None).run()
    assert str(stopped.value).startswith(f"disk-full: the checkpoint of step 2 failed at {out.absolute() / 'checkpoint'}")
    assert "needed" in str(stopped.value) and stopped.value.rule == "disk-full"
    assert json.loads((out / "state.json").read_text())["checkpoint"]["tag"] == "step-1"
    assert sorted(p.name for p in (out / "checkpoint").iterdir() if p.is_dir()) == ["step-1"]
    monkeypatch.delenv(ENV)
    resumed = Run(plan, out_dir=out, resume=True, log=lambda *a: None)
    resumed.run()
    assert [h["step"] for h in resumed.history] == [1, 2, 3]
    assert_ledger(out, steps=3, batch=2, eta=1)
