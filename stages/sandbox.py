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

This file is also the child's bootstrap: `python -I -S sandbox.py CONFIG` sets up the namespaces and limits and
then execs the code, so it imports only the standard library.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

CGROUP_ROOTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")  # cgroup v1 pids hierarchy, cgroup v2
SETUP_FAILED = 125  # the bootstrap's exit status when a namespace it was asked for could not be set up


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
        out = subprocess.run([sys.executable, "-I", "-S", __file__, json.dumps(config)], stdin=subprocess.DEVNULL,
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
        proc = subprocess.Popen([sys.executable, "-I", "-S", __file__, json.dumps(config)], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=err, cwd=config["scratch"], env=_environment(config["scratch"]),
                                start_new_session=True, close_fds=True)
        try:
            proc.wait(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
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


# ---- the child's side: runs as `python -I -S sandbox.py CONFIG`, standard library only ----

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MOUNT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
               "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}  # kept on remount: they may be locked
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38


def _libc_call(name: str, *args) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    args = tuple(ctypes.c_ulong(a) if isinstance(a, int) else a for a in args)  # unsigned long in mount/prctl
    if getattr(libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


def _enter_user_namespace(uid: int, gid: int) -> None:
    """New user, mount and network namespaces, as uid 0 inside mapped to our uid outside (`unshare -r -n -m`)."""
    _libc_call("unshare", CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET)
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _read_only_except(scratch: str) -> None:
    """Every mount read-only, the scratch directory a writable bind mount of itself."""
    _libc_call("mount", b"none", b"/", None, MS_REC | MS_PRIVATE, None)
    target = scratch.encode()
    _libc_call("mount", target, target, None, MS_BIND | MS_REC, None)
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:
        point = fields[4].encode().decode("unicode_escape").encode("latin-1")  # octal escapes like \040
        if point == target:
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for option in fields[5].split(","):
            flags |= MOUNT_FLAGS.get(option, 0)
        _libc_call("mount", None, point, None, flags, None)


def _lock() -> None:
    """A second user namespace without a uid mapping: the code holds no capability over the mounts above (so it
    cannot remount them writable) nor over any file; its children get a PID namespace of their own."""
    _libc_call("unshare", CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID)


def _set_limits(limits: dict, extra_processes: int) -> None:
    mb = 1024 * 1024
    for which, soft, hard in ((resource.RLIMIT_CPU, limits["cpu_s"], limits["cpu_s"] + 1),
                              (resource.RLIMIT_AS, limits["memory_mb"] * mb, limits["memory_mb"] * mb),
                              (resource.RLIMIT_FSIZE, limits["file_mb"] * mb, limits["file_mb"] * mb),
                              (resource.RLIMIT_NPROC, limits["processes"] + extra_processes,
                               limits["processes"] + extra_processes),
                              (resource.RLIMIT_CORE, 0, 0)):
        resource.setrlimit(which, (soft, hard))


def _exec(config: dict) -> None:
    """Become the code: limits, no new privileges, exec (never returns)."""
    _libc_call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    _set_limits(config["limits"], config["extra_processes"])
    os.chdir(config["scratch"])
    os.execve(config["argv"][0], config["argv"], os.environ)


def _as_pid_one(config: dict, report: int) -> None:
    """Pid 1 of the run's PID namespace: fork the code, reap every orphan, and write the code's status to `report`
    (pid 1 ignores default-action signals, so the code runs as pid 2 and keeps normal signal behaviour)."""
    _libc_call("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the supervisor killed the bootstrap: die too
    child = os.fork()
    if child == 0:
        os.close(report)
        _exec(config)
    while True:
        pid, status = os.wait()
        if pid == child:
            os.write(report, json.dumps({"status": status}).encode())
            os._exit(0)  # the kernel then kills whatever else is left in the namespace


def _boot(config: dict) -> None:
    if config.get("probe"):
        got = []
        try:
            _enter_user_namespace(config["uid"], config["gid"])
            got.append("net")
            try:
                _read_only_except(config["scratch"])
                fs = True
            except OSError:
                fs = False
            _lock()
            got += ["fs", "pid"] if fs else ["pid"]
        except OSError:
            pass
        print(json.dumps(got))
        return
    if config["cgroup"]:  # before anything forks: every process of the run counts against pids.max
        with open(os.path.join(config["cgroup"], "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    isolation = set(config["isolation"])
    if not isolation:
        _exec(config)
    try:
        _enter_user_namespace(config["uid"], config["gid"])
        if "fs" in isolation:
            _read_only_except(config["scratch"])
        _lock()
    except OSError as e:
        print(f"sandbox: cannot set up the isolation the probe found ({e})", file=sys.stderr)
        os._exit(SETUP_FAILED)
    read, write = os.pipe()
    pid_one = os.fork()
    if pid_one == 0:
        os.close(read)
        _as_pid_one(config, write)
    os.close(write)
    report = b""
    while chunk := os.read(read, 4096):
        report += chunk
    os.waitpid(pid_one, 0)
    if not report:
        os._exit(SETUP_FAILED)
    status = json.loads(report)["status"]
    if os.WIFSIGNALED(status):  # die the same way, so the supervisor sees the code's signal
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


if __name__ == "__main__":
    _boot(json.loads(sys.argv[1]))
