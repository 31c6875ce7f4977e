"""train.keep_checkpoints (rlflow/runtime/checkpoint.py prune): the newest N complete tags of the run's history are
kept, the older ones deleted after each published save; the published tag and its fallback, a save in progress, a
tag newer than the published one and an abandoned one never are; a resume after pruning still falls back past a
damaged newest tag. Real save/load/verify with a stand-in trainer that writes one file per tag (no DeepSpeed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlflow.compiler import compile_pipeline
from rlflow.errors import PipelineInvalid
from rlflow.runtime import checkpoint, run_summary
from rlflow.runtime.checkpoint import CHECKPOINT_DIR, STATE_FILE, CheckpointDamaged

REPO = Path(__file__).resolve().parents[3]


class FileTrainer:
    """checkpoint.Trainer with one weights file per tag; its counters are the step it saved or loaded."""

    def __init__(self):
        self.step = 0

    def save(self, directory: str, tag: str, client_state: dict) -> dict:
        (Path(directory) / tag).mkdir()
        (Path(directory) / tag / "weights.bin").write_bytes(bytes(1000) + str(client_state["step"]).encode())
        return {"version": client_state["step"], "optimizer_steps": client_state["step"]}

    def load(self, directory: str, tag: str) -> dict:
        try:
            raw = (Path(directory) / tag / "weights.bin").read_bytes()
        except FileNotFoundError:
            raise CheckpointDamaged("the trainer could not load it") from None
        step = int(raw[1000:])
        return {"client": {"step": step}, "version": step, "optimizer_steps": step}


def save(out: Path, step: int, keep: int | None = None, log=None) -> list[str]:
    """What the driver's _checkpoint does: save, publish, then prune."""
    checkpoint.save(out, FileTrainer(), {"step": step}, log=lambda m: None)
    return checkpoint.prune(out, keep, log=log or (lambda m: None))


def tags(out: Path) -> list[str]:
    return sorted((d.name for d in (out / CHECKPOINT_DIR).iterdir() if d.is_dir()), key=lambda n: (len(n), n))


def published(out: Path) -> str:
    return json.loads((out / STATE_FILE).read_text())["checkpoint"]["tag"]


def test_the_newest_keep_checkpoints_are_kept_and_the_older_ones_pruned(tmp_path):
    said: list[str] = []
    pruned = [t for step in range(10, 110, 10) for t in save(tmp_path, step, keep=3, log=said.append)]
    assert tags(tmp_path) == ["step-80", "step-90", "step-100"] and published(tmp_path) == "step-100"
    assert pruned == [f"step-{s}" for s in range(10, 80, 10)]
    assert said[-1] == "checkpoint: pruned step-70 (keep_checkpoints is 3; kept step-80, step-90, step-100)"
    assert checkpoint.lineage(tmp_path) == ["step-80", "step-90", "step-100"]
    assert [t for t in (tmp_path / CHECKPOINT_DIR).iterdir() if t.name.startswith(".")] == []  # nothing left behind
    inv = checkpoint.inventory(tmp_path)
    assert inv["kept"] == ["step-80", "step-90", "step-100"] and inv["bytes"] == sum(
        p.stat().st_size for p in (tmp_path / CHECKPOINT_DIR).rglob("*") if p.is_file())
    line = run_summary.checkpoints_line(inv | {"pruned": len(pruned)})
    assert line == (f"checkpoints: 3 kept (step-80, step-90, step-100), {inv['bytes'] / 1e6:.1f} MB; "
                    "7 pruned (train.keep_checkpoints)")
    assert line in run_summary.describe({"steps": 100, "checkpoints": inv | {"pruned": 7}}, 100)  # the closing lines


def test_keep_all_prunes_nothing_and_a_keep_below_two_still_keeps_the_fallback(tmp_path):
    for step in (1, 2, 3):
        assert save(tmp_path, step, keep=None) == []
    assert tags(tmp_path) == ["step-1", "step-2", "step-3"]
    assert save(tmp_path, 4, keep=1) == ["step-1", "step-2"]  # the schema says >= 2; prune holds to it regardless
    assert tags(tmp_path) == ["step-3", "step-4"]


def test_the_published_tag_its_fallback_an_unfinished_save_and_unpublished_or_abandoned_tags_are_never_pruned(tmp_path):
    for step in (1, 2, 3, 4):
        save(tmp_path, step)
    pointer = (tmp_path / STATE_FILE).read_bytes()
    save(tmp_path, 5)  # complete, but the run stopped before state.json named it: put the pointer back
    (tmp_path / STATE_FILE).write_bytes(pointer)
    ckpt = tmp_path / CHECKPOINT_DIR
    (ckpt / "step-6").mkdir()  # a save in progress (or killed): DeepSpeed's files, no manifest yet
    (ckpt / "step-6" / "weights.bin").write_bytes(b"half")
    (ckpt / "step-0").mkdir()  # an older rlflow's tag, or a save killed long ago: no manifest either
    (ckpt / checkpoint.ABANDONED).write_text(json.dumps(["step-2"]))  # a history a resume discarded
    # the history is step-1, step-3 and step-4 (published); step-3 is its fallback
    assert checkpoint.prune(tmp_path, 2, log=lambda m: None) == ["step-1"]
    assert tags(tmp_path) == ["step-0", "step-2", "step-3", "step-4", "step-5", "step-6"]
    assert checkpoint.prune(tmp_path, 2, log=lambda m: None) == []


def test_a_resume_after_pruning_falls_back_past_a_damaged_newest_checkpoint_to_a_kept_one(tmp_path):
    for step in range(1, 6):
        save(tmp_path, step, keep=2)
    assert tags(tmp_path) == ["step-4", "step-5"]
    (tmp_path / CHECKPOINT_DIR / "step-5" / "weights.bin").write_bytes(b"torn")
    said: list[str] = []
    state = checkpoint.load(tmp_path, FileTrainer(), source="test", log=said.append)
    assert state["step"] == 4 and state["tag"] == "step-4"
    assert any(m.startswith("checkpoint step-5 is damaged (weights.bin has 4 bytes") for m in said), said
    assert checkpoint.newest(tmp_path, log=lambda m: None)[0] == "step-4"  # rlflow export takes it too


def test_a_prune_killed_between_rename_and_delete_is_never_resumed_from_and_is_cleared_next_time(tmp_path):
    for step in (1, 2, 3):
        save(tmp_path, step)
    ckpt = tmp_path / CHECKPOINT_DIR
    (ckpt / "step-1").rename(ckpt / ".step-1.pruned")  # what prune does first; the process died before the delete
    (ckpt / "step-3" / "weights.bin").write_bytes(b"torn")
    (ckpt / "step-2" / "weights.bin").write_bytes(b"torn")
    with pytest.raises(Exception, match="no complete checkpoint to resume from"):
        checkpoint.load(tmp_path, FileTrainer(), source="test", log=lambda m: None)  # never tries .step-1.pruned
    save(tmp_path, 4, keep=3)
    assert not (ckpt / ".step-1.pruned").exists()


def test_keep_checkpoints_is_lowered_into_the_plan_defaults_to_3_and_is_at_least_2():
    pipeline = REPO / "pipelines" / "quickstart.yaml"
    trainer = lambda plan: next(a for a in plan["actors"] if a["role"] == "trainer")  # noqa: E731
    assert trainer(compile_pipeline(pipeline))["keep_checkpoints"] == 3
    assert trainer(compile_pipeline(pipeline, ["stages.train.keep_checkpoints=5"]))["keep_checkpoints"] == 5
    assert trainer(compile_pipeline(pipeline, ["stages.train.keep_checkpoints=null"]))["keep_checkpoints"] is None
    with pytest.raises(PipelineInvalid, match="keep_checkpoints"):
        compile_pipeline(pipeline, ["stages.train.keep_checkpoints=1"])


def test_a_save_and_its_prune_are_one_line_of_the_run(tmp_path):
    """The driver's _checkpoint says a save and what its prune deleted on one line, not a checkpoint line and a prune
    line every save_every steps."""
    from types import SimpleNamespace

    from rlflow.runtime.driver import Run

    said: list[str] = []
    ledger = SimpleNamespace(flush=lambda: None, checkpointed=lambda step: None)
    run = SimpleNamespace(ledger=ledger, weights=SimpleNamespace(version=0), tracker=SimpleNamespace(run_id="r"),
                          metrics=SimpleNamespace(history=[], staleness_all=[], evals=[]), counts={},
                          model_dir=tmp_path, out_dir=tmp_path, sink=FileTrainer(), log=said.append, pruned=[],
                          plan=SimpleNamespace(trainer=SimpleNamespace(keep_checkpoints=2)))
    for step in (10, 20, 30, 40):
        run.step = step
        Run._checkpoint(run)
    assert tags(tmp_path) == ["step-30", "step-40"] and run.pruned == ["step-10", "step-20"]
    ckpt = tmp_path / CHECKPOINT_DIR
    assert said == [f"checkpoint at step 10: {ckpt / 'step-10'}", f"checkpoint at step 20: {ckpt / 'step-20'}",
                    f"checkpoint at step 30: {ckpt / 'step-30'} (pruned step-10; keep_checkpoints 2)",
                    f"checkpoint at step 40: {ckpt / 'step-40'} (pruned step-20; keep_checkpoints 2)"], said
