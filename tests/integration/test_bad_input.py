"""Bad input at run time fails the way rlflow promises, on the real stack: invalid input is PipelineInvalid (exit 2,
one line) naming the field, found before the actors it would break; a broken reward stops the run with a clear
message instead of running forever; every run has its own directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import runs
from runs import REPO

from rlflow.errors import PipelineInvalid
from rlflow.plan_model import Plan

pytestmark = pytest.mark.integration
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 128, "vocab_size": 384}


def plan_for(name: str, *extra: str) -> dict:
    return runs.plan_for(name, "stages.train.steps=2", *extra)


def failed_run(plan: dict, error=PipelineInvalid):
    """Runs the plan expecting `error`; returns (the Run, the error)."""
    from rlflow.runtime.driver import Run

    run = Run(plan, out_dir=Path(".rlflow") / "runs" / plan["name"], log=lambda *a: None)
    with pytest.raises(error) as e:
        run.run()
    return run, e.value


def only_problem(err: PipelineInvalid):
    (p,) = err.problems
    return p


# ------------------------------------------------------------------------------------------ model, DeepSpeed config
@pytest.mark.parametrize("breakage", ["vanished", "no weights"])
def test_model_directory_gone_or_not_a_model_stops_before_any_actor(workdir, breakage):
    model = workdir / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))  # enough for compile, which reads the config only
    (model / "tokenizer.json").write_text("{}")
    plan = plan_for("quickstart", f"model.path={model}")
    if breakage == "vanished":
        shutil.rmtree(model)
    run, err = failed_run(plan)
    p = only_problem(err)
    assert (p.loc, p.rule) == (("model", "path"), "bad-model-path")
    assert ("no longer exists" if breakage == "vanished" else "has no model weights") in p.message
    assert not hasattr(run, "store") and not hasattr(run, "sink")  # no actor was started


@pytest.mark.parametrize("breakage", ["deleted", "corrupted"])
def test_deepspeed_config_deleted_or_corrupted_after_compile(ray_cluster, workdir, breakage):
    ds = workdir / "ds.json"
    shutil.copy(REPO / "configs" / "deepspeed" / "zero1.json", ds)
    plan = plan_for("quickstart", f"stages.train.deepspeed={ds}")
    if breakage == "deleted":
        ds.unlink()
    else:
        ds.write_text('{"zero_optimization": {"stage": 1}')
    run, err = failed_run(plan)
    p = only_problem(err)
    assert p.loc == ("stages", "train", "deepspeed")
    assert p.rule == ("missing-file" if breakage == "deleted" else "bad-json")
    assert not hasattr(run, "sink")  # the trainer actor was never created


# ------------------------------------------------------------------------------------------ data rows
def write_rows(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def changed_since_compile(path: Path, rows: list) -> dict:
    """The quickstart plan over `path`, compiled while the file was good; then the file is rewritten with `rows`
    (a compiled plan run later, against a file that changed since: compile's own check of the file's head has passed)."""
    good = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)]
    write_rows(path, good)
    plan = plan_for("quickstart", f"data.source={path}")
    write_rows(path, rows)
    return plan


def test_row_without_an_answer_stops_the_run_naming_task_and_line(ray_cluster, workdir):
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)]
    rows[3] = {"prompt": "3+1="}  # no answer: trained as the text "None" before
    rows[5] = {"prompt": "5+1=", "answer": None}
    path = workdir / "prompts.jsonl"
    run, err = failed_run(changed_since_compile(path, rows))
    p = only_problem(err)
    assert (p.loc, p.rule) == (("data", "source"), "missing-answer")
    assert p.message == f"task 'main': '{path}' line 4 has no answer ('answer' is missing or null)"
    assert run.history == [] and run.clock.marks == {}  # before the model was prepared or any actor started


def test_malformed_jsonl_line_is_invalid_input(ray_cluster, workdir):
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)]
    path = workdir / "prompts.jsonl"
    run, err = failed_run(changed_since_compile(path, rows[:3] + ['{"prompt": "9+1=", "answer": 10'] + rows[3:]))
    p = only_problem(err)
    assert (p.loc, p.rule) == (("data", "source"), "bad-data") and f"cannot read '{path}' line 4: not JSON" in p.message, p.message
    assert run.clock.marks == {}


# ------------------------------------------------------------------------------------------ rewards
def test_reward_returning_text_stops_the_run_with_a_clear_message(ray_cluster, workdir, monkeypatch):
    """Every trajectory fails (a str is not a reward): the reward stream stops the run once its last 64 answers all
    failed instead of running forever with 0 steps."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    run, err = failed_run(plan_for("quickstart", "stages.score.fn=rewards_for_tests:always_text"), RuntimeError)
    assert "reward stage 'score' failed: 64 of the last 64 answers failed (in " in str(err)
    assert " groups; last: rewards_for_tests:always_text returned " in str(err)
    assert "(str), not a number); fix the reward function 'rewards_for_tests:always_text'" in str(err)
    assert run.history == [] and run.counts["reward_failed"] >= 64


def test_slow_reward_times_out_inside_the_reward_actor(ray_cluster, workdir, monkeypatch):
    """The timeout works inside a Ray Data actor (which runs the reward in a child process, reward_process.py): a
    reward that sleeps fails its trajectory after REWARD_TIMEOUT_S, later groups still score."""
    from test_streams import collect, put_group, stream

    from rlflow.runtime import reward_stream

    monkeypatch.setattr(reward_stream, "REWARD_TIMEOUT_S", 0.5)
    probe = workdir / "probe.txt"
    with stream("rewards_for_tests:sleepy") as (store, _, out):
        put_group(store, "slow", ["2", "3"], sleep=30, probe=str(probe))
        put_group(store, "fast", ["2", "3"], sleep=0, probe=str(probe))
        got = collect(out, 4, timeout_s=60)
    assert got["slow/0"]["reward_error"] == got["slow/1"]["reward_error"] == "rewards_for_tests:sleepy timed out after 0.5 s"
    assert got["fast/0"]["reward"] == 1.0 and got["fast/0"]["reward_error"] == ""
    assert probe.read_text().split() == ["True"] * 4  # the reward process's main thread: each call was made once


# ------------------------------------------------------------------------------------------ run directories
@pytest.mark.slow  # two full runs; the run-directory logic is covered by tests/unit/runtime/test_run_dirs.py
def test_two_runs_get_their_own_directories_and_resume_takes_the_newest(ray_cluster, workdir):
    from rlflow.runtime.launch import launch, new_run_dir

    plan = plan_for("synchronous", "stages.train.steps=1")
    said = []
    first = launch(plan, log=said.append)
    run_dir = Path(first["run_dir"])
    other = new_run_dir(Plan.of(plan))  # a later run of the same pipeline, in the same working dir, not checkpointed yet
    assert run_dir != other and run_dir.parent == other.parent == Path(".rlflow/runs/synchronous")
    assert f"run directory: {run_dir}" in said
    assert (run_dir / "state.json").is_file() and not (other / "state.json").exists()  # each its own state
    resumed = launch(plan, resume=True, log=said.append)  # the newest run with a checkpoint: 1 step done of 1
    assert Path(resumed["run_dir"]) == run_dir and f"resuming directory: {run_dir}" in said
    assert f"resuming run {run_dir.name}: the newer run(s) {other.name} have no checkpoint" in said
    assert resumed["steps"] == 1 and sorted(p.name for p in run_dir.parent.iterdir()) == sorted([run_dir.name, other.name])
