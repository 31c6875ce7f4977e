"""The progress output of `rlflow run`: a bar with the ETA on a terminal, one line per step in a log.

On a terminal the current step's line is redrawn in place (carriage return, erase line) and kept as a
permanent line every tenth of the run, at the last step, and before any other message, so a person sees
one moving bar and a short history. Anywhere else (a log file, a pipe, CI) every step is its own line, the
same text without the bar, so `grep step` over a log still gives one row per step.
The ETA is the remaining steps times the mean wall time of the last `window` steps (steady state, not the
start-up, which the first step's time includes).
"""

from __future__ import annotations

import sys
import time
from collections import deque


def format_duration(seconds: float) -> str:
    """12 s, 3 m 05 s, 1 h 02 m."""
    s = round(max(0.0, seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} m {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} m"


class Progress:
    """Step lines and other messages for one run; `stream` defaults to stdout, `tty` to whether it is a terminal."""

    def __init__(self, total_steps: int, *, stream=None, tty: bool | None = None, window: int = 10, width: int = 20):
        self.total = total_steps
        self.stream = stream if stream is not None else sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.width = width
        self.times: deque[float] = deque(maxlen=window)
        self.last_t: float | None = None
        self.open_line = False  # a bar is drawn and not yet ended with a newline
        self.keep_every = max(1, total_steps // 10)

    def eta_s(self, step: int, now: float | None = None) -> float | None:
        """Seconds to the last step from the mean of the recent step times; None before two steps are seen."""
        now = time.monotonic() if now is None else now
        if self.last_t is not None:
            self.times.append(now - self.last_t)
        self.last_t = now
        if not self.times or step >= self.total:
            return 0.0 if step >= self.total else None
        return (self.total - step) * sum(self.times) / len(self.times)

    def bar(self, step: int) -> str:
        done = int(self.width * min(step, self.total) / max(self.total, 1))
        return "[" + "#" * done + "." * (self.width - done) + "]"

    def step(self, step: int, text: str, now: float | None = None) -> None:
        """`text` is the step's row (metrics.Metrics.progress); the ETA and, on a terminal, the bar are added here."""
        eta = self.eta_s(step, now)
        eta_text = f"  ETA {format_duration(eta)}" if eta is not None and step < self.total else ""
        if not self.tty:
            self.stream.write(text + eta_text + "\n")
            self.stream.flush()
            return
        keep = step >= self.total or step % self.keep_every == 0
        self.stream.write("\r\x1b[K" + f"{self.bar(step)} {text}{eta_text}" + ("\n" if keep else ""))
        self.stream.flush()
        self.open_line = not keep

    def message(self, text: str) -> None:
        """Any other line (an evaluation, a checkpoint, a warning): ends a bar drawn in place first."""
        if self.open_line:
            self.stream.write("\n")
            self.open_line = False
        self.stream.write(text + "\n")
        self.stream.flush()
