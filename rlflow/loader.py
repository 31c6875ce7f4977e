"""YAML text -> plain dict plus a map from document paths to line numbers.

Duplicate keys are errors here (plain PyYAML silently keeps the last one, which would hide a
duplicated stage name). `--set` overrides are applied to the dict before validation.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from rlflow.errors import Loc, PipelineInvalid, Problem


class Document:
    """A parsed pipeline file: its data and where each path sits in the text."""

    def __init__(self, source: str, data, lines: dict[Loc, int]):
        self.source = source
        self.data = data
        self.lines = lines

    def line_of(self, loc: Loc) -> int | None:
        """Line of `loc`, or of its nearest ancestor that has one."""
        loc = tuple(loc)
        while loc:
            if loc in self.lines:
                return self.lines[loc]
            loc = loc[:-1]
        return None


def _construct(node, loc: Loc, lines: dict, problems: list[Problem]):
    lines[loc] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out = {}
        for key_node, value_node in node.value:
            key = _scalar(key_node)
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
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_construct(v, loc + (i,), lines, problems) for i, v in enumerate(node.value)]
    return _scalar(node)


def _scalar(node):
    # Resolve a scalar with PyYAML's safe rules (ints, floats, bools, nulls) without a full loader.
    return yaml.safe_load(yaml.serialize(node))


def parse(text: str, source: str) -> Document:
    """Parse YAML text into a Document, or raise PipelineInvalid (syntax, empty, duplicates)."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark else None
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
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
            _set(doc.data, parts, value)
        except _BadPath as bad:
            problems.append(Problem(("--set",), f"'{key}': {bad}", "bad-override",
                                    "point --set at a field inside the pipeline, e.g. stages.train.lr=1e-5"))
    if problems:
        raise PipelineInvalid(doc.source, problems)


class _BadPath(Exception):
    pass


def _set(node, parts: list, value) -> None:
    """Set node[parts[0]][parts[1]]... = value, creating mappings that are missing."""
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
        else:
            if isinstance(node, dict) and part not in node:
                node[part] = {}
            node = node[part]
