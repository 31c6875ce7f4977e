"""The rollout coordinator (runtime/rollout_coordinator.py) on fake instances: plain objects with the fields of
rollout_fleet.RolloutInstance that the coordinator reads and writes, and no actor behind them."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlflow.operators.routing import CostModel
from rlflow.plan_read import PlanCoordination
from rlflow.runtime.rollout_coordinator import RolloutCoordinator
from rlflow.stages.engine import EngineSnapshot
from rlflow.stages.trajectory import Trajectory


@dataclass
class FakeInstance:
    """Stands in for a rollout instance between two steps: what was routed to it and its last report."""

    index: int
    version: int = 0
    alive: bool = True
    retiring: bool = False
    ref: object = None
    routes: list = field(default_factory=list)
    aborts: list = field(default_factory=list)
    interrupts: list = field(default_factory=list)
    pull: object = None
    snapshot: dict | None = None
    running: dict = field(default_factory=dict)

    @property
    def serving(self) -> bool:
        return self.alive and not self.retiring


def coordinator(instances, max_running: int = 8) -> RolloutCoordinator:
    pc = PlanCoordination(routing="least_loaded", migration="none", sync="global", partial_rollout=False,
                          interval_s=0.1, dispatch={"kind": "round_robin"}, profile=None)
    cost = CostModel(k1=0.0, k2=0.0, k3=0.0, k4=0.0, max_running=max_running)
    return RolloutCoordinator(pc, cost, instances, counts={}, log=lambda *a: None)


def group(gid: str, n: int = 2) -> list[Trajectory]:
    return [Trajectory(group_id=gid, index=i, prompt="p", answer="a", prompt_ids=[1, 2, 3]) for i in range(n)]


class Policy:
    """The staleness side of a cycle: admits every version and records the reservations and launches."""

    def __init__(self):
        self.reserved, self.launched = {}, []

    def verify(self, version: int) -> bool:
        return True

    def reserve(self, gid: str, version: int) -> None:
        self.reserved[gid] = version

    def launch(self, row: Trajectory) -> None:
        self.launched.append(row.traj_id)


def routed_groups(c, instances, groups: list[str]) -> Policy:
    for gid in groups:
        c.queue.add_group(gid, group(gid))
    policy = Policy()
    assert c.cycle(instances, 0, None, policy.verify, policy.reserve, policy.launch) is not None
    return policy


def one_instance_with_a_group(delivered: int):
    """A coordinator whose one instance was routed a group of two; its first `delivered` routes reached the worker
    (the others are still queued for its next step). Returns the coordinator, the instances and the routed rows."""
    instances = [FakeInstance(0)]
    c = coordinator(instances)
    routed_groups(c, instances, ["g"])
    rows = list(instances[0].routes)
    instances[0].routes = rows[delivered:]
    return c, instances, rows


def test_routing_puts_every_waiting_group_on_the_alive_instances_only():
    instances = [FakeInstance(0), FakeInstance(1, alive=False), FakeInstance(2)]
    c = coordinator(instances)
    policy = routed_groups(c, instances, ["g0", "g1", "g2"])
    assert not c.queue.views()  # nothing left waiting: there was room
    assert not instances[1].routes and not instances[1].running  # the dead one gets nothing
    on = {i.index: sorted(r.traj_id for r in i.routes) for i in instances if i.routes}
    assert set(on) == {0, 2}  # least-loaded: both alive instances get work
    assert sorted(t for ts in on.values() for t in ts) == sorted(policy.launched) == [
        f"g{g}/{m}" for g in range(3) for m in range(2)]
    assert policy.reserved == {"g0": 0, "g1": 0, "g2": 0}  # reserved on the version the instances run
    assert all(r.version == 0 for i in instances for r in i.routes)
    assert all(set(i.running) == {r.traj_id for r in i.routes} for i in instances)
    assert c.counts["coord_routed"] == 6 and c.counts["coord_cycles"] == 1


def test_a_dead_instances_work_goes_back_to_the_trajectory_server():
    instances = [FakeInstance(0), FakeInstance(1)]
    c = coordinator(instances)
    routed_groups(c, instances, ["g0", "g1"])
    dead = next(i for i in instances if len(i.routes) >= 2)
    delivered, queued = dead.routes[0], dead.routes[1]
    dead.routes = [queued]  # the first route reached the worker, which generated some tokens before dying
    delivered.completion_ids, delivered.behaviour_logprobs, delivered.versions_seen = [9, 9], [-0.1, -0.2], [0]
    orphans = list(dead.running.values())
    c.orphaned(dead, orphans)
    waiting = {v.tid: v for v in c.queue.views()}
    assert set(waiting) == {r.traj_id for r in orphans}  # every one of its trajectories waits to be routed again
    restarted = c.queue.pop(delivered.traj_id)
    assert restarted.completion_ids == [] and restarted.behaviour_logprobs == [] and restarted.versions_seen == []
    assert restarted.version == c.queue.reserved[delivered.group_id]  # from its prompt, with its group's V_traj
    assert c.queue.pop(queued.traj_id) is queued  # a route it never received goes back as it was


def test_an_interrupted_trajectory_waits_in_transit_until_its_instance_returns_it():
    c, instances, (delivered, queued) = one_instance_with_a_group(delivered=1)
    inst = instances[0]
    assert c.release(inst) == 2
    # the route never delivered is back in the TS at once; the one on the worker is asked back and waits
    assert [v.tid for v in c.queue.views()] == [queued.traj_id]
    assert inst.interrupts == [delivered.traj_id] and not inst.routes
    c.sent(inst)
    delivered.completion_ids, delivered.version = [4, 5], 0
    assert c.returned(inst, [delivered], instances) == 0  # the worker handed it back: nothing lost
    view = next(v for v in c.queue.views() if v.tid == delivered.traj_id)
    assert view.v_traj == 0 and view.tokens == 5.0  # a partial rollout, with the tokens generated so far
    assert delivered.traj_id not in inst.running


def test_an_interrupt_that_finds_nothing_to_return_restarts_the_trajectory_from_its_prompt():
    c, instances, _ = one_instance_with_a_group(delivered=2)
    inst = instances[0]
    c.release(inst)
    c.sent(inst)
    assert c.returned(inst, [], instances) == 2  # neither returned nor reported finished
    assert sorted(v.tid for v in c.queue.views()) == ["g/0", "g/1"] and not inst.running


def test_an_abort_reaches_the_worker_only_for_a_trajectory_it_received():
    c, instances, (received, queued) = one_instance_with_a_group(delivered=1)
    inst = instances[0]
    assert c.abort(inst, queued.traj_id) is False and inst.routes == []  # still queued here: dropped here
    assert c.abort(inst, received.traj_id) is True  # on the worker: it must be told


def test_a_poke_makes_a_cycle_due_for_an_instance_left_idle_but_not_for_busy_ones():
    inst = FakeInstance(0)
    c = coordinator([inst])
    c.next_cycle = 1e9  # the periodic cycle is far off
    c.idle_after_cycle = {0}  # the last cycle left it without work: it waits for the period...
    assert not c.due(0.0, [inst])
    c.poke()  # ...unless the policy's state changed (a step trained, groups were filtered out)
    assert c.due(0.0, [inst])
    busy = FakeInstance(0, snapshot=None, routes=group("g"))
    assert not c.due(0.0, [busy])  # an instance with work is not interrupted by a poke
    c.cycle([inst], 0, None, Policy().verify, lambda reserve: reserve, lambda row: None)
    assert not c.poked and not c.due(0.0, [inst])  # a cycle answers the poke


def engine_snapshot(run: list, wait: list = ()) -> EngineSnapshot:
    """An engine's report with these trajectories running and waiting."""
    return EngineSnapshot(instance=0, version=0, kv_cache=0, run_trajs=list(run), wait_trajs=list(wait),
                          complete_trajs=0, max_running=2)


class Refuses(Policy):
    """A staleness policy that admits nothing (a barrier waiting for the trainer)."""

    def verify(self, version: int) -> bool:
        return False


def test_an_instance_filled_to_max_running_is_refilled_as_soon_as_it_has_room():
    inst = FakeInstance(0)
    c = coordinator([inst], max_running=2)
    routed_groups(c, [inst], ["g0", "g1"])  # room for one group of two: the other waits in the TS
    c.next_cycle = 1e9  # the periodic cycle is far off
    assert len(inst.running) == 2 and len(c.queue.views()) == 2 and c.room_wait
    assert not c.due(0.0, [inst])  # full: nothing to do
    done = next(iter(inst.running))
    inst.routes = []  # delivered; the engine runs both, then one finishes
    inst.snapshot = engine_snapshot(run=[t for t in inst.running if t != done])
    inst.running.pop(done)
    assert c.due(0.0, [inst])  # one slot free and work waiting: refill now, not when the instance has drained
    inst.snapshot = engine_snapshot(run=list(inst.running), wait=["x"])
    assert not c.due(0.0, [inst])  # its engine still has one waiting: routing would not give it more


def test_a_cycle_that_had_room_and_routed_nothing_ends_the_wait_for_room():
    inst = FakeInstance(0)
    c = coordinator([inst], max_running=2)
    c.queue.add_group("g0", group("g0"))
    c.room_wait = True
    c.next_cycle = 1e9
    policy = Refuses()
    assert c.cycle([inst], 0, None, policy.verify, policy.reserve, policy.launch) is not None
    assert not inst.running and not c.room_wait  # the TS's work is held back by the policy, not by room
    c.idle_after_cycle = {0}
    assert not c.due(0.0, [inst])  # so an idle instance waits for a poke or the period, as before
