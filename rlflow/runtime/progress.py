"""The progress output of `rlflow run`: one line redrawn in place on a terminal, one line per step in a log.

On a terminal a rich `Live` display holds the current step's line (a bar, then the step's fields), redrawn in place
and never wider than the terminal: the fields are given in order of importance and those that do not fit are left
out, the least important first (`fit`). Other messages (an evaluation, a checkpoint, a worker's output) print above
it, and in a run of 20 steps or more a line of the step is kept above it every tenth of the run, so a person sees
one moving line and a short history. Anywhere else (a log file, a pipe, CI) every step is its own plain line with every field, so `grep step`
over a log still gives one row per step.
The ETA is the remaining steps times the mean wall time of the last `window` steps (steady state, not the
start-up, which the first step's time includes).
"""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass

BAR_WIDTH = 10
SEP = "  "


def format_duration(seconds: float) -> str:
    """12 s, 3 m 05 s, 1 h 02 m."""
    s = round(max(0.0, seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} m {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} m"


@dataclass(frozen=True)
class Field:
    """One field of a step's line; `rank` 0 is kept longest when the terminal is narrow."""

    text: str
    rank: int = 0


def fit(fields: list[Field | str], width: int) -> str:
    """The fields in their order, separated by two spaces, leaving out the highest ranks until the line fits
    `width` columns; what is left (the rank-0 fields) is cut with an ellipsis when even that is too wide."""
    from rich.text import Text

    kept = [f if isinstance(f, Field) else Field(f) for f in fields]
    while len(SEP.join(f.text for f in kept)) > width and len({f.rank for f in kept}) > 1:
        worst = max(f.rank for f in kept)
        drop = max(i for i, f in enumerate(kept) if f.rank == worst)  # the last of the least important
        kept.pop(drop)
    text = Text(SEP.join(f.text for f in kept), no_wrap=True)
    text.truncate(max(width, 1), overflow="ellipsis")
    return text.plain


class Progress:
    """Step lines and other messages for one run; `stream` defaults to stdout, `tty` to whether it is a terminal,
    `width` to the terminal's (rich reads COLUMNS, then the terminal size)."""

    def __init__(self, total_steps: int, *, stream=None, tty: bool | None = None, window: int = 10,
                 width: int | None = None):
        self.total = total_steps
        self.stream = stream if stream is not None else sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.times: deque[float] = deque(maxlen=window)
        self.last_t: float | None = None
        self.keep_every = total_steps // 10 if total_steps >= 20 else None  # a short run keeps no history
        self.console = None
        self.live = None  # the rich Live display of the current step, while one is drawn
        if self.tty:
            from rich.console import Console

            self.console = Console(file=self.stream, force_terminal=True, width=width, highlight=False,
                                   markup=False, emoji=False, soft_wrap=False)

    @property
    def width(self) -> int:
        return self.console.width if self.console is not None else 10**6

    def eta_s(self, step: int, now: float | None = None) -> float | None:
        """Seconds to the last step from the mean of the recent step times; None before two steps are seen."""
        now = time.monotonic() if now is None else now
        if self.last_t is not None:
            self.times.append(now - self.last_t)
        self.last_t = now
        if not self.times or step >= self.total:
            return 0.0 if step >= self.total else None
        return (self.total - step) * sum(self.times) / len(self.times)

    def step(self, step: int, fields: list[Field | str] | str, now: float | None = None) -> None:
        """`fields`: the step's row (metrics.Metrics.progress), most important first by rank; the ETA is added here
        (after the rank-0 fields) and, on a terminal, the bar."""
        fields = [fields] if isinstance(fields, str) else list(fields)
        eta = self.eta_s(step, now)
        if eta is not None and step < self.total:
            at = sum(1 for f in fields if not isinstance(f, Field) or f.rank == 0)
            fields.insert(at, Field(f"ETA {format_duration(eta)}", 1))
        if not self.tty:
            self.stream.write(SEP.join(f.text if isinstance(f, Field) else f for f in fields) + "\n")
            self.stream.flush()
            return
        line = fit(fields, self.width - BAR_WIDTH - 1)
        if self.live is None:
            from rich.live import Live

            # stdout and stderr (Ray prints the workers' output there) go above the line while it is drawn
            mine = self.stream in (sys.stdout, sys.__stdout__)
            self.live = Live(console=self.console, auto_refresh=False, transient=False, redirect_stdout=mine,
                             redirect_stderr=mine)
            self.live.start()
        last = step >= self.total
        if self.keep_every and step % self.keep_every == 0 and not last:
            self.live.console.print(line)  # the short history above the moving line
        self.live.update(self._render(step, line), refresh=True)
        if last:
            self.close()

    def _render(self, step: int, line: str):
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        grid = Table.grid(padding=(0, 1))
        grid.add_column(width=BAR_WIDTH, no_wrap=True)
        grid.add_column(no_wrap=True, overflow="ellipsis")
        grid.add_row(ProgressBar(total=max(self.total, 1), completed=min(step, self.total), width=BAR_WIDTH), line)
        return grid

    def message(self, text: str) -> None:
        """Any other line (an evaluation, a checkpoint, a warning): above the step's line while one is drawn."""
        if self.live is not None:
            self.live.console.print(text)
            return
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """The step's line stays as the last one drawn; stdout and stderr are the process's own again."""
        if self.live is not None:
            live, self.live = self.live, None
            live.stop()
