"""Elastic rollout on the real stack: a run scaled 1 -> 2 -> 1 rollout instances by `rlflow scale` requests while it
trains. The added instance loads the current weights and generates; the removed one hands its trajectories back
(partial rollouts) and its actor ends; nothing is lost or trained twice, and the bound holds throughout."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from runs import plan_for
from test_run import assert_accounted

from rlflow.cli import main
from rlflow.runtime.scaling import read_status

pytestmark = pytest.mark.integration

CAP = 40  # steps planned; the scenario ends the run two steps after the instance left
SCENARIO_S = 240  # the scenario may add steps for this long, waiting for the added instance to start


def test_scale_one_two_one_during_a_run(ray_cluster, workdir, capsys):
    import ray

    from rlflow.compiler import write_plan
    from rlflow.runtime.driver import Run
    from rlflow.runtime.hooks import RunHooks

    plan = plan_for("bounded_async", f"stages.train.steps={CAP}", "stages.rollout.replicas=1",
                    "stages.rollout.elastic.max_replicas=2")
    write_plan(plan, ".rlflow/plan.json")  # what `rlflow scale` reads to check the stage and the bounds
    messages: list[str] = []

    class Scenario:
        """Asks for 2 instances after step 2 and for 1 once the second has served two steps, through `rlflow scale`
        (the command users type), from the driver's own loop so the timing does not depend on the machine."""

        phase, mark = "one", 0
        seen: list[tuple[int, int]] = []
        deadline = time.monotonic() + SCENARIO_S

        def on_step(self, run, _row):
            fleet = run.fleets[0]
            self.seen.append((run.step, fleet.serving_count()))
            if self.phase != "done" and run.step >= run.metrics.steps - 1 and time.monotonic() < self.deadline:
                run.metrics.steps += 1  # an instance starting (a new process importing torch) can outlast the steps
            if self.phase == "one" and run.step >= 2:
                assert main(["scale", "rollout", "2", "--run", str(run.out_dir)]) == 0
                self.phase = "growing"
            elif self.phase == "growing" and fleet.serving_count() == 2:
                self.phase, self.mark = "two", run.step
            elif self.phase == "two" and run.step >= self.mark + 2 and fleet.instances[1].finished:
                assert main(["scale", "rollout", "1", "--run", str(run.out_dir)]) == 0
                self.phase = "shrinking"
            elif self.phase == "shrinking" and fleet.serving_count() == 1 and not fleet.instances[1].alive:
                self.phase, run.metrics.steps = "done", run.step + 2  # end the run normally two steps later

    scenario = Scenario()
    run = Run(plan, out_dir=Path(".rlflow/runs/elastic"), log=messages.append, hooks=RunHooks(on_step=scenario.on_step))
    run.run()
    assert scenario.phase == "done", (scenario.phase, scenario.seen, [m for m in messages if "instance" in m])
    fleet = run.fleets[0]
    first, added = fleet.instances
    assert added.finished > 0 and added.joined_t is not None and added.left_t > added.joined_t  # it generated
    assert first.alive and not added.alive
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(added.handle.ready.remote(), timeout=60)  # its actor ended with it
    counts = [h["rollout_instances"] for h in run.history]
    assert counts[0] == 1 and 2 in counts and counts[-1] == 1
    assert counts.index(2) < len(counts) - 1 - counts[::-1].index(2)  # 1 ... 2 ... 1, in that order
    assert_accounted(run)  # conservation, the bound, and from the ledger: every group trained once
    assert run.counts["coord_resyncs"] == 0  # the speculative state followed the join and the departure
    assert any("joined" in m for m in messages) and any("left" in m for m in messages)
    assert read_status(run.out_dir, "rollout")["serving"] == 1
    assert all(0.0 <= h["rollout_idle_ratio"] <= 1.0 for h in run.history)
