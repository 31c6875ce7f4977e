"""Stopping on a signal: SIGINT (Ctrl-C) and SIGTERM (Slurm, Kubernetes, `docker stop`) finish the step and save a
checkpoint, and the process exits 128 + the signal's number (130, 143) as a process killed by it would. After
SIGTERM nobody is at a terminal to press Ctrl-C again, so the stop has a grace period: if the checkpoint (and the
export after it) has not finished within it, the process exits anyway, 143, saying what it was waiting for.

The grace, STOP_GRACE_S = 120 s unless RLFLOW_STOP_GRACE_S says otherwise: an orchestrator enforces its own grace
with SIGKILL (Kubernetes' terminationGracePeriodSeconds, 30 s by default; Slurm's KillWait, 30 s; docker stop,
10 s), so ours bounds only a plain `kill`, and must not cut a checkpoint that a longer grace configured there
would let finish: finishing a step and saving a ZeRO checkpoint of a few-billion-parameter model to local disk
takes tens of seconds to a minute or two. Set RLFLOW_STOP_GRACE_S to the orchestrator's grace where it is longer.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable

STOP_GRACE_S = 120.0
GRACE_ENV = "RLFLOW_STOP_GRACE_S"


def exit_code(signum: int) -> int:
    """What a shell reports for a process ended by `signum`: 128 + its number (SIGINT 130, SIGTERM 143)."""
    return 128 + int(signum)


class StoppedAgain(KeyboardInterrupt):
    """A second stop signal while stopping: quit at once; `rlflow run` exits `exit_code`, saying what was left
    unwritten (`left`, e.g. "the export of step 4 (its checkpoint is saved)")."""

    def __init__(self, signum: int, left: str | None = None, *, again: bool = True):
        super().__init__(signal.Signals(signum).name)
        self.exit_code, self.left, self.again = exit_code(signum), left, again

    def describe(self) -> str:
        name = "Ctrl-C" if self.exit_code == exit_code(signal.SIGINT) else str(self)
        return (f"{name}{' again' if self.again else ''}: quit at once" + (f", without {self.left}" if self.left else "")
                + "; rlflow run --resume continues from the last checkpoint")


@contextlib.contextmanager
def quit_on_signal(left: Callable[[], str]):
    """Within: SIGINT and SIGTERM raise StoppedAgain saying what `left()` is (the writes after a run: its summary,
    Ray's shutdown), so rlflow's handler, not Ray's (which exits 15), is the one installed until the process
    exits. Outside the main thread (a run started from a thread) nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, _frame):
        raise StoppedAgain(signum, left(), again=False)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def grace_s() -> float:
    """The grace after SIGTERM; PipelineInvalid (exit 2) for a bad RLFLOW_STOP_GRACE_S (launch checks it first)."""
    raw = os.environ.get(GRACE_ENV)
    if raw is None:
        return STOP_GRACE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        from rlflow.errors import PipelineInvalid, Problem

        raise PipelineInvalid("environment", [Problem(
            (GRACE_ENV,), f"{GRACE_ENV}={raw!r} is not a number of seconds > 0", "stop-grace",
            f"give the seconds a stop after SIGTERM may take (e.g. the orchestrator's grace), or unset it for "
            f"{STOP_GRACE_S:g} s")])
    return value


class Grace:
    """After a stop signal: unless `cancel()` comes within `seconds`, say what the stop is waiting for
    (`waiting_for()`) and end the process with the signal's exit code."""

    def __init__(self, signum: int, waiting_for: Callable[[], str], log=print, seconds: float | None = None):
        self.signum, self.waiting_for, self.log = signum, waiting_for, log
        self.seconds = grace_s() if seconds is None else seconds
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="rlflow-stop-grace", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        if self.done.wait(self.seconds):
            return
        try:
            what = self.waiting_for()
        except Exception as e:  # noqa: BLE001 - the exit below must happen whatever describing the wait does
            what = f"(could not say: {e!r})"
        name = signal.Signals(self.signum).name
        try:
            self.log(f"{name}: the stop did not finish within its grace of {self.seconds:g} s ({GRACE_ENV}); it was "
                     f"waiting for {what}. Exiting without it; rlflow run --resume continues from the last checkpoint")
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(exit_code(self.signum))

    def cancel(self) -> None:
        self.done.set()
