"""`rlflow tune` (rlflow/tune.py, rlflow/tune_report.py): closed-form pruning, simulated ranking, the Pareto front and the choice."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from rlflow.cli import main
from rlflow.compiler import compile_pipeline
from rlflow.stages import smollm2
from rlflow.tune import MIX_TOLERANCE, Candidate, _divide, simulate_point, split_grid, tune
from rlflow.tune_report import choose, overrides

REPO = Path(__file__).resolve().parents[3]
TABLE4 = str(REPO / "configs" / "profiles" / "staleflow-table4-qwen3-30b-a3b.json")
AT_SCALE = ["stages.buffer.batch_groups=32", "stages.rollout.group_size=8", "stages.rollout.max_running=256"]


def test_instances_are_divided_between_stages_in_proportion_at_least_one_each():
    assert _divide(8, [1, 1]) == (4, 4) and _divide(5, [1, 1]) == (3, 2) and _divide(2, [3, 1]) == (1, 1)
    for k in range(3, 40):
        for w in ([1, 2], [5, 1, 1], [2, 2, 3]):
            d = _divide(k, w)
            assert sum(d) == k and min(d) >= 1
            assert all(abs(x - 1 - (k - len(w)) * wi / sum(w)) < 1 for x, wi in zip(d, w))  # within one of exact


def test_split_grid_is_whole_instances_and_bounded():
    grid = split_grid(64, 2)
    assert len(grid) <= 9 and all(r % 2 == 0 and r + t == 64 and t >= 1 for r, t in grid)
    assert split_grid(4, 1) == [(1, 3), (2, 2), (3, 1)]


@pytest.fixture(scope="module")
def tuned():
    plan = compile_pipeline(REPO / "pipelines" / "staleflow.yaml", AT_SCALE)
    candidates, notes = tune(plan, gpus=32, steps=12, profile=TABLE4, per_instance=2, progress=lambda *a: None)
    return plan, candidates, notes


def test_only_splits_whose_closed_form_bound_cannot_win_are_pruned(tuned):
    _, candidates, notes = tuned
    ran = [c for c in candidates if c.result]
    screened = [c for c in candidates if c.screen]
    (shipped,) = [c for c in candidates if c.shipped]
    reached = shipped.runs[0]["tokens_per_s"]  # full length, seed 0
    limit = max(shipped.knob, shipped.runs[0]["max_staleness"])
    looser = [c for c in candidates if c.knob > limit and c.rollout_gpus != shipped.rollout_gpus]
    for c in candidates:  # a pruned split's optimistic bound is below what the shipped setting reached, and only that;
        # an eta over the shipped max staleness is screened at the shipped split only (the Pareto table's)
        assert bool(c.screen) == (c.shipped or (c.bound > reached and all(c is not o for o in looser))), c
        for r in [c.screen, *c.runs]:  # and the bound is a bound: nothing simulated beats it
            assert not r or r["tokens_per_s"] <= c.bound * 1.001, c
    assert looser and any(c.screen and c.knob > limit for c in candidates)
    assert ran and len(screened) > len(ran)  # only the few worth it ran full length
    assert all(c.runs for c in ran) and all(len(c.runs) == 2 for c in ran)
    assert any("trainer speed per GPU assumed" in n for n in notes)  # what it assumed, it says
    assert all(r["max_staleness"] <= c.knob for c in screened for r in [c.screen, *c.runs])  # each bound is honoured
    front = [c for c in screened if c.pareto]
    for c in front:  # nothing on the front is beaten on both axes (screening runs: same length and seed)
        assert not any(o.screen["tokens_per_s"] > c.screen["tokens_per_s"]
                       and o.screen["mean_staleness"] < c.screen["mean_staleness"] for o in screened)
    assert front


def test_the_choice_is_at_least_as_fast_as_the_shipped_setting_within_its_staleness(tuned):
    plan, candidates, _ = tuned
    (shipped,) = [c for c in candidates if c.shipped]
    best = choose(candidates)
    assert best.result["tokens_per_s"] >= shipped.result["tokens_per_s"]
    assert best.result["max_staleness"] <= shipped.result["max_staleness"]
    sets = overrides(plan, best)
    assert best.instances == best.rollout_gpus // 2 and sets[0] == f"stages.rollout.replicas={best.instances}" and sets[1].endswith(f".eta={best.knob}")
    again = compile_pipeline(REPO / "pipelines" / "staleflow.yaml", AT_SCALE + sets)  # the recommendation compiles
    assert again["control"]["staleness"]["eta"] == best.knob


def test_cli_prints_the_table_and_a_compile_command(capsys):
    rc = main(["tune", str(REPO / "pipelines" / "bounded_async.yaml"), "--gpus", "8", "--steps", "6",
               "--profile", TABLE4, "--gpus-per-instance", "2"])
    out = capsys.readouterr().out
    assert rc == 0 and "| rollout GPUs | train GPUs |" in out and "recommended:" in out
    assert "rlflow compile " in out and "--set stages.rollout.replicas=" in out


def test_too_few_gpus_is_a_clear_error(capsys):
    rc = main(["tune", str(REPO / "pipelines" / "bounded_async.yaml"), "--gpus", "2", "--profile", TABLE4,
               "--gpus-per-instance", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "cannot hold one rollout instance" in err and "Traceback" not in err
    assert "--gpus: 2 GPUs" in err and "[bad-tune]" in err


def test_a_simulation_that_cannot_run_is_reported_as_such_not_as_a_bad_argument(capsys):
    """Lengths that cannot fit the engine's KV budget are the simulator's error (SimConfigError): reported at `tune`
    with its own rule, not blamed on --gpus."""
    rc = main(["tune", str(REPO / "pipelines" / "quickstart.yaml"), "--gpus", "16", "--steps", "5", "--jobs", "1",
               "--set", "workload.length_cap=2000000", "--set", "workload.mean_length=1500000"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "tune: lengths:" in err and "cannot fit the KV budget" in err and "[bad-simulation]" in err


def test_overrides_name_the_edge_that_carries_the_knob():
    """streamrl's first edge is a skew-aware dispatch: the queue capacity must go on the buffer -> train edge."""
    plan = compile_pipeline(REPO / "pipelines" / "streamrl.yaml")
    sets = overrides(plan, Candidate(4, 4, 2, 32))
    assert sets == ["stages.rollout.replicas=2", "edges.3.policy.capacity=32"]
    assert compile_pipeline(REPO / "pipelines" / "streamrl.yaml", sets)["control"]["staleness"]["capacity"] == 32


def test_a_lead_seen_on_one_seed_only_is_not_recommended(monkeypatch):
    """One point is 10% ahead on seed 0 and 20% behind on seed 1: the confirmation seed exposes it."""
    def fake(config, policy=None):
        tokens = 50.0 * config.eta
        if config.instances == 3 and config.eta == 2:  # the lucky point: 6 rollout GPUs, eta 2
            tokens = {0: 110.0, 1: 80.0}[config.seed]
        return SimpleNamespace(trained_tokens_per_s=tokens, mean_staleness=config.eta - 0.5, max_staleness=config.eta,
                               rollout_idle_ratio=0.0, trainer_idle_ratio=0.0, stages={}, events=config.steps, step_events=list(range(1, config.steps + 1)))

    monkeypatch.setattr("rlflow.sim.simulate", fake)
    plan = compile_pipeline(REPO / "pipelines" / "bounded_async.yaml")
    candidates, _ = tune(plan, gpus=8, steps=6, profile=TABLE4, per_instance=2, progress=lambda *a: None)
    (lucky,) = [c for c in candidates if c.instances == 3 and c.knob == 2]
    best = choose(candidates)
    assert best is not lucky and best.shipped and best.result["tokens_per_s"] == 100.0
    assert lucky.screen["tokens_per_s"] == 110.0  # the lucky screen earned it a confirmation...
    assert [r["tokens_per_s"] for r in lucky.runs] == [110.0, 80.0] and lucky.result["tokens_per_s"] == 95.0
    screened_only = [c for c in candidates if c.screen and len(c.runs) < 2]  # a full-length screen is one run
    assert screened_only and all(c is not best for c in screened_only)  # unconfirmed points are not eligible


def test_screening_is_short_and_only_contenders_run_full_length(monkeypatch):
    """Screens are seed 0 at a third of the steps; the shipped point and CONTENDERS others run full length, 2 seeds."""
    calls = []

    def fake(config, policy=None):
        calls.append((config.instances, config.eta, config.steps, config.seed))
        return SimpleNamespace(trained_tokens_per_s=10.0 * config.instances + config.eta, mean_staleness=1.0,
                               max_staleness=min(config.eta, 2), rollout_idle_ratio=0.0, trainer_idle_ratio=0.0, stages={}, events=config.steps, step_events=list(range(1, config.steps + 1)))

    monkeypatch.setattr("rlflow.sim.simulate", fake)
    plan = compile_pipeline(REPO / "pipelines" / "bounded_async.yaml")
    candidates, _ = tune(plan, gpus=16, steps=30, profile=TABLE4, per_instance=2, progress=lambda *a: None)
    screens = [c for c in calls if c[2] == 10]
    full = [c for c in calls if c[2] == 30]
    assert screens and all(c[3] == 0 for c in screens) and len(screens) + len(full) == len(calls)
    confirmed = [c for c in candidates if c.runs]
    assert len(confirmed) == 4 and sum(c.shipped for c in confirmed) == 1  # shipped + CONTENDERS
    assert sorted(full) == sorted((c.instances, c.knob, 30, s) for c in confirmed for s in (0, 1))
    best = choose(candidates)
    assert best.runs and best.result["max_staleness"] <= 2 and best.instances == 7  # fastest within eta 2


def test_a_screen_that_costs_most_of_a_full_run_is_run_at_full_length(monkeypatch):
    """When a short run would take as many events as a full one (a warm-up dominates: the shipped point's full run
    counts the events by each step), screens run at full length with seed 0 and are the contenders' first seed: each contender then needs one more run, not two."""
    calls = []

    def fake(config, policy=None):
        calls.append((config.instances, config.eta, config.steps, config.seed))
        return SimpleNamespace(trained_tokens_per_s=10.0 * config.instances + config.eta, mean_staleness=1.0,
                               max_staleness=min(config.eta, 2), rollout_idle_ratio=0.0, trainer_idle_ratio=0.0,
                               stages={}, events=1000 + config.steps,
                               step_events=[1000 + i for i in range(1, config.steps + 1)])

    monkeypatch.setattr("rlflow.sim.simulate", fake)
    plan = compile_pipeline(REPO / "pipelines" / "bounded_async.yaml")
    lines = []
    candidates, _ = tune(plan, gpus=16, steps=30, profile=TABLE4, per_instance=2, progress=lines.append)
    assert any("screening at full length" in line for line in lines)
    assert not [c for c in calls if c[2] == 10]  # the shipped point's full run said what a short one would cost
    contenders = [c for c in candidates if len(c.runs) == 2 and not c.shipped]
    assert len(contenders) == 3 and all(c.screen is c.runs[0] for c in contenders)
    assert sorted(c for c in calls if c[3] == 1) == sorted((c.instances, c.knob, 30, 1) for c in candidates
                                                            if len(c.runs) == 2)
    assert choose(candidates).instances == 7


@pytest.mark.parametrize("name", [pytest.param(p.stem, marks=pytest.mark.skipif(
    p.stem == "smollm2" and bool(smollm2.missing()), reason=f"needs {', '.join(smollm2.NEEDS)}: {smollm2.INSTALL}"))
    for p in sorted((REPO / "pipelines").glob("*.yaml"))])
def test_every_shipped_pipeline_tunes_to_at_least_its_shipped_setting(name):
    """Small scale (16 GPUs, 10 steps, Table 4): tune finishes, and its pick is as fast as the shipped setting (1% tie
    rule) within the shipped max staleness, and compiles."""
    path = REPO / "pipelines" / f"{name}.yaml"
    plan = compile_pipeline(path)
    candidates, _ = tune(plan, gpus=16, steps=10, profile=TABLE4, per_instance=2, progress=lambda *a: None)
    (shipped,) = [c for c in candidates if c.shipped]
    best = choose(candidates)
    assert len(shipped.runs) == len(best.runs) == 2
    assert best.result["tokens_per_s"] >= 0.99 * shipped.result["tokens_per_s"]
    assert best.result["max_staleness"] <= shipped.result["max_staleness"]
    compile_pipeline(path, overrides(plan, best))


def test_batch_sizes_are_searched_only_when_asked_and_the_choice_sets_the_buffer(capsys):
    """--batch-sizes adds batch sizes to the grid; a chosen one comes back as the buffer's batch_groups, and compiles."""
    plan = compile_pipeline(REPO / "pipelines" / "bounded_async.yaml")
    plain, _ = tune(plan, gpus=8, steps=6, profile=TABLE4, per_instance=2, progress=lambda *a: None)
    assert all(c.batch is None for c in plain)
    own = plan["control"]["staleness"]["batch_size"]
    candidates, _ = tune(plan, gpus=8, steps=6, profile=TABLE4, per_instance=2, batch_sizes=[2 * own],
                         progress=lambda *a: None)
    assert {c.batch for c in candidates} == {None, 2 * own} and len(candidates) == 2 * len(plain)
    (shipped,) = [c for c in candidates if c.shipped]
    assert shipped.batch is None
    doubled = next(c for c in candidates if c.batch == 2 * own)
    sets = overrides(plan, doubled)
    assert f"stages.buffer.batch_groups={2 * own}" in sets
    assert compile_pipeline(REPO / "pipelines" / "bounded_async.yaml", sets)["control"]["staleness"]["batch_size"] == 2 * own
    rc = main(["tune", str(REPO / "pipelines" / "bounded_async.yaml"), "--gpus", "8", "--steps", "6", "--profile",
               TABLE4, "--gpus-per-instance", "2", "--batch-sizes", "2,x"])
    err = capsys.readouterr().err
    assert rc == 2 and "--batch-sizes" in err and "Traceback" not in err


def test_two_rollout_stages_get_instances_each_and_keep_their_task_mix(capsys):
    """mixed.yaml: each rollout stage gets whole instances (the plan's proportions by default, then moved between
    stages); the recommendation sets every stage's replicas and compiles; no eligible point trains a task mix more
    than MIX_TOLERANCE away from the shipped one."""
    plan = compile_pipeline(REPO / "pipelines" / "mixed.yaml", ["stages.buffer.batch_groups=32",
                                                                "stages.gen_arith.max_running=256",
                                                                "stages.gen_repeat.max_running=256"])
    lines = []
    candidates, _ = tune(plan, gpus=32, steps=9, profile=TABLE4, per_instance=2, progress=lines.append)
    assert all(len(c.stages) == 2 and sum(c.stages) == c.instances and min(c.stages) >= 1 for c in candidates)
    (shipped,) = [c for c in candidates if c.shipped]
    assert shipped.stages == (4, 4) and set(shipped.result["shares"]) == {"gen_arith", "gen_repeat"}
    assert any(c.screen and c.stages != _divide(c.instances, [1, 1]) for c in candidates)  # moved between stages
    best = choose(candidates)
    for c in candidates:
        if c.result and len(c.runs) == 2:
            off = max(abs(c.result["shares"][n] - shipped.result["shares"][n]) for n in ("gen_arith", "gen_repeat"))
            assert c is not best or off <= MIX_TOLERANCE
    sets = overrides(plan, best)
    assert f"stages.gen_arith.replicas={best.stages[0]}" in sets and f"stages.gen_repeat.replicas={best.stages[1]}" in sets
    tuned = compile_pipeline(REPO / "pipelines" / "mixed.yaml", sets)
    assert [tuned["pipeline"]["stages"][n]["replicas"] for n in ("gen_arith", "gen_repeat")] == list(best.stages)
    assert main(["tune", str(REPO / "pipelines" / "mixed.yaml"), "--gpus", "8", "--steps", "6", "--profile", TABLE4,
                 "--gpus-per-instance", "2"]) == 0
    out = capsys.readouterr().out
    assert "trained mix" in out and "per rollout stage" in out and "--set stages.gen_repeat.replicas=" in out


def test_a_faster_point_that_trains_another_task_mix_is_not_recommended():
    """Two stages: the fastest confirmed point shifted the mix 10 points toward one stage; the shipped one wins."""
    def point(shipped: bool, tokens: float, arith: float) -> Candidate:
        r = {"tokens_per_s": tokens, "mean_staleness": 1.0, "max_staleness": 1, "rollout_idle": 0.0,
             "trainer_idle": 0.0, "peak_queued": 0, "shares": {"a": arith, "b": 1 - arith}}
        return Candidate(8, 8, 4, 1, shipped=shipped, stages=(2, 2), result=r, runs=[r, r])

    shipped, shifted, close = point(True, 100.0, 0.5), point(False, 130.0, 0.4), point(False, 110.0, 0.53)
    assert choose([shipped, shifted]) is shipped
    assert choose([shipped, shifted, close]) is close


def test_a_queue_run_that_never_filled_answers_exactly_for_the_capacities_it_never_reached():
    """streamrl.yaml (queue_drop): capacity acts only by dropping when the queue overflows, so tune takes the result of
    a run whose queue peaked below another capacity for that capacity instead of simulating it. Every result it
    holds, reused or not, equals the point simulated on its own."""
    plan = compile_pipeline(REPO / "pipelines" / "streamrl.yaml")
    lines = []
    candidates, _ = tune(plan, gpus=16, steps=9, profile=TABLE4, per_instance=2, progress=lines.append)
    assert any("ran identically" in line for line in lines)  # some points were reused...
    checked = overflowed = 0
    screen = 9 if any("screening at full length" in line for line in lines) else 5
    for c in candidates:
        for r, n, s in ([(c.screen, screen, 0)] if c.screen else []) + [(r, 9, i) for i, r in enumerate(c.runs)]:
            assert simulate_point(plan, "capacity", c.knob, c.instances, TABLE4, c.train_tokens_per_s, n, s) == r, c
            checked += 1
            overflowed += r["peak_queued"] > c.knob
    assert checked > 20 and overflowed  # ...and some queues did overflow a capacity, so those ran on their own
