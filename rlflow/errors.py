"""Errors a person can act on: collected, sorted, each with its YAML path, line, rule and way out."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

Loc = tuple  # a path into the pipeline document: ("edges", 3, "to")


def format_loc(loc: Loc) -> str:
    """('edges', 3, 'to') -> 'edges[3].to'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "<document>"


def did_you_mean(word: str, choices) -> str:
    """' (did you mean 'x'?)' for the closest choice, or ''."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


@dataclass(frozen=True, order=True)
class Problem:
    """One thing wrong with a pipeline."""

    loc: Loc
    message: str  # what is wrong, naming both parties
    rule: str  # short rule id, e.g. 'unknown-stage'
    fix: str = ""  # the way out
    line: int | None = field(default=None, compare=False)
    override: str | None = field(default=None, compare=False)  # the `--set key=value` that put the value there

    def render(self) -> str:
        where = format_loc(self.loc) + (f" (line {self.line})" if self.line else "") + (f" (--set {self.override})" if self.override else "")
        fix = f"; {self.fix}" if self.fix else ""
        return f"{where}: {self.message}{fix} [{self.rule}]"


class PipelineInvalid(Exception):
    """The pipeline (or its overrides) is invalid; the CLI prints the problems and exits 2."""

    def __init__(self, source: str, problems: list[Problem]):
        self.source = source
        self.problems = sorted(set(problems), key=_sort_key)
        super().__init__(self.render())

    def __reduce__(self):
        # rebuilt from (source, problems), not from Exception.args, so it crosses Ray processes (a reward stream's
        # host actor raises RewardStageFailing to the driver)
        return (type(self), (self.source, self.problems))

    def render(self) -> str:
        n = len(self.problems)
        head = f"{self.source}: {n} error{'s' if n != 1 else ''}"
        return "\n".join([head] + ["  " + p.render() for p in self.problems])


def _sort_key(p: Problem):
    # by document position (line when known), then path, then text
    return (p.line if p.line is not None else 10**9, tuple(str(x) for x in p.loc), p.message)


class RunFailed(RuntimeError):
    """A run stopped for a reason outside rlflow's code (a stall, a dead trainer, a failed reward stream);
    the message says what happened and how to resume. `rlflow run` exits 3 with it, no traceback."""
