"""A reward function in a child process of its Score actor (reward_stream.py), so a row that kills the process
(os._exit, a segfault, the OOM killer) or hangs is caught per call: the child dies or is killed, the actor lives,
and the next call gets a new child. One long-lived child per Score actor; a call costs a pipe round trip
(measured in tests/unit/runtime/test_reward_process.py), a child is spawned only at the first call and after one died.

Protocol, over the child's stdin and a copy of its stdout (the reward's own prints go to stderr, the actor's log):
4-byte length + pickle. The parent sends a list of calls (completion, answer, prompt, row), a whole group at once;
the child answers each in order with ("ok", reward) or ("err", why), why as reward_call.py words it ("raised
ValueError: ...", "returned 'yes' (str), not a number"). One message per group rather than a round trip per
trajectory: on 2 shared cores each round trip was a pair of context switches, ~0.3 ms a trajectory
(benchmarks/results/step_latency.md). Each answer still has its own timeout, counted from the one before it.
Run as `python -m rlflow.runtime.reward_process FN_REF`.
"""

from __future__ import annotations

import json
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time

from rlflow.runtime.reward_call import RewardTimeout, as_reward, first_line, reward_caller

START_TIMEOUT_S = 120.0  # a child imports the reward's module (which may import torch) and says it is ready
PARENT_POLL_S = 1.0  # a child whose parent died (the Score actor was killed) exits within this
_HEADER = struct.Struct("!I")


class RewardDied(Exception):
    """The child ended during a call (or while starting); `how` says how: 'exit code 1', 'signal SIGKILL'."""

    def __init__(self, how: str):
        super().__init__(how)
        self.how = how


class RewardUnloadable(RewardDied):
    """The child could not import the reward (its module no longer imports or fits: edited since the run started);
    `why` names the file and line. Retrying cannot help: the stage stops (reward_stream.py Score)."""

    def __init__(self, why: str):
        super().__init__(f"could not load it: {why}")
        self.why = why


class RewardFailed(Exception):
    """The reward raised or returned something that is not a finite number; str() says which, without the name."""


class RewardProcess:
    """call(completion, answer, prompt, row) -> reward, run in a child process with a per-call timeout. Raises
    RewardTimeout (the child is killed), RewardDied (it died) or RewardFailed (it raised or returned a non-number)."""

    def __init__(self, fn_ref: str, timeout_s: float):
        self.fn_ref, self.timeout_s = fn_ref, timeout_s
        self.proc: subprocess.Popen | None = None
        self.spawned = 0  # children started so far (the first, then one per death or timeout)
        self._lock = threading.Lock()  # one call at a time: the child answers in order

    def call(self, completion: str, answer: str, prompt: str, row: dict) -> float:
        (outcome,) = self.call_many([(completion, answer, prompt, row)])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def call_many(self, calls: list[tuple[str, str, str, dict]]) -> list[float | Exception]:
        """Outcomes of `calls` in order, each a reward or the RewardFailed / RewardTimeout / RewardDied it raised,
        up to and including the first that timed out or ended the child: the caller decides what to do with the
        rest (retry, or stop calling a reward that hangs). Sent as one message; each answer waits at most
        timeout_s from the one before it, the time the child spent on that call alone."""
        outcomes: list[float | Exception] = []
        with self._lock:
            try:
                if self.proc is None:
                    self._spawn()
                self._send(list(calls))
            except RewardDied as died:
                return [died]
            for _ in calls:
                try:
                    kind, value = self._receive(time.monotonic() + self.timeout_s if self.timeout_s > 0 else None)
                except (RewardTimeout, RewardDied) as lost:  # the child is gone: the rest were never answered
                    outcomes.append(lost)
                    break
                outcomes.append(value if kind == "ok" else RewardFailed(value))
        return outcomes

    def _spawn(self) -> None:
        env = dict(os.environ, RLFLOW_REWARD_PATH=json.dumps([p for p in sys.path if p]))
        self.proc = subprocess.Popen([sys.executable, "-m", "rlflow.runtime.reward_process", self.fn_ref],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        self.spawned += 1
        kind, value = self._receive(time.monotonic() + START_TIMEOUT_S, starting=True)
        if kind != "ready":
            self.close()
            raise RewardUnloadable(value)

    def _send(self, message) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self.proc.stdin.write(_HEADER.pack(len(data)) + data)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise RewardDied(self._ended()) from None

    def _receive(self, deadline: float | None, starting: bool = False):
        size = _HEADER.unpack(self._read(_HEADER.size, deadline, starting))[0]
        return pickle.loads(self._read(size, deadline, starting))

    def _read(self, n: int, deadline: float | None, starting: bool) -> bytes:
        fd, got = self.proc.stdout.fileno(), b""
        while len(got) < n:
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and (wait <= 0 or not select.select([fd], [], [], wait)[0]):
                self.close()  # stuck: killed, the next call gets a new child
                if starting:
                    raise RewardDied(f"did not start within {START_TIMEOUT_S:g} s")
                raise RewardTimeout
            chunk = os.read(fd, n - len(got))
            if not chunk:
                raise RewardDied(self._ended())
            got += chunk
        return got

    def _ended(self) -> str:
        """How the child ended (it is gone either way; the next call starts a new one)."""
        proc, self.proc = self.proc, None
        try:
            code = proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:  # closed its pipe but lives on: end it
            proc.kill()
            code = proc.wait(timeout=5.0)
        _close_pipes(proc)
        if code < 0:
            try:
                return f"signal {signal.Signals(-code).name}"
            except ValueError:
                return f"signal {-code}"
        return f"exit code {code}"

    def close(self) -> None:
        """Kill the child (if any) and wait for it."""
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.kill()
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass  # unkillable (in the kernel): nothing more to do from here
            _close_pipes(proc)

    def __del__(self):
        self.close()


def _close_pipes(proc: subprocess.Popen) -> None:
    for pipe in (proc.stdin, proc.stdout):
        try:
            pipe.close()
        except OSError:
            pass


# ------------------------------------------------------------------------------------------ the child
def _serve(fn_ref: str) -> None:
    channel = os.fdopen(os.dup(1), "wb")  # the protocol's own copy of stdout
    os.dup2(2, 1)  # the reward's prints go to stderr, not into the protocol
    inbox = sys.stdin.buffer
    parent = os.getppid()

    def watch_parent():  # the Score actor died (killed, or its dataset ended): so does this child
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch_parent, daemon=True, name="watch-parent").start()

    def send(message) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        channel.write(_HEADER.pack(len(data)) + data)
        channel.flush()

    for path in reversed(json.loads(os.environ.get("RLFLOW_REWARD_PATH", "[]"))):
        if path not in sys.path:
            sys.path.insert(0, path)
    from rlflow import registry

    try:
        call = reward_caller(registry.resolve("reward", fn_ref))
    except Exception as e:  # noqa: BLE001 - reported to the parent, which names the reward, the file and the line
        from rlflow.user_code import described, located

        unusable = isinstance(e, registry.ComponentError)
        send(("error", described(e, fn_ref) if unusable else located(e, f"{type(e).__name__}: {first_line(e)}")))
        return
    send(("ready", None))
    while header := inbox.read(_HEADER.size):
        for completion, answer, prompt, row in pickle.loads(inbox.read(_HEADER.unpack(header)[0])):
            try:
                value = call(completion, answer, prompt, row)
            except Exception as e:  # noqa: BLE001 - user code: this call fails, the child goes on
                send(("err", f"raised {type(e).__name__}: {first_line(e)}"))
                continue
            try:
                send(("ok", as_reward(value)))
            except ValueError as e:
                send(("err", str(e)))


if __name__ == "__main__":
    _serve(sys.argv[1])
