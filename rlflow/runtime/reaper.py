"""Ends what an embedded Ray cluster leaves behind when its driver dies (kill -9, a crash, the SIGTERM grace).

Ray's own fate-sharing ends the GCS, the raylet and the workers within seconds of the driver, but not its two agents
(ray::DashboardAgent, ray::RuntimeEnvAgent): on the raylet's death each tries to publish the raylet's error logs to
the driver through the GCS, which is gone, with a 60 s timeout (ray/_private/process_watcher.py,
report_raylet_error_logs, Ray 2.60), and lives 60-90 s more. So `rlflow run` starts this small process beside an
embedded cluster, in a session of its own (a kill of the driver's process group does not reach it), reading a pipe
from the driver: when the pipe ends (the driver exited, however), it gives the cluster's processes REAP_GRACE_S to
end on their own, then SIGTERM, then SIGKILL. It finds them by id only: processes whose environment carries this
cluster's RAY_NODE_ID, the driver's children it was given at start, and every process below those that it saw
while it waited (it looks every WATCH_S). The last is what finds the agents: they are the raylet's children while it
lives (init reparents them when it dies), and their environment cannot be relied on, because setproctitle may
write their `ray::DashboardAgent` title over the memory /proc/<pid>/environ reads (seen with a longer PYTHONPATH).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

REAP_GRACE_S = 5.0  # Ray's workers notice the raylet's death and exit within a few seconds (measured: under 5 s)
TERM_WAIT_S = 5.0
WATCH_S = 1.0  # how often the waiting reaper records the processes below the cluster's (a /proc scan: ~5 ms)


def _start_time(pid: int) -> str | None:
    """/proc/<pid>/stat's start time: with the pid, names one process (a pid may be reused)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def _of_node(node_id: str) -> set[tuple[int, str]]:
    marker = f"RAY_NODE_ID={node_id}".encode()
    found = set()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    found.add((int(name), _start_time(int(name))))
        except OSError:  # ended, or not ours to read
            continue
    return found


def _alive(procs: set[tuple[int, str]]) -> set[tuple[int, str]]:
    return {(pid, t) for pid, t in procs if t is not None and _start_time(pid) == t and not _zombie(pid)}


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except OSError:
        return True


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0].decode(errors="replace").strip()[:60] or "?"
    except OSError:
        return "?"


def reap(node_id: str, given: set[tuple[int, str]], *, grace_s: float = REAP_GRACE_S) -> list[str]:
    """End this node's processes still alive `grace_s` after the driver; returns what it had to end."""
    deadline = time.monotonic() + grace_s
    left = _alive(given | _of_node(node_id))
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _alive(left | _of_node(node_id))
    ended = [f"{_name(pid)} (pid {pid})" for pid, _ in sorted(left)]
    for sig, wait in ((signal.SIGTERM, TERM_WAIT_S), (signal.SIGKILL, 0.0)):
        for pid, _ in _alive(left):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait
        while _alive(left) and time.monotonic() < deadline:
            time.sleep(0.1)
    return ended


def _by_parent() -> dict[int, set[tuple[int, str]]]:
    """Every process, as (pid, start time), under its parent's pid."""
    out: dict[int, set[tuple[int, str]]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
                out.setdefault(int(fields[1]), set()).add((int(name), fields[19].decode()))
            except (OSError, IndexError, ValueError):
                continue
    return out


def children(pid: int) -> set[tuple[int, str]]:
    """The direct children of `pid` (Ray's GCS, raylet, monitors for an embedded cluster)."""
    return _by_parent().get(pid, set())


def descendants(roots: set[int]) -> set[tuple[int, str]]:
    """Every process below `roots`, at any depth (the raylet's agents and workers), not the roots themselves."""
    tree, out, todo = _by_parent(), set(), list(roots)
    while todo:
        for child in tree.get(todo.pop(), ()):
            if child not in out:
                out.add(child)
                todo.append(child[0])
    return out


def start(node_id: str) -> subprocess.Popen | None:
    """Watch this process's embedded cluster (node `node_id`); None where /proc is missing (not Linux)."""
    if not os.path.isdir("/proc/self"):
        return None
    given = " ".join(f"{pid}:{t}" for pid, t in children(os.getpid()))
    home = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # where rlflow imports from
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (home, os.environ.get("PYTHONPATH")) if p)}
    return subprocess.Popen([sys.executable, "-m", "rlflow.runtime.reaper", node_id, str(os.getpid()), given],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True,
                            close_fds=True, env=env)


def stop(proc: subprocess.Popen | None, timeout_s: float = REAP_GRACE_S + 2 * TERM_WAIT_S) -> None:
    """After ray.shutdown: the reaper ends what shutdown left (usually nothing, at once)."""
    if proc is None:
        return
    proc.stdin.close()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:  # it goes on alone; it ends by itself within its bounds
        pass


def main(argv: list[str]) -> int:
    node_id, driver, given = argv[0], argv[1], argv[2] if len(argv) > 2 else ""
    procs = {(int(p), t) for p, t in (x.split(":") for x in given.split())}
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the terminal's process group; stay to clean up
    driver_gone = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.buffer.read(), driver_gone.set()), daemon=True).start()
    while not driver_gone.wait(WATCH_S):  # until the driver closes the pipe or dies: note what the cluster starts
        procs = _alive(procs | descendants({pid for pid, _ in procs}))
    ended = reap(node_id, procs)
    if ended:
        try:
            print(f"rlflow: the driver (pid {driver}) ended and left {len(ended)} Ray process(es) running; ended: "
                  f"{', '.join(ended)}", file=sys.stderr, flush=True)
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
