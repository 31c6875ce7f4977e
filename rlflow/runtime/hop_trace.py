"""Where a step's time goes between actors: a timestamp each time a group or a weight version crosses a hop.

Off (one dict lookup per call) unless the environment names a directory in RLFLOW_HOP_TRACE; then every process
of the run (the driver, the rollout workers, the payload store, the reward stream's Ray Data actors, the trainer)
appends one JSON line per mark to <dir>/<pid>.jsonl: {"hop": name, "key": group id or version, "t": wall-clock
seconds}. Wall-clock time (time.time) is the one clock every process on a machine shares; on several machines
the spans are only as good as their clocks' agreement. benchmarks/bench_step_latency.py reads the lines back and
prints the hop table. launch.py passes the variable on to Ray's workers.

The hops, in a group's order (key: group id) and then a version's (key: the version):

  routed     rollout_worker: the engine takes a member (the first member's time is kept)
  generated  rollout_worker: a member finished (the last member's time is kept)
  stored     rollout_worker: the finished members are in the payload store
  pulled     reward_stream's source: the group left the store for Ray Data
  scored     reward_stream Score: its rewards and the group filter's verdict are computed
  streamed   reward_stream: the stream handed it to the host's queue
  received   driver: the scored group is in the buffer
  consumed   driver: the buffer released it into a train step
  taken      trainer_worker: the step's payloads are out of the store (key: the version the step publishes)
  computed   trainer_worker: the step's forward, backward and update are done
  published  trainer_worker: the new version is in the parameter server
  trained    driver: the step's result arrived
  pulling    rollout_worker: an instance starts loading the version
  loaded     rollout_worker: the version is loaded

and, beside the path, `decoding` / `decoded` around each engine.step call (key: instance-<id>): the engine's compute.
"""

from __future__ import annotations

import json
import os
import time

ENV = "RLFLOW_HOP_TRACE"
_file = None


def enabled() -> bool:
    return bool(os.environ.get(ENV))


def mark(hop: str, keys, t: float | None = None) -> None:
    """Note that `keys` (a group id or version, or an iterable of them, repeats written once) crossed `hop` now
    (or at `t`). Callers on the run's hot paths pass a generator: with the trace off it is never iterated."""
    directory = os.environ.get(ENV)
    if not directory:
        return
    global _file
    if _file is None:
        os.makedirs(directory, exist_ok=True)
        _file = open(os.path.join(directory, f"{os.getpid()}.jsonl"), "a", buffering=1)  # noqa: SIM115 - the process's life
    t = time.time() if t is None else t
    for key in ([keys] if isinstance(keys, (str, int)) else dict.fromkeys(keys)):
        _file.write(json.dumps({"hop": hop, "key": key, "t": t}) + "\n")
