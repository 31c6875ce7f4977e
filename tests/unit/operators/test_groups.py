"""GroupAssembler: a group is done when S members finish; its version is their minimum V_traj."""

import pytest

from rlflow.operators.groups import GroupAssembler
from rlflow.operators.policy import StalenessError


def opened(group_size, redundancy=0, version=0, members=()):
    g = GroupAssembler(group_size, redundancy)
    g.open("g", version)
    for m, v in members:
        g.launch("g", m, v)
    return g


def test_group_is_done_when_group_size_members_finish():
    g = opened(3, members=[("a", 0), ("b", 0), ("c", 0)])
    assert g.finish("g", "a") is None
    assert g.finish("g", "b") is None
    done = g.finish("g", "c")
    assert (done.gid, done.version, done.surplus) == ("g", 0, [])
    assert "g" not in g


def test_version_is_the_minimum_over_the_finished_members_only():
    g = opened(2, redundancy=1, version=1, members=[("old", 1), ("new", 3), ("newer", 4)])
    g.finish("g", "newer")
    done = g.finish("g", "new")
    assert done.version == 3  # "old" is still running: it is surplus, not part of the group
    assert done.surplus == ["old"]


def test_group_level_redundancy_returns_the_surplus_to_abort():
    # Figure 8(b), group level: S + r members launched, the first S to finish form the group
    g = opened(2, redundancy=2, members=[(i, 0) for i in range(4)])
    g.finish("g", 2)
    done = g.finish("g", 0)
    assert sorted(done.surplus) == [1, 3]


def test_partial_rollout_keeps_the_members_oldest_version():
    # a member interrupted and resumed on newer weights is not relaunched: its V_traj stays the launch one
    g = opened(1, members=[("m", 2)])
    assert g.running("g") == ["m"]
    assert g.finish("g", "m").version == 2


def test_abort_returns_running_members_and_forgets_the_group():
    g = opened(3, members=[("a", 0), ("b", 0)])
    g.finish("g", "a")
    assert g.abort("g") == ["b"]
    with pytest.raises(StalenessError, match="not open"):
        g.finish("g", "b")


@pytest.mark.parametrize(
    "misuse, message",
    [
        (lambda g: g.launch("g", "x", 0), r"member 'x' V_traj=0 is older than the group's reserved V_traj=1"),
        (lambda g: g.launch("g", "a", 1), r"member 'a' is already running"),
        (
            lambda g: g.launch("g", "z", 1) or g.launch("g", "w", 1),
            r"member 'w' would be launch 4, over group_size 2 \+ redundancy 1",
        ),
        (lambda g: g.finish("g", "nobody"), r"member 'nobody' is not running"),
        (lambda g: g.finish("other", "a"), r"group 'other' is not open"),
        (lambda g: g.open("g", 1), r"group 'g' is already open"),
    ],
)
def test_misuse_raises(misuse, message):
    g = opened(2, redundancy=1, version=1, members=[("a", 1), ("b", 2)])
    with pytest.raises(StalenessError, match=message):
        misuse(g)


def test_invalid_sizes_are_refused():
    with pytest.raises(StalenessError):
        GroupAssembler(0)
    with pytest.raises(StalenessError):
        GroupAssembler(2, redundancy=-1)
