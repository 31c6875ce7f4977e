"""Bounds on a pipeline file before it is built into Python objects: size, nesting depth, alias expansion.

A pipeline is a few KiB and a few hundred values nested about five levels deep. Hostile or broken
YAML is stopped here, while streaming the parser's events (no recursion, no expansion):

- a "billion laughs" file, whose anchors and aliases (`&a`, `*a`) expand to billions of values,
  is stopped once the values it would expand to pass MAX_NODES;
- a file nested thousands of levels deep (which would exhaust Python's recursion limit) is stopped
  at MAX_DEPTH;
- an alias inside the very node it names (a cycle) is refused;
- a file over MAX_BYTES is refused before parsing.
"""

from __future__ import annotations

import yaml

from rlflow.errors import Problem

MAX_BYTES = 128 * 1024
MAX_DEPTH = 64
MAX_NODES = 10_000


class _Open:
    """A mapping or sequence whose end event has not come yet."""

    __slots__ = ("anchor", "depth", "index", "is_map", "key", "nodes")

    def __init__(self, anchor, is_map: bool):
        self.anchor, self.is_map = anchor, is_map
        self.nodes, self.depth = 1, 0  # values it expands to (itself included); levels below it
        self.key, self.index = None, -1  # for a mapping, the index counts keys and values alike

    def part(self):
        """This collection's part of the current path: the key being read, or the item's index."""
        return self.key if self.is_map else self.index if self.index >= 0 else None


def check_limits(text: str) -> list[Problem]:
    """The problems that make `text` unsafe to build (empty when it is within every bound).

    Reads the events with libyaml where PyYAML has it (the pure-Python scanner takes about a second on
    thousands of nested `[`); on a syntax error, again with the pure-Python parser, whose
    yaml.YAMLError (raised to the loader, which reports it) has the messages PyYAML users know.
    """
    if getattr(yaml, "CSafeLoader", None) is not None:
        try:
            return _check(text, yaml.CSafeLoader)
        except yaml.YAMLError:
            pass
    return _check(text, yaml.SafeLoader)


def _check(text: str, loader) -> list[Problem]:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_BYTES:
        return [Problem((), f"the file is {size // 1024} KiB, over the {MAX_BYTES // 1024} KiB a pipeline file may have",
                        "file-too-large", "a pipeline is a few KiB of settings: keep prompts and data in the file data.source names")]
    stack: list[_Open] = []
    done: dict[str, tuple[int, int]] = {}  # anchor -> (values it expands to, its depth)
    total, aliases = 0, 0

    def loc() -> tuple:  # where it happened, cut to the first levels (a path 3,000 levels long says nothing more)
        return tuple(o.part() for o in stack if o.part() is not None)[:6]

    def child(event) -> None:
        top = stack[-1] if stack else None
        if top is None:
            return
        top.index += 1
        if top.is_map and top.index % 2 == 0:  # a key: remember it for its value's path
            top.key = event.value if isinstance(event, yaml.ScalarEvent) else "?"

    def add(new: int, nodes: int, depth: int, mark) -> Problem | None:
        """`new` values more in all; `nodes` values and `depth` levels more under the open collection."""
        nonlocal total
        total += new
        if stack:
            stack[-1].nodes += nodes
            stack[-1].depth = max(stack[-1].depth, depth)
        if total > MAX_NODES:
            via = f" through its {aliases} aliases (*name)" if aliases else ""
            return Problem(loc(), f"the YAML expands to more than {MAX_NODES:,} values{via}; a pipeline has a few hundred",
                           "yaml-too-many-values", "write the values out, or use fewer nested aliases", line=mark.line + 1)
        if len(stack) + depth > MAX_DEPTH:
            return Problem(loc(), f"the YAML nests more than {MAX_DEPTH} levels deep; a pipeline nests about 5",
                           "yaml-too-deep", "flatten the nesting (a pipeline is stages:, edges: and their settings)",
                           line=mark.line + 1)
        return None

    for event in yaml.parse(text, Loader=loader):
        problem = None
        if isinstance(event, yaml.AliasEvent):
            child(event)
            aliases += 1
            if any(o.anchor == event.anchor for o in stack):
                return [Problem(loc(), f"alias *{event.anchor} sits inside the node &{event.anchor} names (a cycle)",
                                "yaml-recursive-alias", "an alias may only repeat a node that is complete",
                                line=event.start_mark.line + 1)]
            nodes, depth = done.get(event.anchor, (1, 0))  # an undefined alias: the composer reports it
            problem = add(nodes, nodes, depth, event.start_mark)
        elif isinstance(event, yaml.ScalarEvent):
            child(event)
            problem = add(1, 1, 0, event.start_mark)
            if event.anchor:
                done[event.anchor] = (1, 0)
        elif isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            child(event)
            stack.append(_Open(event.anchor, isinstance(event, yaml.MappingStartEvent)))
            problem = add(1, 0, 0, event.start_mark)
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            closed = stack.pop()
            if closed.anchor:
                done[closed.anchor] = (closed.nodes, closed.depth + 1)
            problem = add(0, closed.nodes, closed.depth + 1, event.start_mark)
        if problem is not None:
            return [problem]
    return []
