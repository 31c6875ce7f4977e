"""A staleness bound far beyond any run (10^26) costs the staleness buffers no more than a small one: they walk the
buffers that exist, never the range eta spans (the driver once spun at 93% CPU there). Compile refuses such a
bound anyway (rule eta-out-of-range, tests/compile/invalid/eta_beyond_the_run.yaml)."""

from __future__ import annotations

import time

from rlflow.operators.policy_kinds import make_policy


def test_reserve_occupy_filter_and_consume_at_eta_1e26_take_milliseconds():
    m = make_policy("staleflow", batch_size=2, eta=10**26, batch_redundancy=1)
    t0 = time.perf_counter()
    for step in range(5):
        gids = [f"{step}-{i}" for i in range(4)]
        for gid in gids:
            assert m.verify(m.version)
            m.reserve(gid, m.version)
        m.filter(gids[0])  # a filtered group pulls later entries into its hole (the refill scan)
        for gid in gids[1:3]:
            m.occupy(gid)
        assert m.ready()
        batch = m.consume()
        assert sorted(e.gid for e in batch.entries) == sorted(gids[1:3])
        m.check_invariants()
    assert time.perf_counter() - t0 < 1.0
