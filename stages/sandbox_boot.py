"""The sandbox's child side: `python -I -S sandbox_boot.py CONFIG` enters the namespaces stages/sandbox.py probed,
sets the limits and execs the code. Its own file so it imports only what it needs: the bootstrap runs once per
sandboxed program, and importing the parent's modules (subprocess, dataclasses, tempfile) cost 30 ms a run.
"""

import ctypes
import json
import os
import resource
import signal
import sys

SETUP_FAILED = 125  # the bootstrap's exit status when a namespace it was asked for could not be set up

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
