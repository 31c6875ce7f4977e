"""What a run was started with, and what `rlflow run --resume` may change.

At a run's first start `record` writes `fingerprint.json` into its directory:
- the settings that shape the ledger and the trainer, one group per rule: groups per step, each rollout stage's
  group size, the algorithm (and LoRA), the model (path, dtype, config.json, each weight file's size and the sha256
  of its first and last MiB), the tokenizer files, the reward functions and filters;
- each training data file: size, mtime and the sha256 of each MiB of its first HASHED_BYTES (the rows drawn first);
- each user module the plan names (a reward, filter, env, tool): the sha256 of its files;
- the rest of the resolved pipeline, to say what else changed.

`check` (launch.py, before Ray starts) compares a resume's plan and inputs with that record. A change that would
break the run's invariants is refused, one named rule per kind (exit 2, old and new shown, the way out); anything
else is applied and said in one line, and the record is brought up to date.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from pathlib import Path

from rlflow.errors import PipelineInvalid, Problem
from rlflow.plan_model import Plan
from rlflow.user_code import search_dirs

FINGERPRINT_FILE = "fingerprint.json"  # in each run directory
VERSION = 1
CHUNK_BYTES = 1 << 20  # one hash per MiB of a data file: a replaced file is named with where it first differs
HASHED_BYTES = 64 << 20  # a data file's first 64 MiB are hashed (~50 ms); past it only its size is compared
SAMPLE_BYTES = 1 << 20  # a weight file: the sha256 of its first and last MiB (a fine-tune rewrites both)

#: rule -> what it guards, as the refusal names it
RULES = {
    "resume-changed-batch": "the batch",
    "resume-changed-group-size": "the group size",
    "resume-changed-algorithm": "the algorithm",
    "resume-changed-model": "the model",
    "resume-changed-tokenizer": "the tokenizer",
    "resume-changed-reward": "the reward",
    "resume-changed-data": "the training data",
    "resume-changed-code": "the user code",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "merges.txt", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja")


# ---------------------------------------------------------------------------------------------- recording
def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _chunks(path: Path, size: int, limit: int) -> list[str]:
    """sha256 of each CHUNK_BYTES of the file's first min(size, limit) bytes (the last chunk may be short)."""
    out, left = [], min(size, limit)
    with open(path, "rb") as f:
        while left > 0:
            block = f.read(min(CHUNK_BYTES, left))
            if not block:
                break
            out.append(_sha(block))
            left -= len(block)
    return out


def _data_file(path: Path, against: dict | None = None, limit: int | None = None) -> dict:
    """A data file's identity, its first `limit` bytes hashed (default HASHED_BYTES); `against` (its recorded entry):
    also the hashes of the same byte ranges now, so an append (those ranges unchanged, the file longer) is told from a
    replacement."""
    limit = HASHED_BYTES if limit is None else limit
    try:
        st = path.stat()
    except OSError:
        return {"missing": True}
    entry = {"size": st.st_size, "mtime": st.st_mtime, "chunks": _chunks(path, st.st_size, limit)}
    if against and "size" in against and against["size"] < st.st_size:
        entry["prefix"] = _chunks(path, against["size"], limit)
    return entry


def _data_source(src: str, against: dict | None) -> dict:
    """A task's source: a file, a directory of files (a `datasets` directory), or rows made by code."""
    from rlflow.data_sources import generated

    if generated(src):
        return {"source": src}
    path = Path(src)
    if path.is_dir():  # a `datasets` directory: each file's size and first MiB (its shards can be many and large)
        files = sorted(p for p in path.rglob("*") if p.is_file())
        old = (against or {}).get("files") or {}
        return {"source": src, "files": {str(p.relative_to(path)): _data_file(p, old.get(str(p.relative_to(path))),
                                                                              CHUNK_BYTES) for p in files}}
    return {"source": src, **_data_file(path, against)}


def _sampled(path: Path) -> dict:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(SAMPLE_BYTES)
        f.seek(max(size - SAMPLE_BYTES, 0))
        tail = f.read(SAMPLE_BYTES)
    return {"size": size, "sha256_head_tail": _sha(head + tail)}


def _model(spec: dict) -> tuple[dict, dict]:
    """(the model's identity, its tokenizer's): for a built-in model its name (built the same from the plan)."""
    model = {"path": spec["path"], "dtype": spec.get("dtype")}
    path = Path(spec["path"])
    if spec["path"].startswith("builtin:"):
        return model, {"path": spec["path"]}
    if not path.is_dir():  # gone: launch.preflight names it (bad-model-path), not a change
        return model | {"missing": True}, {"missing": True}
    from rlflow.runtime.model import WEIGHT_FILES, WEIGHT_INDEXES

    files = {p.name: p for p in path.iterdir() if p.is_file()}
    model["config.json"] = _sha(files["config.json"].read_bytes()) if "config.json" in files else None
    weights = [n for n in (*WEIGHT_FILES, *WEIGHT_INDEXES) if n in files]
    weights += sorted(n for n in files if n.endswith(".safetensors") and n not in weights)  # shards
    model["weights"] = {n: _sampled(files[n]) for n in weights}
    return model, {n: _sha(files[n].read_bytes()) for n in TOKENIZER_FILES if n in files}


def _refs(plan: Plan) -> dict[str, str]:
    """Each user import string the plan names (`module:attr`; user_code_check.references finds them), with what
    names it: 'reward' (a reward or filter) or 'code'."""
    from rlflow import registry
    from rlflow.runtime.user_code_check import references

    out: dict[str, str] = {}
    for _, category, ref in references(plan.pipeline):
        ref = ref.get("fn") if isinstance(ref, dict) else ref  # a tool's schema dict: its fn is the code
        if not isinstance(ref, str):
            continue
        if category == "task":
            ref = registry.adapter_target("task", ref) or ref
        out[ref] = "reward" if category in ("reward", "filter") or out.get(ref) == "reward" else "code"
    return {r: w for r, w in out.items() if ":" in r and not r.startswith("builtin:") and "://" not in r}


def _module_files(module: str, dirs: list[Path]) -> list[Path]:
    """The files of the user's top-level module (`module`'s first part) in `dirs`: a file, or a package's .py files;
    [] for an installed package (not the user's code)."""
    from rlflow.user_code import _found_without

    top = module.split(".")[0]
    if _found_without(top, dirs):
        return []
    for d in dirs:
        if (d / f"{top}.py").is_file():
            return [d / f"{top}.py"]
        if (d / top / "__init__.py").is_file():
            return sorted(p for p in (d / top).rglob("*.py") if "__pycache__" not in p.parts)
    return []


def fingerprint(plan: Plan, against: dict | None = None) -> dict:
    """What the run is started (or resumed) with; `against`: the recorded fingerprint (data files are compared by the
    byte ranges it hashed)."""
    pipeline = plan.pipeline
    train = pipeline["stages"][plan.trainer.stage]
    model, tokenizer = _model(plan.model)
    refs = _refs(plan)
    rewards = {f"stages.{name}.{k}": s.get(k) for name, s in pipeline["stages"].items() if s.get("kind") == "reward"
               for k in ("fn", "model", "judge", "http", "scorers")}
    rewards |= {f"edges[{i}].policy.filter": e["policy"].get("filter") for i, e in enumerate(pipeline["edges"])
                if (e.get("policy") or {}).get("filter")}
    settings = {
        "resume-changed-batch": {"groups per step": plan.staleness.batch_size},
        "resume-changed-group-size": {f"stages.{a.stage}.group_size": a.group_size for a in plan.rollouts()},
        "resume-changed-algorithm": {f"stages.{plan.trainer.stage}.{k}": train.get(k) for k in ("algo", "backend", "lora")},
        "resume-changed-model": model,
        "resume-changed-tokenizer": tokenizer,
        "resume-changed-reward": rewards,
    }
    old_data = (against or {}).get("data") or {}
    data = {task: _data_source(t.source, old_data.get(task)) for task, t in plan.tasks.items()}
    code: dict[str, dict] = {}
    # where compile finds user code (the plan's python_path; beside the pipeline and in the working directory)
    dirs = list(dict.fromkeys([Path(d).resolve() for d in plan.python_path]
                              + [d for _, d in search_dirs(Path(plan.source).resolve().parent)]))
    for ref, what in refs.items():
        module = ref.partition(":")[0]
        files = _module_files(module, dirs)
        if files:
            entry = code.setdefault(module.split(".")[0], {"rule": f"resume-changed-{what}", "named_by": [], "files": {}})
            entry["named_by"].append(ref)
            entry["files"] = {str(p): _sha(p.read_bytes()) for p in files}
            if what == "reward":
                entry["rule"] = "resume-changed-reward"
    return {"version": VERSION, "settings": settings, "data": data, "code": code, "pipeline": pipeline}


def record(plan: Plan, run_dir: Path) -> dict:
    """Write the run's fingerprint (at its first start; again after a resume that applied changes)."""
    fp = fingerprint(plan)
    tmp = Path(run_dir) / f".{FINGERPRINT_FILE}.tmp"
    tmp.write_text(json.dumps(fp, indent=1) + "\n")
    os.replace(tmp, Path(run_dir) / FINGERPRINT_FILE)
    return fp


# ---------------------------------------------------------------------------------------------- comparing
def _shown(v) -> str:
    if isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v):
        return f"sha256 {v[:12]}"
    return json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else repr(v)


def _flat(d, prefix: str = "") -> dict:
    """{'edges[3].policy.eta': 1, ...}: each leaf by its path, as --set names it."""
    if isinstance(d, dict) and d:
        return {k: v for key, sub in d.items() for k, v in _flat(sub, f"{prefix}.{key}" if prefix else key).items()}
    if isinstance(d, list) and d:
        return {k: v for i, sub in enumerate(d) for k, v in _flat(sub, f"{prefix}[{i}]").items()}
    return {prefix: d}


def _file_change(src: str, old: dict, new: dict) -> tuple[str, str | None]:
    """('same' | 'appended' | 'replaced', what to say) for one data file's recorded and current identity."""
    if new.get("missing"):
        return "replaced", f"'{src}' is gone"
    if old.get("missing"):
        return "replaced", f"'{src}' exists now and did not when the run started"
    if new["size"] == old["size"] and new["chunks"] == old["chunks"]:
        touched = new["mtime"] != old["mtime"] and new["size"] > HASHED_BYTES
        return "same", (f"'{src}' was modified (mtime) but its size and first {HASHED_BYTES >> 20} MiB are unchanged: "
                        "taken as the same file" if touched else None)
    if new["size"] > old["size"] and new.get("prefix") == old["chunks"]:
        return "appended", f"'{src}' grew from {old['size']} to {new['size']} bytes, its first {old['size']} unchanged"
    differs = next((i for i, (a, b) in enumerate(zip(old["chunks"], new.get("chunks", []))) if a != b), None)
    lo = differs * CHUNK_BYTES if differs is not None else None
    where = f", first different in bytes {lo}-{min(lo + CHUNK_BYTES, old['size'], new['size'])}" if lo is not None else ""
    return "replaced", f"'{src}' was {old['size']} bytes, is {new['size']}{where}"


def _data_changes(old: dict, new: dict) -> tuple[list[str], list[str]]:
    """(refused, applied) differences of the tasks' data sources."""
    refused, applied = [], []
    for task in sorted(set(old) | set(new)):
        if task not in new or task not in old:
            refused.append(f"task '{task}' {'is gone' if task not in new else 'was added'}")
            continue
        o, n = old[task], new[task]
        if ("files" in o) != ("files" in n) or ("size" in o or "missing" in o) != ("size" in n or "missing" in n):
            refused.append(f"task '{task}': source {o['source']!r} -> {n['source']!r}")
            continue
        if "files" in o:  # a directory: every file the same
            names = set(o["files"]) | set(n["files"])
            gone = sorted(names - set(n["files"])) + sorted(names - set(o["files"]))
            said = [f"{'removed' if f in o['files'] else 'added'} {f}" for f in gone]
            said += [why for f in sorted(set(o["files"]) & set(n["files"]))
                     for kind, why in [_file_change(f, o["files"][f], n["files"][f])] if kind != "same" and why]
            if said:
                refused.append(f"task '{task}': directory '{n['source']}' changed ({'; '.join(said)})")
            continue
        if "size" not in o and "missing" not in o:  # rows made by code: by name
            if o["source"] != n["source"]:
                refused.append(f"task '{task}': source {o['source']!r} -> {n['source']!r}")
            continue
        kind, why = _file_change(n["source"], o, n)
        # Appended rows are applied, by choice: consumption is by order. Rows come in file order through a shuffle
        # window (prompt_source.py SHUFFLE_WINDOW) and a resume skips, by count, the rows drawn before its checkpoint;
        # those came from the file's head, which is unchanged, and the appended rows join the draw after them. (Where
        # the old end of the file lay within a window of the rows drawn, the order after the resume differs from an
        # uninterrupted run's; no row is lost to the ledger and no group is trained twice.) A replaced file is refused.
        if why:
            (refused if kind == "replaced" else applied).append(f"task '{task}': {why}")
    return refused, applied


def compare(old: dict, new: dict) -> tuple[list[tuple[str, str]], list[str]]:
    """What changed from the recorded fingerprint `old` to `new`: ([(rule, message)] refused, [message] applied)."""
    refused: list[tuple[str, str]] = []
    for rule, was in old["settings"].items():
        now = new["settings"].get(rule, {})
        if now.get("missing"):
            continue
        a, b = _flat(was), _flat(now)
        diffs = [f"{k} {_shown(a.get(k))} -> {_shown(b.get(k))}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        if diffs:
            refused.append((rule, f"{RULES[rule]} changed since the run started: {'; '.join(diffs)}"))
    data_refused, applied = _data_changes(old.get("data") or {}, new.get("data") or {})
    refused += [("resume-changed-data", f"{RULES['resume-changed-data']} changed since the run started: {m}")
                for m in data_refused]
    for top, entry in sorted((old.get("code") or {}).items()):
        now = ((new.get("code") or {}).get(top) or {}).get("files") or {}
        changed = [f"{Path(f).name} {'is gone' if f not in now else 'was edited'}" for f, sha in entry["files"].items()
                   if now.get(f) != sha]
        if changed:
            refused.append((entry["rule"], f"{RULES[entry['rule']]} changed since the run started: user module "
                                           f"'{top}' (named by {', '.join(entry['named_by'])}): {', '.join(changed)}"))
    a, b = _flat(old.get("pipeline") or {}), _flat(new.get("pipeline") or {})
    applied += [f"{k} {_shown(a.get(k))} -> {_shown(b.get(k))}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return refused, applied


def way_out(rule: str, plan: Plan, run_dir: Path) -> str:
    """How to go on: undo the change, or start a new run from the checkpoint's weights (rlflow export, then a run
    whose model.path is the export)."""
    if rule in ("resume-changed-model", "resume-changed-tokenizer"):
        return ("the checkpoint was trained from the model the run started with: restore it to resume, or start a new "
                "run (rlflow run without --resume)")
    lora = plan.trainer.trainer_kwargs.get("lora")
    out = Path(run_dir) / "checkpoint-export"
    weights = out / "merged" if lora else out
    overrides = [o for o in plan.overrides if not o.startswith("model.path=")] + [f"model.path={weights}"]
    export = ["rlflow", "export", str(run_dir), "-o", str(out)] + (["--merged"] if lora else [])
    return (f"undo the change to resume this run, or start a new run (step 0, a fresh ledger) from its checkpoint's "
            f"weights: {shlex.join(export)} && {shlex.join(['rlflow', 'run', plan.source, *overrides])}")


def check(plan: Plan, run_dir: Path, log=print) -> None:
    """Before a resume starts Ray: PipelineInvalid (exit 2) for each refused change, else say what is applied and
    record the run's inputs as they are now."""
    path = Path(run_dir) / FINGERPRINT_FILE
    try:
        old = json.loads(path.read_text())
        if old.get("version") != VERSION:
            raise ValueError(f"version {old.get('version')}")
    except (OSError, ValueError, AttributeError) as err:
        why = "none recorded (a run started by an older rlflow)" if not path.exists() else f"unreadable ({err})"
        log(f"resume: run {Path(run_dir).name} has no fingerprint of its inputs, {why}: nothing compared; "
            "recorded now for later resumes")
        record(plan, run_dir)
        return
    refused, applied = compare(old, fingerprint(plan, against=old))
    if refused:
        raise PipelineInvalid(plan.source, [Problem(("--resume",), message, rule, way_out(rule, plan, run_dir))
                                            for rule, message in refused])
    if applied:
        log(f"resume: applied what changed since the run started: {'; '.join(applied)}")
        record(plan, run_dir)
