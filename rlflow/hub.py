"""Hugging Face Hub ids as model and data references, resolved offline from the local Hub cache.

`model.path: Qwen/Qwen2.5-0.5B-Instruct`, a reward model, judge, critic or distillation teacher named the same way,
and `data.source: openai/gsm8k` (or a task's source, or `data.eval`) are Hub ids when they are `org/name` (one
slash, no leading `./` or `/`), optionally `org/name@revision` (a branch, tag or commit) and, for a dataset with
several configs (subsets), `org/name:config` (`openai/gsm8k:main@<commit>`), and no local path of that name exists
(a local path always wins; `builtin:` and adapter references are never ids; nor is a name ending in a data-file
suffix such as `.jsonl`, which stays a missing local file).

rlflow never downloads: compile resolves an id through the Hub cache only (HF_HUB_CACHE, else HF_HOME/hub, else
~/.cache/huggingface/hub; read from the environment at call time, because huggingface_hub reads its constants once
at import) and names an id that is not there (rule hub-not-cached) with the command that fetches it. Resolution:

- a model: `huggingface_hub.snapshot_download(repo_id, revision=..., cache_dir=..., local_files_only=True)`, which
  follows `refs/<revision>` to `snapshots/<commit>/` and never opens a connection. The spec's reference becomes
  that snapshot directory, so every check and every Ray worker on this machine reads the snapshot.
- a dataset: its repo snapshot is found the same way (repo_type="dataset"), then read with
  `datasets.load_dataset(<snapshot dir>, config, split=...)`, which builds the table from the repo's parquet /
  JSON / CSV files and README configs with no Hub call. `load_dataset("org/name")` by id is not used: offline
  (HF_HUB_OFFLINE=1) it does not read the Hub cache and fails unless `datasets` itself loaded the id online
  before (checked with datasets 5.2 and huggingface_hub 2.5). The chosen split is saved once with
  `Dataset.save_to_disk` under $RLFLOW_CACHE/hub-datasets (else ~/.cache/rlflow/hub-datasets), keyed by the
  snapshot's commit, config and split; the spec's source becomes that directory (split cleared), which every
  reader of a `datasets` directory (rlflow/data_sources.py) reads as it is.

The plan records each resolved reference under plan["hub"] (its YAML path -> id, revision, commit, snapshot and
the local path used), beside the local paths in its pipeline.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rlflow.errors import Problem

#: `org/name`, then optionally `:config` (datasets) and `@revision`
ID = re.compile(r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)"
                r"(?::(?P<config>[A-Za-z0-9][A-Za-z0-9._-]*))?(?:@(?P<revision>[A-Za-z0-9._/-]+))?$")
#: names that are local files, never Hub ids (a missing `data/train.jsonl` stays a missing file)
FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".csv", ".txt", ".yaml", ".yml", ".bin", ".safetensors")
NOT_CACHED = "hub-not-cached"
DATASET_CONFIG = "hub-dataset-config"
HUB_DATASET = "hub-dataset"
RULES = (NOT_CACHED, DATASET_CONFIG, HUB_DATASET)


@dataclass(frozen=True)
class HubRef:
    """A parsed Hub id: the repo, and the config and revision it names (None: the default ones)."""

    repo_id: str
    config: str | None = None
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f":{self.config}" if self.config else "") + (f"@{self.revision}" if self.revision else "")


class HubProblem(ValueError):
    """A Hub id that cannot be resolved here; `rule` and `fix` as a Problem's."""

    def __init__(self, message: str, rule: str, fix: str):
        super().__init__(message)
        self.rule, self.fix = rule, fix


def parse(ref: str) -> HubRef | None:
    """`ref` as a Hub id by its shape alone, or None (not whether anything local has that name)."""
    if not isinstance(ref, str) or ref.startswith(("builtin:", "./", "../", "/", "~")) or "://" in ref:
        return None
    m = ID.match(ref)
    if m is None or m["repo"].lower().endswith(FILE_SUFFIXES) or ".." in m["repo"] or "--" in m["repo"]:
        return None
    return HubRef(m["repo"], m["config"], m["revision"])


def hub_ref(ref: str, base_dir: Path) -> HubRef | None:
    """`ref` as a Hub id: shaped like one (`parse`) and naming no local path beside the pipeline, in its parent
    directories or in the working directory (component_checks.resolve_path); else None."""
    from rlflow.component_checks import resolve_path

    parsed = parse(ref)
    if parsed is None or resolve_path(ref, base_dir) is not None:
        return None
    return parsed


def cache_dir() -> Path:
    """The Hub cache huggingface_hub reads, from the environment as it is now: HF_HUB_CACHE (or the older
    HUGGINGFACE_HUB_CACHE), else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def fetch_command(ref: HubRef, repo_type: str = "model") -> str:
    """The commands that put `ref` into the Hub cache (run where the Hub can be reached)."""
    flags = (" --repo-type dataset" if repo_type == "dataset" else "") + (f" --revision {ref.revision}" if ref.revision else "")
    args = [repr(ref.repo_id)] + (["repo_type='dataset'"] if repo_type == "dataset" else []) + (
        [f"revision={ref.revision!r}"] if ref.revision else [])
    return (f"fetch it first: hf download {ref.repo_id}{flags} (huggingface-cli download with huggingface_hub < 1.0), "
            f"or python -c \"from huggingface_hub import snapshot_download; snapshot_download({', '.join(args)})\"; "
            "with HF_HUB_CACHE / HF_HOME set as when rlflow runs (or copy the cache here)")


def snapshot(ref: HubRef, repo_type: str = "model") -> Path:
    """The cached snapshot directory of `ref` (`snapshots/<commit>` of its repo in the Hub cache), found with
    huggingface_hub's snapshot_download(local_files_only=True); HubProblem (hub-not-cached) when it is not cached."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise HubProblem(f"'{ref}' is a Hugging Face Hub id, and reading the Hub cache needs huggingface_hub, "
                         "which is not installed", "missing-package", "pip install huggingface_hub") from None
    cache = cache_dir()
    try:
        return Path(snapshot_download(ref.repo_id, repo_type=repo_type, revision=ref.revision, cache_dir=str(cache),
                                      local_files_only=True))
    except Exception as err:  # noqa: BLE001 - LocalEntryNotFoundError (not cached) and friends: all mean "not here"
        raise HubProblem(_not_cached(ref, repo_type, cache, err), NOT_CACHED, fetch_command(ref, repo_type)) from None


def _not_cached(ref: HubRef, repo_type: str, cache: Path, err: Exception) -> str:
    what = "dataset" if repo_type == "dataset" else "model"
    repo = cache / f"{repo_type}s--{ref.repo_id.replace('/', '--')}"
    cached = sorted(p.name for p in (repo / "refs").glob("*") if p.is_file()) + sorted(
        p.name[:12] for p in (repo / "snapshots").glob("*") if p.is_dir())
    if repo.is_dir() and ref.revision and cached:
        where = f"its revision '{ref.revision}' is not in the Hub cache at {cache} (cached: {', '.join(cached)})"
    elif repo.is_dir() and cached:
        where = f"it is not in the Hub cache at {cache} ({type(err).__name__})"
    else:
        where = f"it is not in the Hub cache at {cache}"
    return (f"'{ref}' names no local path, so it is read as a Hugging Face Hub {what} id, and {where}; rlflow does not "
            "download at run time")


def rlflow_datasets_root() -> Path:
    """Where Hub datasets are saved once read: $RLFLOW_CACHE/hub-datasets, else ~/.cache/rlflow/hub-datasets."""
    root = os.environ.get("RLFLOW_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "rlflow") / "hub-datasets"


def dataset_dir(ref: HubRef, split: str | None, *, snapshot_dir: Path | None = None) -> tuple[Path, Path, str | None, str]:
    """The Hub dataset `ref`'s rows as a `datasets` directory (one Dataset, saved with save_to_disk), with the snapshot
    it was read from, its config and its split: (directory, snapshot, config, split). `split` None: the only split,
    else a HubProblem listing them (bad-split). HubProblem for an uncached id, an unknown config or split, or files
    `datasets` cannot read."""
    try:
        import datasets
    except ImportError:
        from rlflow.data_sources import INSTALL_DATASETS

        raise HubProblem(f"'{ref}' is a Hugging Face Hub dataset id, and reading it needs the datasets package, "
                         "which is not installed", "missing-package", INSTALL_DATASETS) from None
    snap = snapshot_dir or snapshot(ref, "dataset")
    try:
        builder = datasets.load_dataset_builder(str(snap), ref.config)
    except ValueError as err:  # several configs and none named, or an unknown one
        configs = _configs(datasets, snap)
        shown = ", ".join(configs) or (str(err).splitlines() or [""])[0]
        what = (f"names no config of the dataset (configs: {shown})" if ref.config else
                f"is a dataset of several configs ({shown}) and names none")
        raise HubProblem(f"'{ref}' {what}", DATASET_CONFIG,
                         f"name the config after the id, e.g. {ref.repo_id}:{configs[0] if configs else '<config>'}"
                         + (f"@{ref.revision}" if ref.revision else "")) from None
    except Exception as err:  # noqa: BLE001 - files datasets cannot read
        raise HubProblem(f"'{ref}' (snapshot {snap}) cannot be read with datasets ({type(err).__name__}: "
                         f"{(str(err).splitlines() or [''])[0][:160]})", HUB_DATASET,
                         "check the dataset's files, or save the rows as .jsonl/.parquet and point the source at that") from None
    config = builder.config.name
    splits = [str(s) for s in (builder.config.data_files or builder.info.splits or {})]
    if split is None:
        if len(splits) != 1:
            raise HubProblem(f"'{ref}' holds several splits ({', '.join(splits)}); which one has the prompts?",
                             "bad-split", f"set split: to one of {', '.join(splits)}")
        split = splits[0]
    elif splits and split not in splits:
        raise HubProblem(f"'{ref}' has no split {split!r} (splits: {', '.join(splits)})", "bad-split",
                         f"set split: to one of {', '.join(splits)}")
    target = rlflow_datasets_root() / ref.repo_id.replace("/", "--") / snap.name / config / split
    if not (target / "state.json").is_file():
        _save(datasets, snap, config, split, target, ref)
    return target, snap, config, split


def _configs(datasets, snap: Path) -> list[str]:
    try:
        return list(datasets.get_dataset_config_names(str(snap)))
    except Exception:  # noqa: BLE001 - only a hint in the message
        return []


def _save(datasets, snap: Path, config: str, split: str, target: Path, ref: HubRef) -> None:
    """Read one split of a snapshot with datasets and save it at `target` (written beside it, then renamed into place:
    a reader never sees half a directory)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{split}-") as tmp:
        quiet = datasets.are_progress_bars_disabled()
        datasets.disable_progress_bars()  # compile prints its summary, not datasets' bars
        try:
            ds = datasets.load_dataset(str(snap), config, split=split, cache_dir=os.path.join(tmp, "cache"))
            ds.save_to_disk(os.path.join(tmp, "out"))
        except Exception as err:  # noqa: BLE001 - unreadable data files
            raise HubProblem(f"'{ref}' split {split!r} cannot be read with datasets ({type(err).__name__}: "
                             f"{(str(err).splitlines() or [''])[0][:160]})", HUB_DATASET,
                             "check the dataset's files, or save the rows as .jsonl/.parquet and point the source at that") from None
        finally:
            if not quiet:
                datasets.enable_progress_bars()
        try:
            os.replace(os.path.join(tmp, "out"), target)
        except OSError:  # saved meanwhile by another compile: theirs is the same rows
            if not (target / "state.json").is_file():
                raise


# ---------------------------------------------------------------------------------------------------- the pipeline

def _model_refs(spec):
    """(YAML path, object, attribute) of every model reference of a pipeline: the policy, reward models, judges,
    a PPO critic and a distillation teacher."""
    yield ("model", "path"), spec.model, "path"
    for name, stage in spec.stages.items():
        loc = ("stages", name)
        parts = [(loc, stage)] + [(loc + ("scorers", i), p) for i, p in enumerate(getattr(stage, "scorers", None) or [])]
        for where, part in parts:
            if isinstance(getattr(part, "model", None), str):
                yield where + ("model",), part, "model"
            judge = getattr(part, "judge", None)
            if judge is not None and isinstance(getattr(judge, "model", None), str):
                yield where + ("judge", "model"), judge, "model"
        ppo, distill = getattr(stage, "ppo", None), getattr(stage, "distill", None)
        if ppo is not None and isinstance(getattr(ppo, "critic_model", None), str):
            yield loc + ("ppo", "critic_model"), ppo, "critic_model"
        if distill is not None and isinstance(getattr(distill, "teacher", None), str):
            yield loc + ("distill", "teacher"), distill, "teacher"


def _data_refs(spec):
    """(YAML path, object, attribute, split attribute or None) of every data reference: data.source, each task's
    source and a data.eval file (read as a dataset's `test` split, else its only one)."""
    d = spec.data
    if isinstance(d.source, str):
        yield ("data", "source"), d, "source", "split"
    for name, task in (d.tasks or {}).items():
        yield ("data", "tasks", name, "source"), task, "source", "split"
    if isinstance(d.eval, str):
        yield ("data", "eval"), d, "eval", None


def resolve_spec(spec, base_dir: Path) -> tuple[object, dict[str, dict], list[Problem]]:
    """`spec` with every Hub id among its model and data references replaced by the local directory it resolves to
    (a copy; `spec` itself when it names none), what each resolved to (dotted YAML path -> id, revision, commit,
    snapshot, path; plan["hub"]), and a Problem for each that does not resolve (at the reference's YAML path)."""
    models = [(loc, attr, ref) for loc, obj, attr in _model_refs(spec)
              if (ref := hub_ref(getattr(obj, attr), base_dir)) is not None]
    data = [(loc, attr, split_attr, ref) for loc, obj, attr, split_attr in _data_refs(spec)
            if (ref := hub_ref(getattr(obj, attr), base_dir)) is not None]
    if not models and not data:
        return spec, {}, []
    spec = spec.model_copy(deep=True)  # the same walk over the copy finds the same references in the same order
    copies = {loc: obj for loc, obj, _ in _model_refs(spec)} | {loc: obj for loc, obj, _, _ in _data_refs(spec)}
    record, problems = {}, []
    for loc, attr, ref in models:
        try:
            if ref.config:
                raise HubProblem(f"'{ref}' names a config (:{ref.config}); a model has none", DATASET_CONFIG,
                                 f"use {HubRef(ref.repo_id, None, ref.revision)}")
            snap = snapshot(ref, "model")
        except HubProblem as err:
            problems.append(Problem(loc, str(err), err.rule, err.fix))
            continue
        setattr(copies[loc], attr, str(snap))
        record[".".join(map(str, loc))] = {"id": ref.repo_id, "repo_type": "model", "revision": ref.revision or "main",
                                           "commit": snap.name, "snapshot": str(snap), "path": str(snap)}
    for loc, attr, split_attr, ref in data:
        obj = copies[loc]
        split = getattr(obj, split_attr) if split_attr else None
        try:
            if split_attr is None:  # data.eval: no split of its own
                split = _eval_split(ref)
            path, snap, config, split = dataset_dir(ref, split)
        except HubProblem as err:
            problems.append(Problem(loc, str(err), err.rule, err.fix))
            continue
        setattr(obj, attr, str(path))
        if split_attr:
            setattr(obj, split_attr, None)  # one split saved: a Dataset directory, which has no splits
        record[".".join(map(str, loc))] = {"id": ref.repo_id, "repo_type": "dataset", "revision": ref.revision or "main",
                                           "commit": snap.name, "snapshot": str(snap), "config": config, "split": split,
                                           "path": str(path)}
    return spec, record, problems


def _eval_split(ref: HubRef) -> str | None:
    """data.eval's split: `test` when the dataset has one, else None (its only split)."""
    snap = snapshot(ref, "dataset")
    try:
        import datasets

        splits = [str(s) for s in datasets.load_dataset_builder(str(snap), ref.config).config.data_files or {}]
    except Exception:  # noqa: BLE001 - dataset_dir names it
        return None
    return "test" if "test" in splits else None


def without_echoes(problems: list[Problem], hub_problems: list[Problem]) -> list[Problem]:
    """`problems` less those the other checks report at (or under) the YAML path of a Hub id that did not resolve
    (e.g. bad-model-path for the id read as a local directory): the Hub problem there says what is wrong."""
    locs = [p.loc for p in hub_problems]
    return [p for p in problems if p in hub_problems or not any(tuple(p.loc[:len(loc)]) == tuple(loc) for loc in locs)]


def annotate(plan: dict, record: dict[str, dict]) -> dict:
    """Record the resolved Hub ids in a compiled plan (plan["hub"]), and name the policy by its id, not its snapshot
    directory, where an agent's endpoint reports the model's name."""
    if not record:
        return plan
    plan["hub"] = record
    policy = record.get("model.path")
    if policy is not None:
        for actor in plan.get("actors", []):
            episode = actor.get("episode") or {}
            if episode.get("model_name") == policy["path"]:
                episode["model_name"] = policy["id"]
    return plan


def refetch_hint(path: str | Path) -> str | None:
    """For a directory inside the Hub cache (`<type>s--org--name/snapshots/<commit>`), the command that fetches it
    again; None for any other path."""
    parts = Path(path).parts
    if len(parts) < 3 or parts[-2] != "snapshots" or "--" not in parts[-3]:
        return None
    kind, _, name = parts[-3].partition("--")
    if kind not in ("models", "datasets") or "--" not in name:
        return None
    return fetch_command(HubRef(name.replace("--", "/", 1), None, parts[-1]), kind[:-1])

