"""CPU accounting for a benchmark's runs on Linux: the busy share of the whole machine (/proc/stat) and the CPU
seconds of every descendant process of the benchmark (/proc/<pid>/stat), sampled while a run goes on."""

from __future__ import annotations

import os
import resource
import threading
import time
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine since boot, from /proc/stat (idle and iowait are not busy)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    return total - fields[3] - fields[4], total


class TreeCPU:
    """CPU seconds of every descendant of this process, sampled from /proc/<pid>/stat while a run goes on.

    A process's cumulative utime+stime is kept at its last sample, so one that exits is still counted (up to one
    interval short). Ray's workers are children of the raylet, a child of `rlflow run`: all are descendants."""

    def __init__(self, interval: float = 1.0):
        self.interval, self.me = interval, os.getpid()
        self.cpu: dict[tuple[int, int], float] = {}  # (pid, start time) -> CPU seconds at the last sample
        self.series: dict[int, list[tuple[float, float]]] = {}  # pids to follow -> [(time, CPU seconds)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def follow(self, pid: int) -> None:
        self.series.setdefault(pid, [])

    def _sample(self) -> None:
        now, stats = time.time(), {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                text = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:
                continue
            rest = text[text.rindex(")") + 2:].split()
            stats[int(entry.name)] = (int(rest[1]), int(rest[19]), (int(rest[11]) + int(rest[12])) / CLK_TCK)
        children: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in stats.items():
            children.setdefault(ppid, []).append(pid)
        todo = list(children.get(self.me, []))
        while todo:
            pid = todo.pop()
            _, start, cpu = stats[pid]
            self.cpu[(pid, start)] = cpu
            if pid in self.series:
                self.series[pid].append((now, cpu))
            todo += children.get(pid, [])

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self):
        self.t0, self.machine0, self.rusage0 = time.time(), machine_busy(), _children_rusage()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        (b0, t0), (b1, t1) = self.machine0, machine_busy()
        self.wall = time.time() - self.t0
        self.tree_s = sum(self.cpu.values())
        self.machine = (b1 - b0) / max(t1 - t0, 1)
        self.reaped_s = _children_rusage() - self.rusage0  # exact for waited-for children only (not Ray's workers)

    def window_share(self, pid: int, start: float, end: float) -> float | None:
        """`pid`'s CPU between two wall-clock times, as a share of one core."""
        points = [(t, c) for t, c in self.series.get(pid, []) if start <= t <= end]
        if len(points) < 2 or points[-1][0] <= points[0][0]:
            return None
        return (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])


def _children_rusage() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


