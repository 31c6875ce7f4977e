"""Run untrusted Python code (a model's completion) in a contained subprocess: `run_python(code) -> Result`.

Always enforced: CPU seconds, address space, file size and process/thread limits (setrlimit in the child, before
the code starts), a wall-clock timeout that kills the whole process group, a fresh scratch directory as cwd, HOME
and TMPDIR (deleted afterwards), stdin from /dev/null, a minimal environment (nothing inherited), output capped.
Where the machine allows user namespaces (probed once per process: isolation()), also:
- "net": an empty network namespace: no network at all, not even the host's 127.0.0.1;
- "fs": every mount read-only except the scratch directory, locked by a second user namespace so the code
  cannot remount it (writes elsewhere fail with EROFS, whatever the file permissions);
- "pid": a PID namespace: every process the code starts dies with it, even one that left the process group.
Where they are refused, the code runs under the limits alone, and network_isolated() / filesystem_isolated() say
so. The kernel never applies RLIMIT_NPROC to uid 0 (in any user namespace), so when rlflow runs as root the process
limit is a pids cgroup instead, where one can be made; Result.isolation lists "nproc" when a process limit held.

The child's side (namespaces, limits, exec) is stages/sandbox_boot.py, run as `python -I -S sandbox_boot.py CONFIG`.
"""

from __future__ import annotations

import functools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

BOOT = str(Path(__file__).with_name("sandbox_boot.py"))
CGROUP_ROOTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")  # cgroup v1 pids hierarchy, cgroup v2


@dataclass(frozen=True)
class Limits:
    """What one run may use. The defaults suit a unit-test-sized program."""

    cpu_s: int = 2  # RLIMIT_CPU: SIGXCPU at cpu_s, SIGKILL a second later
    memory_mb: int = 512  # RLIMIT_AS (address space; a Python process needs about 30 MB)
    file_mb: int = 4  # RLIMIT_FSIZE: any one file written, the captured stdout/stderr included (SIGXFSZ past it)
    processes: int = 16  # RLIMIT_NPROC: processes and threads of the run
    wall_s: float = 5.0  # then the whole process group is killed
    output_chars: int = 8000  # stdout kept from the start, stderr from the end


@dataclass(frozen=True)
class Result:
    ok: bool  # exited with status 0 within its limits
    returncode: int | None  # negative: killed by that signal (as subprocess reports it)
    stdout: str  # the first Limits.output_chars characters
    stderr: str  # the last Limits.output_chars characters
    timed_out: bool  # killed by the wall-clock timeout
    killed_by: str | None  # signal name, e.g. SIGXCPU (CPU limit), SIGKILL (timeout), SIGXFSZ (file size)
    seconds: float
    isolation: tuple[str, ...]  # what contained it beyond CPU/memory/file/time: ("net", "fs", "pid", "nproc")


def run_python(code: str, *, limits: Limits = Limits(), files: dict[str, str] | None = None,
               args: tuple[str, ...] = (), isolate: bool = True) -> Result:
    """Run `code` as main.py in a fresh scratch directory (with `files` beside it) under `limits`.

    Never raises for anything the code does; isolate=False runs under the limits alone (as where the machine
    refuses namespaces)."""
    isolation = isolation_available() if isolate else ()
    work = tempfile.mkdtemp(prefix="rlflow-sandbox-")
    cgroup = _pids_cgroup(limits.processes + 2) if os.geteuid() == 0 else None  # + the bootstrap and pid 1
    try:
        scratch = os.path.join(work, "scratch")
        os.mkdir(scratch)
        for name, text in {**(files or {}), "main.py": code}.items():
            with open(os.path.join(scratch, name), "w", encoding="utf-8") as f:
                f.write(text)
        config = {"scratch": scratch, "isolation": list(isolation), "limits": asdict(limits), "cgroup": cgroup,
                  "uid": os.getuid(), "gid": os.getgid(), "argv": [sys.executable, "-I", "-S", "-B", "main.py", *args],
                  "extra_processes": 0 if isolation else _tasks_of(os.getuid())}
        nproc = ("nproc",) if cgroup or os.geteuid() != 0 else ()
        return _supervise(work, config, limits, tuple(isolation) + nproc)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if cgroup:
            _remove_cgroup(cgroup)


@functools.cache
def isolation_available() -> tuple[str, ...]:
    """The namespaces this machine gives the sandbox (probed once per process by a trial run)."""
    result = _probe()
    return tuple(result) if isinstance(result, list) else ()


def network_isolated() -> bool:
    """True when sandboxed code has no network at all (its own empty network namespace)."""
    return "net" in isolation_available()


def filesystem_isolated() -> bool:
    """True when sandboxed code can write only inside its scratch directory (read-only mounts elsewhere)."""
    return "fs" in isolation_available()


def _probe() -> list[str] | None:
    work = tempfile.mkdtemp(prefix="rlflow-sandbox-probe-")
    try:
        scratch = os.path.join(work, "scratch")
        os.mkdir(scratch)
        config = {"probe": True, "scratch": scratch, "uid": os.getuid(), "gid": os.getgid()}
        out = subprocess.run([sys.executable, "-I", "-S", BOOT, json.dumps(config)], stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, timeout=30, check=False, env=_environment(scratch), cwd=scratch)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _environment(scratch: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8",
            "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1"}


def _supervise(work: str, config: dict, limits: Limits, isolation: tuple[str, ...]) -> Result:
    """Start the bootstrap in its own session, wait up to wall_s, kill the group, collect the outputs."""
    paths = os.path.join(work, "stdout"), os.path.join(work, "stderr")
    started, timed_out = time.perf_counter(), False
    with open(paths[0], "wb") as out, open(paths[1], "wb") as err:
        proc = subprocess.Popen([sys.executable, "-I", "-S", BOOT, json.dumps(config)], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=err, cwd=config["scratch"], env=_environment(config["scratch"]),
                                start_new_session=True, close_fds=True)
        try:
            timed_out = not _wait_exit(proc, limits.wall_s)
        finally:
            try:  # also after a normal exit: background processes the code left in its group
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
    seconds = time.perf_counter() - started
    stdout = _read(paths[0], limits.output_chars, head=True)
    stderr = _read(paths[1], limits.output_chars, head=False)
    rc = proc.returncode
    killed_by = signal.Signals(-rc).name if rc is not None and rc < 0 and -rc in signal.valid_signals() else None
    return Result(ok=rc == 0 and not timed_out, returncode=rc, stdout=stdout, stderr=stderr, timed_out=timed_out,
                  killed_by=killed_by, seconds=seconds, isolation=isolation)


def _wait_exit(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait up to timeout_s for `proc` to exit; True if it did. Sleeps on a pidfd (Linux 5.3+) that becomes
    readable at exit: Popen.wait(timeout) polls with sleeps of up to 50 ms, which made a 45 ms run take 120 ms."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # no pidfd on this kernel or platform: poll
        try:
            proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        waiter = select.poll()  # not select.select: a worker with over 1024 open files gets fd numbers it rejects
        waiter.register(fd, select.POLLIN)
        return bool(waiter.poll(timeout_s * 1000))
    finally:
        os.close(fd)


def _read(path: str, chars: int, *, head: bool) -> str:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if not head and size > 4 * chars:
            f.seek(size - 4 * chars)  # utf-8: at most 4 bytes a character
        text = f.read(4 * chars).decode("utf-8", errors="replace")
    return text[:chars] if head else text[-chars:]


def _pids_cgroup(limit: int) -> str | None:
    """A fresh pids cgroup capped at `limit` tasks (root only), or None where none can be made."""
    for root in CGROUP_ROOTS:
        path = tempfile.mktemp(prefix="rlflow-sandbox-", dir=root)
        try:
            os.mkdir(path)
        except OSError:
            continue
        try:
            with open(os.path.join(path, "pids.max"), "w") as f:
                f.write(str(limit))
            return path
        except OSError:
            _remove_cgroup(path)
    return None


def _remove_cgroup(path: str) -> None:
    """Kill what the run left in its cgroup (a process that left the group with setsid), then remove it."""
    for _ in range(250):  # killed tasks leave the cgroup a moment after the bootstrap is reaped (longer on busy cores)
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                for pid in f.read().split():
                    os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)


def _tasks_of(uid: int) -> int:
    """Processes+threads the uid runs now: without a user namespace RLIMIT_NPROC counts all of them."""
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                count += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            pass
    return count
