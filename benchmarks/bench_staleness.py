"""Microbenchmark of the staleness policies: reserve, occupy, consume and verify at B = 2048, eta = 4.

    python benchmarks/bench_staleness.py [--batch-size 2048] [--eta 4] [--steps 20] [--repeat 3]

Steady state: (eta + 1) * B groups tracked (the most StaleFlow ever tracks); each step B random
in-flight groups complete (occupy), the trainer consumes a batch, and B new groups are verified and
reserved. As timeit does, the garbage collector is off while timing (a full collection lands in whatever
call is running); each figure is the best mean of --repeat runs, as shared cores are noisy. Prints a
table and writes it to benchmarks/results/staleness.md.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import sys
import time
from pathlib import Path

from rlflow.operators.policy_kinds import make_policy

OPS = ("reserve", "occupy", "consume", "verify")
RESULTS = Path(__file__).parent / "results" / "staleness.md"


def configs(eta: int, batch_size: int) -> list[tuple[str, str, dict, bool]]:
    """(row label, kind, make_policy keywords, dispatch on mixed older versions)."""
    return [
        ("staleflow", "staleflow", {"eta": eta}, False),
        ("staleflow, mixed V_traj", "staleflow", {"eta": eta}, True),
        ("synchronous", "synchronous", {}, False),
        ("one_step", "one_step", {}, False),
        ("in_flight_limit", "in_flight_limit", {"eta": eta}, False),
        ("queue_drop (Q = 2B)", "queue_drop", {"capacity": 2 * batch_size, "eta": eta}, False),
        ("queue_max", "queue_max", {"eta": eta}, False),
        ("unbounded", "unbounded", {}, False),
    ]


class Clock:
    """Accumulated seconds and calls per operation."""

    def __init__(self):
        self.seconds = dict.fromkeys(OPS, 0.0)
        self.calls = dict.fromkeys(OPS, 0)

    def add(self, op: str, seconds: float, calls: int) -> None:
        self.seconds[op] += seconds
        self.calls[op] += calls

    def us_per_op(self, op: str) -> float:
        return 1e6 * self.seconds[op] / self.calls[op]


def best(clocks: list[Clock]) -> dict[str, float]:
    """µs per call of each operation: the lowest mean over repeated runs."""
    return {op: min(c.us_per_op(op) for c in clocks) for op in OPS}


def admit(policy, in_flight: list, n: int, next_gid: int, rng: random.Random, mixed: bool, clock: Clock) -> int:
    """Verify then reserve up to n new groups (an older V_traj first when mixed); returns the next unused id."""
    span = (policy.eta or 0) if mixed else 0
    clock_ = time.perf_counter
    for gid in range(next_gid, next_gid + n):
        v = max(0, policy.version - rng.randint(0, span))
        t0 = clock_()
        ok = policy.verify(v) or (v != policy.version and policy.verify(v := policy.version))
        t1 = clock_()
        clock.add("verify", t1 - t0, 1)
        if not ok:
            break
        policy.reserve(gid, v)
        clock.add("reserve", clock_() - t1, 1)
        in_flight.append(gid)
    return next_gid + n


def complete(policy, in_flight: list, n: int, clock: Clock) -> None:
    """Occupy n random in-flight groups."""
    done = [in_flight.pop() for _ in range(min(n, len(in_flight)))]
    t = time.perf_counter()
    for gid in done:
        policy.occupy(gid)
    clock.add("occupy", time.perf_counter() - t, len(done))


def run(kind: str, kw: dict, mixed: bool, batch_size: int, eta: int, steps: int, seed: int = 0) -> Clock:
    """Drive one policy through `steps` training steps in steady state."""
    rng = random.Random(seed)
    policy = make_policy(kind, batch_size=batch_size, **kw)
    clock = Clock()
    in_flight: list = []
    tracked = (eta + 1) * batch_size
    next_gid = admit(policy, in_flight, tracked, 0, rng, False, clock)
    for _ in range(steps):
        gc.collect()
        rng.shuffle(in_flight)
        complete(policy, in_flight, batch_size, clock)
        while not policy.ready():  # mixed V_traj: an older group may still hold the batch back
            if not in_flight:
                raise RuntimeError(f"{kind}: nothing in flight and no batch ready")
            complete(policy, in_flight, 1, clock)
        t = time.perf_counter()
        policy.consume()
        clock.add("consume", time.perf_counter() - t, 1)
        room = tracked - policy.counters.in_flight - policy.counters.pending
        next_gid = admit(policy, in_flight, room, next_gid, rng, mixed, clock)
        policy.check_invariants()
    return clock


def table(rows: list[tuple[str, dict[str, float]]], batch_size: int) -> str:
    head = "| policy | " + " | ".join(f"{op} µs/op | {op} ops/s" for op in OPS) + " |"
    rule = "|---|" + "---:|" * (2 * len(OPS))
    lines = [head, rule]
    for label, us in rows:
        cells = [f"{us[op]:.2f} | {1e6 / us[op]:,.0f}" for op in OPS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    note = f"consume is one call per training step: it hands over a whole batch of {batch_size} groups."
    return "\n".join(lines) + f"\n\n{note}\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--eta", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    gc.disable()  # run() collects between steps, outside the timed calls
    try:
        rows = [
            (label, best([run(kind, kw, mixed, args.batch_size, args.eta, args.steps) for _ in range(args.repeat)]))
            for label, kind, kw, mixed in configs(args.eta, args.batch_size)
        ]
    finally:
        gc.enable()
    text = table(rows, args.batch_size)
    print(text)
    header = (
        f"# Staleness policy microbenchmark\n\n"
        f"`python benchmarks/bench_staleness.py --batch-size {args.batch_size} --eta {args.eta} --steps {args.steps}"
        f" --repeat {args.repeat}`"
        f" (B = {args.batch_size}, eta = {args.eta} where the policy takes one; one_step has eta = 1, synchronous 0).\n"
        f"Steady state with (eta + 1) * B groups tracked; each step B random in-flight groups occupy, one batch is\n"
        f"consumed, B new groups are verified and reserved at the current version (mixed V_traj: a random version\n"
        f"up to eta behind). GC off while timing; best mean of {args.repeat} runs. Python {platform.python_version()} on"
        f" {platform.machine()}, {os.cpu_count()} shared cores: read the numbers as orders of magnitude.\n\n"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(header + text)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
