"""stages/sandbox.py: hostile programs are contained and reported as failures, and the runner keeps going.

Each hostile run is followed by a good program that must still run fine. Tests of what only namespaces give
(no network, read-only filesystem) skip, saying so, where the machine refuses them; the limits-only fallback
(isolate=False) is tested on every machine.
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import replace

import pytest

from rlflow.stages import sandbox

# wall_s is generous because a Python start can take seconds on busy shared cores; the tests of the timeout use 2 s
LIMITS = sandbox.Limits(cpu_s=1, memory_mb=256, file_mb=1, processes=16, wall_s=20.0)
SHORT = replace(LIMITS, wall_s=2.0)
MODES = [pytest.param(True, id="isolated"), pytest.param(False, id="limits-only")]


def run(code: str, isolate: bool = True, limits: sandbox.Limits = LIMITS) -> sandbox.Result:
    return sandbox.run_python(code, limits=limits, isolate=isolate)


def still_works(isolate: bool) -> None:
    good = run("print(sum(range(10)))", isolate)
    assert good.ok and good.stdout == "45\n" and not good.timed_out, good


def test_a_good_program_runs_in_a_fresh_scratch_directory_with_a_minimal_environment(monkeypatch):
    monkeypatch.setenv("RLFLOW_TEST_SECRET", "hunter2")
    code = "import os, sys; print(os.getcwd()); print(sorted(os.environ)); print(sys.stdin.read() == '')"
    first, second = run(code), run(code)
    assert first.ok and first.returncode == 0 and first.killed_by is None, first
    cwd, env, stdin_empty = first.stdout.splitlines()
    assert cwd != second.stdout.splitlines()[0] and not os.path.exists(cwd)  # fresh each time, deleted afterwards
    assert "RLFLOW_TEST_SECRET" not in env and "HOME" in env and "TMPDIR" in env
    assert stdin_empty == "True"


def test_files_and_args_are_passed_and_output_is_capped():
    r = sandbox.run_python("import sys; print(open('data.txt').read(), sys.argv[1]); print('x' * 100_000)",
                           files={"data.txt": "hello"}, args=("world",), limits=sandbox.Limits(output_chars=50))
    assert r.ok and r.stdout.startswith("hello world\nxxx") and len(r.stdout) == 50


@pytest.mark.parametrize("isolate", MODES)
def test_an_infinite_loop_is_stopped_by_the_cpu_limit_or_the_timeout(isolate):
    r = run("while True: pass", isolate, SHORT)
    assert not r.ok and (r.killed_by == "SIGXCPU" or r.timed_out), r  # on busy cores 1 CPU-second may take > 2 s
    assert r.seconds < SHORT.wall_s + 2
    still_works(isolate)


@pytest.mark.parametrize("isolate", MODES)
def test_a_sleeping_program_is_killed_at_the_wall_clock_timeout(isolate):
    r = run("import time; time.sleep(60)", isolate, SHORT)
    assert not r.ok and r.timed_out and r.killed_by == "SIGKILL" and r.seconds < SHORT.wall_s + 2, r
    still_works(isolate)


@pytest.mark.parametrize("isolate", MODES)
def test_a_memory_hog_fails(isolate):
    r = run("x = bytearray(2 * 1024**3)", isolate)
    assert not r.ok and "MemoryError" in r.stderr, r
    still_works(isolate)


@pytest.mark.parametrize("isolate", MODES)
def test_a_fork_bomb_is_capped_by_the_process_limit(isolate):
    if "nproc" not in sandbox.run_python("pass", isolate=isolate).isolation:
        pytest.skip("no process limit holds here (running as root without a pids cgroup): a fork bomb would only "
                    "be stopped by the timeout, so it is not run")
    r = run("import os\nwhile True:\n    os.fork()", isolate, SHORT)
    assert not r.ok, r
    assert "BlockingIOError" in r.stderr or r.timed_out, r  # fork refused: "Resource temporarily unavailable"
    still_works(isolate)


@pytest.mark.parametrize("isolate", MODES)
def test_a_large_file_is_capped_by_the_file_size_limit(isolate):
    r = run("open('big', 'wb').write(b'x' * 4 * 1024**2)", isolate)
    assert not r.ok and "File too large" in r.stderr, r
    still_works(isolate)


@pytest.mark.parametrize("isolate", MODES)
def test_writing_to_a_read_only_file_outside_the_scratch_directory_fails(tmp_path, isolate):
    read_only_view = isolate and sandbox.filesystem_isolated()
    if not read_only_view and os.geteuid() == 0:
        pytest.skip("no read-only mount namespace and running as root: file permissions do not bind root, so the "
                    "sandbox cannot stop this write (limits-only mode)")
    target = tmp_path / "outside.txt"
    target.write_text("original")
    target.chmod(0o444)
    r = run(f"open({str(target)!r}, 'w').write('overwritten')", isolate)
    assert ("Read-only file system" if read_only_view else "Permission denied") in r.stderr, r
    assert not r.ok and target.read_text() == "original", r
    still_works(isolate)


def test_with_a_read_only_view_nothing_outside_the_scratch_directory_is_writable(tmp_path):
    if not sandbox.filesystem_isolated():
        pytest.skip("the machine refuses user/mount namespaces: without them the sandbox can write wherever its uid "
                    "can (RLIMIT_FSIZE still caps each file)")
    writable = tmp_path / "writable"
    writable.mkdir()
    writable.chmod(0o777)
    code = f"""
import os
for path in [{str(writable / 'new')!r}, '/tmp/rlflow-sandbox-escape', '/var/tmp/rlflow-sandbox-escape']:
    try:
        open(path, 'w').write('x')
        print('WROTE', path)
    except OSError as e:
        print('blocked', e.errno)
try:
    os.chmod({str(writable)!r}, 0o700)
    print('CHMOD')
except OSError as e:
    print('blocked', e.errno)
open('inside.txt', 'w').write('fine')
print('inside ok')
"""
    r = run(code)
    assert r.ok and "WROTE" not in r.stdout and "CHMOD" not in r.stdout and "inside ok" in r.stdout, r
    assert not (writable / "new").exists() and not os.path.exists("/tmp/rlflow-sandbox-escape")
    assert not os.path.exists("/var/tmp/rlflow-sandbox-escape")
    still_works(True)


@pytest.fixture
def listener():
    """A TCP listener on 127.0.0.1 that this test opens (the only address the network test connects to)."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list = []

    def accept():
        try:
            conn, _ = server.accept()
            accepted.append(conn.recv(16))
            conn.close()
        except OSError:
            pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    server.close()
    thread.join(timeout=2)


def connect_to(port: int) -> str:
    return (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "s.sendall(b'escaped')\nprint('CONNECTED')")


def test_the_sandbox_has_no_network_not_even_the_hosts_loopback(listener):
    port, accepted = listener
    if not sandbox.network_isolated():
        pytest.skip("this machine refuses the sandbox its own network namespace (user namespaces unavailable): "
                    "sandboxed code has the host's network here; test_limits_only_mode_keeps_the_network shows it")
    r = run(connect_to(port))
    assert not r.ok and "CONNECTED" not in r.stdout and "Network is unreachable" in r.stderr, r
    assert accepted == []
    assert "net" in r.isolation
    still_works(True)


def test_limits_only_mode_keeps_the_network(listener):
    """The fallback, stated plainly: without a network namespace the code reaches the host's loopback."""
    port, _ = listener
    r = run(connect_to(port), isolate=False)
    print(f"sandbox isolation on this machine: {sandbox.isolation_available() or 'none (limits only)'}")
    assert r.ok and "CONNECTED" in r.stdout and "net" not in r.isolation, r
    still_works(False)


def test_a_process_that_leaves_the_group_dies_with_the_run():
    if "pid" not in sandbox.isolation_available():
        pytest.skip("no PID namespace here: a process that calls setsid survives the process-group kill")
    marker = "61.2345"  # the daemon's `sleep` argument, to find it again
    code = f"import os\nif os.fork() == 0:\n    os.setsid()\n    os.execv('/bin/sleep', ['sleep', {marker!r}])\nprint(os.getpid())"
    r = run(code)
    assert r.ok and r.stdout.strip() == "2", r  # pid 2 inside the run's own PID namespace
    assert not [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p) == f"sleep {marker}"]


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""
