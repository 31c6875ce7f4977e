"""Checkpoint and resume: the trainer's DeepSpeed state and the run's state as one unit, published by one rename.

What the driver keeps besides the trainer: the step, the weights version, how many prompts each task has drawn (the
prompt source skips them on resume: its order is fixed by data.seed), the history and counters, and the MLflow run.

Layout of a run directory:

    checkpoint/step-<N>/                   one checkpoint per tag, never overwritten
        mp_rank_00_model_states.pt, ...    DeepSpeed's files (no `latest` file: nothing reads it)
        rlflow_state.json                  the run's state at step N, and the trainer's counters after the save
        rlflow_manifest.json               every file of the tag with its size and sha256
    state.json                             the published checkpoint: its state, its tag, its manifest's sha256

A save writes the tag, then its state, then its manifest, then state.json.tmp, and renames that over state.json:
the rename is the one write that publishes. A process killed anywhere before it leaves state.json naming the
previous checkpoint; the unpublished tag is never read and never overwritten (the next save of step N, after a
resume from an older one, writes step-<N>.1 and says so). rlflow/runtime/fault_points.py names each write point;
tests/unit/runtime/test_checkpoint_faults.py kills a save at every one of them. The checksums cost a read of the checkpoint at
save and again at resume (sha256 at about 1.4 GB/s here: some 10 s for a 1.5B model's weights and Adam moments).

A resume loads the published tag by name, never through DeepSpeed's `latest`, after checking every file against
the manifest (missing, truncated, checksum), then checks the unit agrees with itself: the state's step against the
step the trainer saved in its client_state, the state's weights version and optimizer step count against the
trainer's after the load. A tag that fails the file check or the load is damaged: the resume falls back to the
newest older tag whose manifest holds and says so; a unit that disagrees with itself is refused (RunFailed naming
both numbers), since a checksum-clean checkpoint that contradicts itself is a bug to look at, not a torn write.

Falling back past the last checkpoint the ledger was told of (`Ledger.checkpointed(S)`) loses no trajectory: the
ledger deleted the payloads of groups trained at steps <= S, but `Ledger.resume(S')` for S' < S turns every group
trained after S' back to open, restores those whose payload it still has (and whose tokens the S' weights made),
and lists every other one for replay from its recorded prompt, first, under its own group id. So the groups of
steps S'+1..S are generated again by the restored weights and trained once more in the history that counts; the
steps themselves are trained again (their MLflow rows are logged again). The tags of steps S' and later other than
the one resumed from now hold weights of a discarded history (trained on groups the ledger generates again): they
go into checkpoint/abandoned.json and no later fallback takes them.

Pruning (`prune`, the train stage's keep_checkpoints): after a save is published, the driver keeps the newest
`keep` complete tags of the run's history and deletes the older ones. Never pruned: the published tag and the
newest complete one before it (the fallback when the published one turns out damaged), so `keep` is at least 2; a
tag without a manifest (a save in progress or one that did not finish, or an older rlflow's tag); a tag newer than
the published one; a tag in abandoned.json (kept for a look, as that file says). A pruned tag is first renamed to
`.<tag>.pruned` (one rename: no resume ever sees it half deleted), then deleted; a leftover from a process killed
meanwhile is deleted by the next prune.

A run directory from an rlflow before this layout (state.json without a tag, checkpoint/latest) is resumed from
the tag `latest` names, loaded by name, when the step DeepSpeed saved there agrees with state.json; otherwise it is
refused naming both steps (a crash between the two writes: resuming would train steps twice).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from rlflow.errors import RunFailed
from rlflow.runtime import disk_space
from rlflow.runtime.fault_points import reach

STATE_FILE = "state.json"  # in the run directory: the published checkpoint
CHECKPOINT_DIR = "checkpoint"
TAG_STATE = "rlflow_state.json"
MANIFEST = "rlflow_manifest.json"
ABANDONED = "abandoned.json"  # in checkpoint/: tags of a history a resume discarded (never resumed from again)


class CheckpointDamaged(Exception):
    """A checkpoint tag that cannot be resumed from (missing or truncated file, checksum mismatch, failed load)."""


class Trainer(Protocol):
    """The trainer side of a checkpoint (train_sink.TrainSink; a DeepSpeedTrainer in the unit tests)."""

    def save(self, directory: str, tag: str, client_state: dict) -> dict:
        """Write checkpoint `tag` in `directory`; return {"version", "optimizer_steps"} after it."""

    def load(self, directory: str, tag: str) -> dict:
        """Restore checkpoint `tag`: {"client": saved client_state, "version", "optimizer_steps"}; CheckpointDamaged
        when it cannot be read."""


def resumable(run_dir: Path) -> bool:
    """The run directory has published a checkpoint (launch.find_run looks for runs by it)."""
    return (Path(run_dir) / STATE_FILE).is_file()


# ---------------------------------------------------------------------------------------------- save
def save(out_dir: Path, trainer: Trainer, state: dict, *, log: Callable[[str], None] = print) -> Path:
    """Write checkpoint step-<state["step"]> and publish it; returns its tag directory. A write that fails for lack
    of space raises disk_space.DiskFull (exit 3) after removing the unpublished tag: state.json still names the last
    good checkpoint. Warns first when the free space is below what the last checkpoint took."""
    ckpt = Path(out_dir) / CHECKPOINT_DIR
    try:
        last = json.loads((Path(out_dir) / STATE_FILE).read_text())["checkpoint"]["tag"]
    except (OSError, ValueError, KeyError, TypeError):
        last = None
    needed = disk_space.tree_bytes(ckpt / last) if last else None
    disk_space.check_before_save(Path(out_dir), needed, log)
    written: list[Path] = []
    try:
        return _save(Path(out_dir), ckpt, trainer, state, written, log)
    except Exception as err:
        if not disk_space.disk_full(err, ckpt):
            raise
        for path in written:  # never published: nothing names them, and the space is what the user lacks
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        raise disk_space.DiskFull(f"the checkpoint of step {state['step']}", ckpt, needed, err) from err


def _save(out_dir: Path, ckpt: Path, trainer: Trainer, state: dict, written: list[Path], log) -> Path:
    step = state["step"]
    ckpt.mkdir(parents=True, exist_ok=True)
    tag = _fresh_tag(ckpt, step, log)
    written.append(ckpt / tag)
    counters = trainer.save(str(ckpt), tag, {"step": step})
    reach("trainer_saved", step)
    unit = {**state, "tag": tag, "trainer": counters}
    (ckpt / tag / TAG_STATE).write_text(json.dumps(unit))
    reach("state_written", step)
    files = {str(p.relative_to(ckpt / tag)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted((ckpt / tag).rglob("*")) if p.is_file() and p.name != MANIFEST}
    manifest = json.dumps({"tag": tag, "step": step, "files": files}, indent=1).encode()
    _write_durably(ckpt / tag / MANIFEST, manifest)
    reach("manifest_written", step)
    pointer = {**unit, "checkpoint": {"tag": tag, "manifest_sha256": hashlib.sha256(manifest).hexdigest()}}
    tmp = Path(out_dir) / (STATE_FILE + ".tmp")
    written.append(tmp)
    _write_durably(tmp, json.dumps(pointer).encode())
    reach("pointer_staged", step)
    tmp.replace(Path(out_dir) / STATE_FILE)  # publishes: state.json names a complete checkpoint, or the previous one
    written.clear()  # published: nothing of it is to be removed any more
    _fsync_dir(Path(out_dir))
    reach("published", step)
    return ckpt / tag


def _fresh_tag(ckpt: Path, step: int, log) -> str:
    tag, k = f"step-{step}", 0
    while (ckpt / tag).exists():
        k += 1
        tag = f"step-{step}.{k}"
    if k:
        log(f"checkpoint: tag step-{step} already exists (a save that was never published, or a checkpoint a resume "
            f"fell back from); writing {tag} instead and leaving the other as it is")
    return tag


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------- verify
def verify(tag_dir: Path, manifest_sha256: str | None = None) -> dict:
    """The run state of a complete checkpoint tag, after checking every file against its manifest (and the manifest
    against the digest state.json published, when given); CheckpointDamaged saying what is wrong otherwise."""
    if not tag_dir.is_dir():
        raise CheckpointDamaged(f"its directory {tag_dir} is missing")
    try:
        raw = (tag_dir / MANIFEST).read_bytes()
    except FileNotFoundError:
        raise CheckpointDamaged(f"it has no {MANIFEST} (its save did not finish)") from None
    if manifest_sha256 is not None and hashlib.sha256(raw).hexdigest() != manifest_sha256:
        raise CheckpointDamaged(f"its {MANIFEST} is not the one state.json published (checksum differs)")
    try:
        files = json.loads(raw)["files"]
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointDamaged(f"its {MANIFEST} is unreadable ({err})") from None
    for name, want in files.items():
        path = tag_dir / name
        if not path.is_file():
            raise CheckpointDamaged(f"{name} is missing")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise CheckpointDamaged(f"{name} has {size} bytes, the manifest says {want['bytes']} (truncated or replaced)")
        if _sha256(path) != want["sha256"]:
            raise CheckpointDamaged(f"{name} does not match its sha256 in the manifest")
    if TAG_STATE not in files:
        raise CheckpointDamaged(f"its manifest does not list {TAG_STATE}")
    return json.loads((tag_dir / TAG_STATE).read_text())


def _manifest_step(tag_dir: Path) -> int | None:
    try:
        return int(json.loads((tag_dir / MANIFEST).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def candidates(out_dir: Path, published: dict | None, log) -> list[tuple[str, str | None]]:
    """(tag, manifest digest or None) to try, newest first: the published tag, then every older tag with a manifest.
    Tags newer than the published one were never published (a save the run did not finish): not used, said so."""
    ckpt = Path(out_dir) / CHECKPOINT_DIR
    first = (published or {}).get("checkpoint") or {}
    bound = published["step"] if published else None
    older, incomplete, newer, gone = [], [], [], abandoned(ckpt)
    for d in sorted(ckpt.iterdir()) if ckpt.is_dir() else []:
        if not d.is_dir() or d.name.startswith(".") or d.name == first.get("tag") or d.name in gone:
            continue
        step = _manifest_step(d)
        if step is None:
            incomplete.append(d.name)
        elif bound is not None and step >= bound:
            newer.append(d.name)
        else:
            older.append((step, d.stat().st_mtime, d.name))
    for names, why in ((incomplete, "no manifest: a save that did not finish, or an older rlflow's tag"),
                       (newer, "complete but never published: the run stopped before state.json named it")):
        if names:
            log(f"checkpoint: not resuming from {', '.join(names)} in {ckpt} ({why})")
    ordered = [(first["tag"], first.get("manifest_sha256"))] if first.get("tag") else []
    return ordered + [(name, None) for _, _, name in sorted(older, reverse=True)]


def abandoned(ckpt: Path) -> set[str]:
    try:
        return set(json.loads((ckpt / ABANDONED).read_text()))
    except (OSError, ValueError):
        return set()


def _abandon(ckpt: Path, resumed: str, step: int, log) -> None:
    """After a resume from `resumed` (step `step`): every other complete tag at `step` or later holds weights of a
    history this resume discards (trained past `step` on groups the ledger now generates again), so no later
    fallback may take it. Listed in checkpoint/abandoned.json, not deleted."""
    gone = abandoned(ckpt)
    new = sorted(d.name for d in ckpt.iterdir() if d.is_dir() and not d.name.startswith(".") and d.name != resumed
                 and d.name not in gone
                 and (_manifest_step(d) if _manifest_step(d) is not None else -1) >= step)
    if not new:
        return
    tmp = ckpt / (ABANDONED + ".tmp")
    _write_durably(tmp, json.dumps(sorted(gone | set(new))).encode())
    tmp.replace(ckpt / ABANDONED)
    log(f"checkpoint: {', '.join(new)} left out of this run from now on (a history after step {step} that this resume "
        f"discards); listed in {ckpt / ABANDONED}, not deleted")


# ---------------------------------------------------------------------------------------------- prune
PRUNED = ".pruned"  # suffix of a tag directory being deleted: `.<tag>.pruned`, never read


def lineage(out_dir: Path) -> list[str]:
    """The complete tags a resume may take, oldest first: the published one and every older tag with a manifest that
    no resume abandoned (the order `candidates` tries them in, reversed)."""
    try:
        published = json.loads((Path(out_dir) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return []
    if "checkpoint" not in published:  # an older rlflow's layout: nothing of it is ours to order
        return []
    return [tag for tag, _ in reversed(candidates(out_dir, published, lambda _: None))]


def prune(out_dir: Path, keep: int | None, log: Callable[[str], None] = print) -> list[str]:
    """Delete all but the newest `keep` tags of the run's history (None: keep all); returns the tags deleted. Called
    by the driver right after a save is published (never while one is being written); see the module docstring for
    what is never pruned."""
    ckpt = Path(out_dir) / CHECKPOINT_DIR
    for leftover in ckpt.glob(f".*{PRUNED}") if ckpt.is_dir() else []:  # a prune killed between rename and delete
        shutil.rmtree(leftover, ignore_errors=True)
    if keep is None:
        return []
    tags = lineage(out_dir)
    doomed = tags[:-max(keep, 2)]  # the published tag and its fallback, whatever `keep` says
    for tag in doomed:
        hidden = ckpt / f".{tag}{PRUNED}"
        (ckpt / tag).rename(hidden)  # atomic: from here on no resume or export considers it
        shutil.rmtree(hidden, ignore_errors=True)
    if doomed:
        _fsync_dir(ckpt)
        log(f"checkpoint: pruned {', '.join(doomed)} (keep_checkpoints is {keep}; kept {', '.join(tags[len(doomed):])})")
    return doomed


def saved_line(step: int, path: Path, pruned: list[str], keep: int | None) -> str:
    """The one line a published save gets, with what its prune deleted: `checkpoint at step 30: <path> (pruned
    step-10; keep_checkpoints 2)`."""
    return f"checkpoint at step {step}: {path}" + (f" (pruned {', '.join(pruned)}; keep_checkpoints {keep})"
                                                   if pruned else "")


def inventory(out_dir: Path) -> dict:
    """What the run's checkpoints cost: the tags of its history, oldest first, and the bytes of everything in
    checkpoint/ (abandoned and unfinished tags included)."""
    return {"kept": lineage(out_dir), "bytes": disk_space.tree_bytes(Path(out_dir) / CHECKPOINT_DIR)}


# ---------------------------------------------------------------------------------------------- load
def load(out_dir: Path, trainer: Trainer, *, source: str, log: Callable[[str], None] = print) -> dict:
    """Restore the newest complete checkpoint into `trainer`; returns its run state (state["step"] is the step the run,
    and the ledger, resume from). Falls back past damaged tags, saying so."""
    out_dir = Path(out_dir)
    path = out_dir / STATE_FILE
    if not path.exists():
        from rlflow.errors import PipelineInvalid, Problem

        raise PipelineInvalid(source, [Problem((), f"no checkpoint to resume from in {out_dir}", "no-checkpoint",
                                               "run without --resume first (Ctrl-C saves a checkpoint)")])
    try:
        published = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        log(f"checkpoint: {path} is unreadable ({err}); resuming from the newest complete checkpoint instead")
        published = None
    if published is not None and "checkpoint" not in published:
        return _load_old_layout(out_dir, trainer, published, log)
    ckpt, damaged = out_dir / CHECKPOINT_DIR, []
    for tag, digest in candidates(out_dir, published, log):
        try:
            state = verify(ckpt / tag, digest)
            loaded = trainer.load(str(ckpt), tag)
        except CheckpointDamaged as err:
            damaged.append(f"{tag}: {err}")
            log(f"checkpoint {tag} is damaged ({err}); trying the previous complete checkpoint")
            continue
        agree(tag, state, loaded)
        _abandon(ckpt, tag, state["step"], log)
        if damaged:
            log(f"resuming from checkpoint {tag} (step {state['step']}), not the newest: {'; '.join(damaged)}. The steps "
                f"after {state['step']} are trained again; the ledger generates their groups again from their prompts")
        return state
    raise RunFailed(f"no complete checkpoint to resume from in {ckpt}: " + ("; ".join(damaged) or "it holds none")
                    + ". Start a new run (without --resume)")


def newest(out_dir: Path, log: Callable[[str], None] = print) -> tuple[str, dict] | None:
    """(tag, run state) of the newest complete checkpoint, its files checked against its manifest but not loaded
    (`rlflow export`); None when the run directory has none. Falls back past damaged tags, saying so."""
    path = Path(out_dir) / STATE_FILE
    if not path.is_file():
        return None
    try:
        published = json.loads(path.read_text())
    except (OSError, ValueError):
        published = None
    if published is not None and "checkpoint" not in published:  # an older rlflow's run directory
        latest = Path(out_dir) / CHECKPOINT_DIR / "latest"
        return (latest.read_text().strip(), published) if latest.is_file() else None
    for tag, digest in candidates(out_dir, published, log):
        try:
            return tag, verify(Path(out_dir) / CHECKPOINT_DIR / tag, digest)
        except CheckpointDamaged as err:
            log(f"checkpoint {tag} is damaged ({err}); trying the previous complete checkpoint")
    return None


def agree(tag: str, state: dict, loaded: dict) -> None:
    """RunFailed, naming both numbers, where the run state and the trainer's restored counters disagree."""
    saved = state.get("trainer") or {}
    pairs = [("step", state["step"], "step its trainer checkpoint saved", (loaded.get("client") or {}).get("step")),
             ("weights version", saved.get("version"), "trainer's weights version after the load", loaded.get("version")),
             ("optimizer step count", saved.get("optimizer_steps"), "trainer's optimizer step count after the load",
              loaded.get("optimizer_steps"))]
    bad = [f"the run state's {what} is {mine} but the {theirs} is {got}" for what, mine, theirs, got in pairs
           if mine is not None and mine != got]
    if bad:
        raise RunFailed(f"checkpoint {tag} disagrees with itself: {'; '.join(bad)}. Resuming would train steps twice or "
                        f"skip them, so it is refused; move {tag} out of the checkpoint directory to resume from the "
                        "previous complete checkpoint, or start a new run")


def _load_old_layout(out_dir: Path, trainer: Trainer, state: dict, log) -> dict:
    """state.json + checkpoint/latest, from an rlflow before published tags: resumed only where the two agree."""
    ckpt = out_dir / CHECKPOINT_DIR
    latest = ckpt / "latest"
    if not latest.is_file():
        raise RunFailed(f"{out_dir / STATE_FILE} names no checkpoint tag and {latest} is missing: no checkpoint to "
                        "resume from. Start a new run (without --resume)")
    tag = latest.read_text().strip()
    try:
        loaded = trainer.load(str(ckpt), tag)
    except CheckpointDamaged as err:
        raise RunFailed(f"the DeepSpeed checkpoint {tag} that {latest} names cannot be resumed from: {err}. Start a new "
                        "run (without --resume)") from None
    got = (loaded.get("client") or {}).get("step")
    if got != state["step"]:
        raise RunFailed(f"{out_dir / STATE_FILE} says step {state['step']} but the DeepSpeed checkpoint {tag} that "
                        f"{latest} names holds step {got} (written by an rlflow before checkpoints were published as "
                        "one unit: the run stopped between the two writes). Resuming would train steps twice, so it is "
                        f"refused; write the tag of step {state['step']} into {latest} if it exists, or start a new run")
    log(f"checkpoint: resuming a run directory of an older rlflow from {tag} (step {got}, as state.json says); "
        "checkpoints from now on are published as one unit")
    return state
