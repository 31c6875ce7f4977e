"""Calling a user's reward function safely, inside the reward stream's Score actors (reward_stream.py).

A reward call fails that trajectory (not the stream) when it raises ("<fn> raised <Type>: <msg>"), returns
something that is not a finite number ("<fn> returned 'yes' (str), not a number", "... returned nan") or runs
longer than REWARD_TIMEOUT_S ("<fn> timed out after 30 s"; after TIMEOUTS_IN_A_ROW of them the rest of the
bundle fails without a call). A reward that fails on most calls would otherwise starve the buffer forever, so
the stream watches each stage's failure rate (FailureRate): more than MAX_FAILED_FRACTION of its last
FAILURE_WINDOW trajectories failed puts ("error", stage, RewardStageFailing) and the run stops with that message.
"""

from __future__ import annotations

import collections
import ctypes
import inspect
import math
import queue
import signal
import threading

from rlflow.errors import PipelineInvalid, Problem

# One reward call may take this long; past it the trajectory fails with "timed out after 30 s" (TimedCall, in the
# Score actor). Ray Data 2.60 runs a sync UDF off the actor's main thread, where SIGALRM cannot be used, so there
# the call runs on a worker thread: past the timeout it is abandoned (the next call gets a new thread) and
# interrupted with an asynchronous exception, which stops a Python loop at once and a sleep or a C call when it
# returns (tests/integration/test_bad_input.py::test_slow_reward_times_out_inside_the_reward_actor). On a main
# thread (a reward scored outside Ray Data) SIGALRM interrupts sleeps too.
REWARD_TIMEOUT_S = 30.0
# After this many timeouts in a row, the rest of a bundle (up to MAX_GROUPS_PER_PULL groups) fails at once
# ("not called: ...") instead of waiting REWARD_TIMEOUT_S per trajectory; the next bundle tries again. So a
# reward that always hangs reaches the failure-rate stop below in minutes, not hours.
TIMEOUTS_IN_A_ROW = 3
# A reward stage stops the run when more than MAX_FAILED_FRACTION of its last FAILURE_WINDOW trajectories failed
# (judged once it has scored FAILURE_WINDOW): a reward that fails on every call would otherwise run forever.
FAILURE_WINDOW = 64
MAX_FAILED_FRACTION = 0.5


def reward_caller(fn):
    """fn(completion, answer[, prompt=][, row=]) as call(completion, answer, prompt, row): passes the extra
    keywords only when fn's signature accepts them (by name, or through **kwargs)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature (some builtins): the two-argument form
        params = []
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params)
    extra = [k for k in ("prompt", "row") if takes_any or k in names]

    def call(completion: str, answer: str, prompt: str, row: dict):
        given = {"prompt": prompt, "row": row}
        return fn(completion, answer, **{k: given[k] for k in extra})

    return call


def filter_verdict(fn, rewards: list[float], errors: list[str]) -> bool:
    """Keep a group? Judged on its members that scored; a group with none is dropped."""
    ok = [r for r, e in zip(rewards, errors, strict=True) if not e]
    return bool(ok) and (fn is None or bool(fn(ok)))


class RewardTimeout(Exception):
    """A reward call ran past its timeout."""


def as_reward(value) -> float:
    """A reward function's result as a float: a finite real number (bool counts as 0/1; numpy and 0-d torch
    scalars convert). Else ValueError saying what it was."""
    if isinstance(value, (str, bytes)) or value is None or not hasattr(type(value), "__float__"):
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise ValueError(f"returned {shown} ({type(value).__name__}), not a number")
    try:
        r = float(value)
    except (TypeError, ValueError, RuntimeError) as err:  # e.g. a tensor of several elements
        raise ValueError(f"returned a {type(value).__name__} that is not one number ({err})") from None
    if not math.isfinite(r):
        raise ValueError(f"returned {r}, not a finite number")
    return r


class TimedCall:
    """fn(*args) with a timeout: SIGALRM on the main thread, else a worker thread that is abandoned (and
    replaced, and sent an asynchronous RewardTimeout) when a call overruns."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._worker: tuple[queue.Queue, threading.Thread] | None = None

    def __call__(self, fn, *args):
        if self.timeout_s is None or self.timeout_s <= 0:
            return fn(*args)
        if threading.current_thread() is threading.main_thread():
            return self._with_alarm(fn, args)
        return self._on_worker(fn, args)

    def _with_alarm(self, fn, args):
        armed = [True]

        def on_alarm(*_):
            if armed[0]:
                raise RewardTimeout

        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, self.timeout_s)
        try:
            return fn(*args)
        finally:
            armed[0] = False
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    def _on_worker(self, fn, args):
        if self._worker is None:
            jobs: queue.Queue = queue.Queue()
            thread = threading.Thread(target=_work, args=(jobs,), name="reward-call", daemon=True)
            thread.start()
            self._worker = (jobs, thread)
        jobs, thread = self._worker
        done: queue.Queue = queue.Queue(maxsize=1)
        jobs.put((fn, args, done))
        try:
            ok, value = done.get(timeout=self.timeout_s)
        except queue.Empty:
            # still running the stuck call: leave it (the next call gets a new thread), tell it to exit when the
            # call returns, and interrupt the call if it is running Python code
            self._worker = None
            jobs.put(None)
            _interrupt(thread)
            raise RewardTimeout from None
        if ok:
            return value
        raise value


def _work(jobs: queue.Queue) -> None:
    try:
        while (job := jobs.get()) is not None:
            fn, args, done = job
            try:
                done.put((True, fn(*args)))
            except BaseException as e:  # noqa: BLE001 - handed back to the caller
                done.put((False, e))
    except BaseException:  # noqa: BLE001 - an interrupt that arrived after its call had ended: just exit
        return


def _interrupt(thread: threading.Thread) -> None:
    """Raise RewardTimeout in `thread` at its next Python instruction (CPython's PyThreadState_SetAsyncExc)."""
    if thread.ident is not None and thread.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(RewardTimeout))


class RewardStageFailing(PipelineInvalid, RuntimeError):
    """A reward stage fails on too many trajectories: its reward function is broken (stops the run). A
    RuntimeError whose str() is one line (what failed; the way out); render() gives the exit-2 form naming
    stages.<stage>.fn."""

    def __str__(self) -> str:
        (p,) = self.problems
        return f"{p.message}; {p.fix}"


class FailureRate:
    """Failed / scored over a reward stage's last `window` trajectories."""

    def __init__(self, stage: str, window: int = FAILURE_WINDOW, max_fraction: float = MAX_FAILED_FRACTION):
        self.stage, self.max_fraction = stage, max_fraction
        self.recent: collections.deque = collections.deque(maxlen=window)
        self.last_error = ""

    def add(self, errors: list[str]) -> None:
        for err in errors:
            self.recent.append(bool(err))
            self.last_error = err or self.last_error

    def too_high(self) -> bool:
        return len(self.recent) == self.recent.maxlen and sum(self.recent) > self.max_fraction * len(self.recent)

    def error(self, source: str, fn_ref: str) -> RewardStageFailing:
        failed, n = sum(self.recent), len(self.recent)
        message = f"{failed} of the last {n} trajectories failed (last: {self.last_error})"
        return RewardStageFailing(source, [Problem(("stages", self.stage, "fn"), message, "reward-failing",
                                                   f"fix the reward function '{fn_ref}': it must return a finite "
                                                   f"number within {REWARD_TIMEOUT_S:g} s (try it on a few rows)")])
