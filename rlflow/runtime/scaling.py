"""Scaling a run's rollout fleets: `rlflow scale` requests and StreamRL's automatic rule (operators/elastic_rule.py).

A request is a small JSON file in the run's directory, `scale/<stage>.json` ({"instances": N}), written by
`rlflow scale` (request_scale below); the driver looks for new ones at most once a second and answers in
`scale/<stage>.status.json` (serving, starting and retiring instances). A file, not an RPC: it needs no port,
works the same on a laptop and on a cluster's head node, and a request made while the driver restarts
(`--resume`) is still there when it comes back.

Automatic scaling (`elastic.auto`) feeds operators/elastic_rule.py's monitor with every train step's time and the
instances' busy seconds and finished trajectories. Either way the fleet does the work (rollout_fleet.py:
scale_to): a new instance loads the current weights before it takes work; a leaving one hands its
trajectories back to the TS as partial rollouts, and its actor ends when it holds none.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from rlflow.operators.elastic_rule import ElasticMonitor, ElasticRule

POLL_S = 1.0


def scale_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "scale"


def request_scale(run_dir: Path, stage: str, instances: int) -> Path:
    """Ask the run in `run_dir` for `instances` serving instances of rollout stage `stage` (atomic write)."""
    d = scale_dir(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{stage}.json"
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"instances": instances, "requested_at": time.time()}))
    tmp.replace(path)
    return path


def read_status(run_dir: Path, stage: str) -> dict | None:
    path = scale_dir(run_dir) / f"{stage}.status.json"
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


class Scaling:
    """The elastic rollout stages of one run: applies requests and automatic decisions to their fleets."""

    def __init__(self, fleets, run_dir: Path, log=print):
        self.fleets = {f.stage: f for f in fleets if f.elastic}
        self.dir, self.log = scale_dir(run_dir), log
        self.seen: dict[str, int] = {}  # stage -> mtime_ns of the request last applied
        self.next_poll = 0.0
        self.monitors = {}
        for stage, f in self.fleets.items():
            e = f.elastic
            if e["auto"]:
                rule = ElasticRule(e["min_replicas"], e["max_replicas"], e["window_steps"])
                self.monitors[stage] = ElasticMonitor(rule, f.batch_groups * f.members)
            self.seen[stage] = 0  # a fresh run's directory is new; a resumed run applies the last request it was sent
        self.status = {}

    def _mtime(self, stage: str) -> int:
        try:
            return (self.dir / f"{stage}.json").stat().st_mtime_ns
        except FileNotFoundError:
            return 0

    def describe(self) -> str:
        parts = [f"{s}: {f.elastic['min_replicas']}..{f.elastic['max_replicas']} instances"
                 + (f", automatic every {f.elastic['window_steps']} steps" if s in self.monitors else "")
                 for s, f in self.fleets.items()]
        return f"elastic rollout (streamrl §4.3) {'; '.join(parts)}; `rlflow scale STAGE N` to resize"

    def tick(self, submit) -> None:
        """Every loop iteration: apply a new request (looked for once a second); keep the status file true.
        `submit` (the driver's Run._submit) takes the ready() call of each instance started (messages.Started)."""
        if not self.fleets:
            return
        now = time.monotonic()
        if now >= self.next_poll:
            self.next_poll = now + POLL_S
            for stage, f in self.fleets.items():
                mtime = self._mtime(stage)
                if mtime != self.seen[stage]:
                    self.seen[stage] = mtime
                    self._request(f, submit)
        for f in self.fleets.values():
            self._write_status(f)

    def _request(self, fleet, submit) -> None:
        try:
            n = int(json.loads((self.dir / f"{fleet.stage}.json").read_text())["instances"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            self.log(f"elastic: ignored an unreadable scale request for '{fleet.stage}' ({e}); use `rlflow scale`")
            return
        lo, hi = fleet.elastic["min_replicas"], fleet.elastic["max_replicas"]
        if not lo <= n <= hi:
            self.log(f"elastic: ignored a request for {n} instances of '{fleet.stage}': outside [{lo}, {hi}] "
                     f"(stages.{fleet.stage}.elastic)")
            return
        self.log(f"elastic: `rlflow scale` asks for {n} instance(s) of '{fleet.stage}': {fleet.scale_to(n, submit)}")
        self._restart(fleet.stage)

    def stepped(self, train_s: float, submit) -> None:
        """After every train step: the automatic rule's measurement, and a resize when it says so."""
        for stage, monitor in self.monitors.items():
            fleet = self.fleets[stage]
            if any(i.starting or i.retiring for i in fleet.instances):
                monitor.restart()  # measure the fleet as it will be
                continue
            m = monitor.observe(fleet.counters(), train_s)
            if m is None:
                continue
            if m.target != m.instances:
                self.log(f"{m.describe()}: {fleet.scale_to(m.target, submit)}")
                monitor.restart()

    def _restart(self, stage: str) -> None:
        if stage in self.monitors:
            self.monitors[stage].restart()

    def _write_status(self, fleet) -> None:
        status = {"serving": fleet.serving_count(), "starting": sum(i.starting for i in fleet.instances),
                  "retiring": sum(i.retiring for i in fleet.instances)}
        if status == self.status.get(fleet.stage):
            return
        self.status[fleet.stage] = status
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"{fleet.stage}.status.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(status | {"at": time.time()}))
        tmp.replace(path)
