"""YAML text -> plain dict plus a map from document paths to line numbers.

Duplicate keys are errors here (plain PyYAML silently keeps the last one, which would hide a
duplicated stage name), and so are tags other than YAML's own (`!custom`, `!!python/...`). Size,
nesting depth and alias expansion are bounded before anything is built (rlflow/yaml_guard.py).
Anchors, aliases and merge keys (`<<: *base`) work. `--set` overrides are applied to the dict before validation.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from rlflow import yaml_guard
from rlflow.errors import Loc, PipelineInvalid, Problem


class Document:
    """A parsed pipeline file: its data and where each path sits in the text."""

    def __init__(self, source: str, data, lines: dict[Loc, int]):
        self.source = source
        self.data = data
        self.lines = lines
        self.overrides: dict[Loc, str] = {}  # the paths a `--set` wrote (or created on its way): its 'key=value'

    def override_of(self, loc: Loc) -> str | None:
        """The `--set` that wrote `loc` or the nearest of its ancestors, or None: the value is the file's."""
        loc = tuple(loc)
        for n in range(len(loc), 0, -1):
            if loc[:n] in self.overrides:
                return self.overrides[loc[:n]]
        return None

    def locate(self, problem: Problem) -> Problem:
        """`problem` pointing at where its value came from: the `--set` that wrote it, else its line of the file."""
        override = self.override_of(problem.loc)
        if override is not None:
            return dataclasses.replace(problem, line=None, override=override)
        return problem if problem.line else dataclasses.replace(problem, line=self.line_of(problem.loc))

    def line_of(self, loc: Loc) -> int | None:
        """Line of `loc`, or of its nearest ancestor that has one."""
        loc = tuple(loc)
        while loc:
            if loc in self.lines:
                return self.lines[loc]
            loc = loc[:-1]
        return None


MERGE_TAG = "tag:yaml.org,2002:merge"
COLLECTION_TAGS = {yaml.MappingNode: "tag:yaml.org,2002:map", yaml.SequenceNode: "tag:yaml.org,2002:seq"}


def _construct(node, loc: Loc, lines: dict, problems: list[Problem]):
    """Plain Python data for `node` (the yaml_guard bounds keep this recursion shallow and small)."""
    lines[loc] = node.start_mark.line + 1
    if type(node) in COLLECTION_TAGS and node.tag != COLLECTION_TAGS[type(node)]:
        problems.append(_unknown_tag(node, loc))
        return None
    if isinstance(node, yaml.MappingNode):
        out, merges = {}, []
        for key_node, value_node in node.value:
            if key_node.tag == MERGE_TAG:  # `<<: *base` merges the keys of an anchored mapping
                merges.append(value_node)
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                problems.append(Problem(loc, "a key is a list or mapping", "bad-key", "write keys as plain names",
                                        line=key_node.start_mark.line + 1))
                continue
            key = _scalar(key_node, loc, problems)
            if key in out:
                problems.append(
                    Problem(
                        loc + (key,),
                        f"duplicate key '{key}' (first at line {lines[loc + (key,)]})",
                        "duplicate-key",
                        "each name may appear once; rename or merge the two",
                        line=key_node.start_mark.line + 1,
                    )
                )
                continue
            out[key] = _construct(value_node, loc + (key,), lines, problems)
            lines[loc + (key,)] = key_node.start_mark.line + 1
        for merge in merges:
            _merge(out, merge, loc, lines, problems)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_construct(v, loc + (i,), lines, problems) for i, v in enumerate(node.value)]
    return _scalar(node, loc, problems)


def _merge(out: dict, node, loc: Loc, lines: dict, problems: list[Problem]) -> None:
    """YAML merge keys: the keys of the mapping(s) `node` names that `out` does not set itself."""
    sources = node.value if isinstance(node, yaml.SequenceNode) else [node]
    for source in sources:
        if not isinstance(source, yaml.MappingNode):
            problems.append(Problem(loc, "'<<' merges a mapping (or a list of mappings)", "bad-merge",
                                    "write `<<: *name` with an anchor on a mapping, e.g. base: &name {...}",
                                    line=source.start_mark.line + 1))
            continue
        sub: dict[Loc, int] = {}
        merged = _construct(source, loc, sub, problems) or {}
        for key, value in merged.items():
            if key not in out:
                out[key] = value
                lines.update((k, n) for k, n in sub.items() if k[len(loc):len(loc) + 1] == (key,))


def _unknown_tag(node, loc: Loc) -> Problem:
    tag = "!!" + node.tag.removeprefix("tag:yaml.org,2002:") if node.tag.startswith("tag:yaml.org,2002:") else node.tag
    return Problem(loc, f"unknown tag '{tag}'", "unknown-tag",
                   "remove the tag: a pipeline is plain YAML (strings, numbers, booleans, lists, mappings); "
                   "quote the value if the '!' belongs to it", line=node.start_mark.line + 1)


_SAFE = yaml.constructor.SafeConstructor
SCALAR_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null", "timestamp", "binary")}


def _scalar(node, loc: Loc, problems: list[Problem]):
    """A scalar resolved by PyYAML's safe rules (ints, floats, bools, nulls, strings); None for an unknown tag."""
    if node.tag not in SCALAR_TAGS:
        problems.append(_unknown_tag(node, loc))
        return None
    try:
        return _SAFE.yaml_constructors[node.tag](_SAFE(), node)
    except yaml.constructor.ConstructorError as e:
        problems.append(Problem(loc, f"cannot read this value: {e.problem}", "bad-value", "fix the value at that line",
                                line=node.start_mark.line + 1))
        return None


def _yaml_error(e: yaml.YAMLError) -> str:
    """PyYAML's problem, with its context where that says more ("while parsing a flow mapping")."""
    problem, context = getattr(e, "problem", None), getattr(e, "context", None)
    if context and context.startswith("found"):  # "found duplicate anchor 'x'; first occurrence" / "second occurrence"
        return context.split(";")[0]
    if problem and context:
        return f"{problem} ({context})"
    return problem or str(e).splitlines()[0]


def _compose(text: str):
    """The node tree, with libyaml where PyYAML has it (10x faster); errors in the pure-Python parser's words."""
    if getattr(yaml, "CSafeLoader", None) is not None:
        try:
            return yaml.compose(text, Loader=yaml.CSafeLoader)
        except yaml.YAMLError:
            pass
    return yaml.compose(text, Loader=yaml.SafeLoader)


def parse(text: str, source: str) -> Document:
    """Parse YAML text into a Document, or raise PipelineInvalid (syntax, limits, empty, duplicates, tags)."""
    try:
        limits = yaml_guard.check_limits(text)
        if limits:
            raise PipelineInvalid(source, limits)
        root = _compose(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark else None
        what = _yaml_error(e)
        raise PipelineInvalid(
            source,
            [Problem((), f"YAML syntax error: {what}", "yaml-syntax", "fix the YAML at that line", line=line)],
        ) from None
    if root is None:
        raise PipelineInvalid(
            source,
            [Problem((), "the file is empty", "empty-file", "start from a file in pipelines/, e.g. pipelines/quickstart.yaml")],
        )
    lines: dict[Loc, int] = {}
    problems: list[Problem] = []
    data = _construct(root, (), lines, problems)
    if problems:
        raise PipelineInvalid(source, problems)
    if not isinstance(data, dict):
        raise PipelineInvalid(
            source,
            [Problem((), f"the top level must be a mapping (name:, data:, stages:, edges:), not a {type(data).__name__}",
                     "not-a-mapping", "start from a file in pipelines/", line=1)],
        )
    return Document(source, data, lines)


def load(path: str | Path) -> Document:
    """Read and parse a pipeline file."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise PipelineInvalid(str(path), [Problem((), "no such file", "missing-file", "check the path")]) from None
    except (IsADirectoryError, UnicodeDecodeError) as e:
        raise PipelineInvalid(str(path), [Problem((), f"cannot read: {e}", "unreadable-file", "pass a YAML file")]) from None
    return parse(text, str(path))


def apply_overrides(doc: Document, overrides: list[str]) -> None:
    """Apply `dotted.key=value` overrides in place; values are parsed as YAML scalars."""
    problems = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            problems.append(Problem(("--set",), f"'{item}' is not dotted.key=value", "bad-override",
                                    "write e.g. --set stages.train.lr=1e-5"))
            continue
        try:
            value = yaml.safe_load(raw) if raw else None
        except yaml.YAMLError:
            value = raw
        parts: list = [int(p) if p.isdigit() else p for p in key.split(".")]
        try:
            written = _set(doc.data, parts, value)
        except _BadPath as bad:
            problems.append(Problem(("--set",), f"'{key}': {bad}", "bad-override",
                                    "point --set at a field inside the pipeline, e.g. stages.train.lr=1e-5"))
            continue
        for loc in list(doc.overrides):  # what an earlier override wrote beneath this one is gone
            if loc[:len(parts)] == tuple(parts):
                del doc.overrides[loc]
        doc.overrides.update((loc, item) for loc in written)
    if problems:
        raise PipelineInvalid(doc.source, problems)


class _BadPath(Exception):
    pass


def _set(node, parts: list, value) -> list[Loc]:
    """Set node[parts[0]][parts[1]]... = value, creating mappings that are missing; the paths written (the value's,
    and those of the mappings created)."""
    written: list[Loc] = []
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        where = ".".join(map(str, parts[:depth]))
        if isinstance(node, list):
            if not isinstance(part, int) or part >= len(node):
                raise _BadPath(f"index {part} is out of range ('{where}' has {len(node)} items)")
        elif not isinstance(node, dict):
            raise _BadPath(f"'{where}' is not a mapping or list")
        if last:
            node[part] = value
            written.append(tuple(parts))
        else:
            if isinstance(node, dict) and part not in node:
                node[part] = {}
                written.append(tuple(parts[:depth + 1]))
            node = node[part]
    return written
