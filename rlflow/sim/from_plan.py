"""A compiled plan -> SimConfig: the simulator executes the same plan and the same policies as `rlflow run`.

What the plan does not say (engine speed, trainer speed at scale) comes from flags, the plan's
`workload` block, or a stated assumption; every assumption is returned as a note and printed.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from rlflow.operators.cost_profile import CostProfile
from rlflow.operators.staleness_buffer import auto_redundancy
from rlflow.plan_model import Plan
from rlflow.plan_read import PlanCoordination, named_profile, stage_coordination, stage_length_law
from rlflow.sim.config import LengthSpec, SimConfig, StageSim, TrainerModel
from rlflow.sim.control_costs import ControlCosts
from rlflow.sim.lengths import expected_length
from rlflow.sim.measured_profile import MeasuredProfile

DEFAULT_PROFILE = "staleflow-table4-qwen3-30b-a3b"


ONE_STAGE_RULE = "sim-one-rollout-stage"
ONE_STAGE_FIX = ("give every rollout stage least_loaded routing, no migration, no skew-aware dispatch, no elastic block "
                 "and single-turn episodes, with one weight_sync mode and one cost-model profile for all; or simulate "
                 "each stage in a pipeline of its own (e.g. quickstart.yaml for arith, learn_repeat.yaml for repeat)")


def not_simulable(plan: dict | Plan) -> str | None:
    """Why the simulator cannot run this plan as declared (None: it can), for rule ONE_STAGE_RULE. One rollout stage
    simulates with any coordination. Several get a fleet each under one policy, trainer and weights version, which
    the simulator models only uncoordinated and single-turn, with one sync and one profile; anything else would be
    simulated otherwise than declared, so `rlflow simulate` refuses it."""
    plan = Plan.of(plan)
    names = plan.rollout_stages()
    if len(names) < 2:
        return None
    why = []
    workload = plan.pipeline["workload"]
    if (workload.get("turns") or 1) > 1:
        why.append(f"workload.turns is {workload['turns']} (multi-turn episodes)")
    syncs, profiles = {}, {}
    for name in names:
        stage, pc = plan.pipeline["stages"][name], stage_coordination(plan, name)
        if not pc.vanilla or pc.skew_aware:
            why.append(f"{name} is coordinated (routing {pc.routing}, migration {pc.migration}, sync {pc.sync}, "
                       f"dispatch {pc.dispatch['kind']})")
        if stage.get("elastic"):
            why.append(f"{name} is elastic")
        if (stage.get("env") or stage.get("tools")) and stage.get("max_turns", 1) > 1:
            why.append(f"{name} runs multi-turn episodes (env {stage.get('env') or 'tools'!r}, max_turns {stage['max_turns']})")
        syncs[name] = f"{pc.sync}{'' if pc.partial_rollout else ' without partial rollout'}"
        if pc.profile:
            profiles[name] = pc.profile
    if len(set(syncs.values())) > 1:
        why.append("their weight syncs differ (" + ", ".join(f"{n}: {s}" for n, s in syncs.items()) + ")")
    if len(set(profiles.values())) > 1:
        why.append("they name different cost-model profiles (" + ", ".join(f"{n}: {p}" for n, p in profiles.items()) + ")")
    if why:
        return (f"this plan has {len(names)} rollout stages ({', '.join(names)}), which the simulator runs only "
                f"uncoordinated, single-turn, with one weight sync and one profile; here " + "; ".join(why))
    return None


def plan_rollouts(plan: dict | Plan) -> list[tuple[str, dict]]:
    """Every rollout stage of the plan and its settings, in the order `rlflow run` serves their fleets."""
    plan = Plan.of(plan)
    return [(name, plan.pipeline["stages"][name]) for name in plan.rollout_stages()]


def plan_rollout(plan: dict) -> tuple[str, dict]:
    """A single-stage plan's rollout stage (ValueError for several: use plan_rollouts)."""
    rollouts = plan_rollouts(plan)
    if len(rollouts) > 1:
        raise ValueError(f"this plan has {len(rollouts)} rollout stages ({', '.join(n for n, _ in rollouts)}), where one "
                         f"is expected (plan_rollouts gives them all) [{ONE_STAGE_RULE}]")
    return rollouts[0]


def plan_profiles(plan: dict) -> list[str]:
    """The cost-model profiles the plan's rollout stages name, in their order (stages that name none left out);
    not_simulable admits several stages only when they name the same one."""
    return [p for p in (stage_coordination(plan, n).profile for n, _ in plan_rollouts(plan)) if p]


def plan_coordination(plan: dict) -> PlanCoordination:
    """The coordination of a single-stage plan's rollout stage."""
    return stage_coordination(plan, plan_rollout(plan)[0])


def profile_or_default(profile: str | None, notes: list[str], hint: str = "pass --profile to change") -> CostProfile:
    """The named cost-model profile, or DEFAULT_PROFILE with a note saying so (the simulator states its assumptions;
    `rlflow run` has no default: plan_read.named_profile)."""
    if not profile:
        profile = DEFAULT_PROFILE
        notes.append(f"no cost-model profile in the plan: using {DEFAULT_PROFILE} ({hint})")
    return named_profile(profile)


def episodes(rollout: dict, w: dict, notes: list[str]) -> dict:
    """turns / env_latency_s / env_latency: the workload block's, else read off the rollout stage's environment."""
    env = rollout.get("env") or ("tools" if rollout.get("tools") else "agent" if rollout.get("agent") else None)
    kwargs = rollout.get("env_kwargs") or {}
    turns, latency_s, law = w.get("turns"), w.get("env_latency_s"), w.get("env_latency")
    read = []  # what came from the stage rather than the workload block
    if turns is None:
        turns = rollout.get("max_turns", 1) if env else 1
        if turns > 1:
            read.append(f"turns = max_turns = {turns} (every episode assumed to use all its turns)")
    elif turns > 1 and not env:
        notes.append(f"workload.turns = {turns}, but rollout stage has no env: simulating {turns}-turn episodes anyway")
    if latency_s is None:
        latency_s = float(kwargs.get("latency_s", 0.0)) if env else 0.0
        if turns > 1:
            read.append(f"env_latency_s = env_kwargs.latency_s = {latency_s:g}" if "latency_s" in kwargs
                        else "env_latency_s = 0 (the agent's own time between its requests is not known)"
                        if env == "agent" else
                        "env_latency_s = 0 (env_kwargs has no latency_s; the step's own run time is not known)")
    if law is None:
        law = kwargs.get("latency", "fixed") if env else "fixed"
        if turns > 1 and latency_s > 0 and "latency" in kwargs:
            read.append(f"env_latency = env_kwargs.latency = {law}")
    if read:
        notes.append(f"multi-turn episodes from env {env!r}: " + "; ".join(read)
                     + "; generated tokens split evenly over turns, observation tokens not modelled"
                     + " (set workload.turns / env_latency_s / env_latency to change)")
    return dict(turns=turns, env_latency_s=latency_s, env_latency=law)


def _elastic(rollout: dict) -> dict:
    """An elastic stage's automatic rule (streamrl §4.3) within its bounds; `rlflow scale` requests are `scale`."""
    e = rollout.get("elastic")
    if not e or not e["auto"]:
        return {}
    return {"elastic_min": e["min_replicas"], "elastic_max": e["max_replicas"], "elastic_window": e["window_steps"]}


def share_notes(plan: dict | Plan) -> list[str]:
    """The prompt-share assumption, for each skew-aware stage with varying lengths: what a prompt ranker can find
    depends on it (benchmarks/prompt_share.py)."""
    plan = Plan.of(plan)
    w = plan.pipeline["workload"]
    out = []
    for name, rollout in plan_rollouts(plan):
        lengths = stage_lengths(w, name, rollout)
        if stage_coordination(plan, name).skew_aware and lengths.kind == "lognormal":
            out.append(f"{name}: a prompt's samples share {lengths.prompt_share:g} of the log-length variance "
                       "(workload.prompt_share; 0: independent lengths, 1: equal within a prompt): an assumption; a run "
                       "measures it as length_prompt_share")
    return out


def stage_lengths(w: dict, name: str, rollout: dict) -> LengthSpec:
    """A rollout stage's response lengths: workload.stages.<name>'s, else the workload block's; the cap else the
    stage's max_new_tokens."""
    mean, tailness, cap, share = stage_length_law(w, name, rollout["max_new_tokens"])
    return LengthSpec(kind="lognormal" if tailness > 0 else "fixed", mean=mean, tailness=tailness, cap=cap,
                      prompt_share=share if tailness > 0 else 0.0)


def instance_counts(rollouts: list[tuple[str, dict]], instances: int | dict[str, int] | None) -> list[int]:
    """Instances per rollout stage: `instances` (an int for a single-stage plan, or stage name -> count), else the
    stage's replicas."""
    names = [name for name, _ in rollouts]
    if isinstance(instances, dict):
        unknown = sorted(set(instances) - set(names))
        if unknown:
            raise ValueError(f"instances: no rollout stage {', '.join(map(repr, unknown))}; the plan's rollout stages "
                             f"are {', '.join(names)}")
        return [instances.get(name) or rollout["replicas"] for name, rollout in rollouts]
    if instances and len(rollouts) > 1:
        raise ValueError(f"instances: one count for {len(names)} rollout stages ({', '.join(names)}); pass a dict "
                         "(stage name -> instances) or use --set stages.<name>.replicas=N")
    return [instances] if instances else [rollout["replicas"] for _, rollout in rollouts]


def decode_rate(prof: CostProfile, rollout: dict, batch_groups: int, lengths: LengthSpec, instances: int,
                 prompt_tokens: int) -> float:
    """Decode tokens/s of a stage's full fleet: each instance running as many samples as it may."""
    n = min(prof.max_running, rollout["max_running"], batch_groups * rollout["group_size"])
    held = n * (prompt_tokens + expected_length(lengths) / 2)
    return instances * n / prof.step_latency(prof.k5 * held, n)


def sim_config(plan: dict | Plan, *, steps: int, mode: str | None = None, instances: int | dict[str, int] | None = None,
               profile: str | None = None, train_tokens_per_s: float | None = None, prompt_tokens: int = 0,
               seed: int | None = None, scale: tuple = (), control_costs: str | None = None,
               trainer_ranks: int | None = None) -> tuple[SimConfig, list[str]]:
    """The simulation of `plan`, and notes on what was assumed. instances: an int (single-stage plans), or rollout
    stage name -> instances; default each stage's replicas. trainer_ranks: the trainer's ranks (default the plan's;
    `rlflow tune` trains one per GPU of a split), for a trainer a measured profile gives. scale: ((after_step, instances), ...), what `rlflow
    scale` would ask of an elastic stage during the run. Several rollout stages: one fleet each (cost_model mode).
    control_costs: a control-costs file (path, or name in configs/control_costs/), None for the shipped one, 'none'
    for instant hand-offs between actors."""
    notes: list[str] = []
    plan = Plan.of(plan)
    why = not_simulable(plan)
    if why:
        raise ValueError(f"{why} [{ONE_STAGE_RULE}]")
    rollouts = plan_rollouts(plan)
    counts = instance_counts(rollouts, instances)
    name, rollout = rollouts[0]
    w = plan.pipeline["workload"]
    control = plan.staleness
    pc = stage_coordination(plan, name)
    sync, dispatch = pc.sync, pc.dispatch
    coordination = dict(routing=pc.routing, migration=pc.migration, coordinator_interval_s=pc.interval_s,
                        mu=pc.mu, phi_wait=pc.phi_wait, phi_throughput=pc.phi_throughput)
    ranker = dispatch.get("ranker", "learned")
    if pc.skew_aware:
        coordination.update(dispatch="skew_aware", long_tail_fraction=dispatch.get("long_tail_fraction", 0.2),
                            ranker="oracle" if ranker == "oracle" else "noisy")
    named = plan_profiles(plan)
    if not profile and named:
        profile = named[0]
        if len(named) < len(rollouts):
            notes.append(f"the cost-model profile {profile}, named by {len(named)} of {len(rollouts)} rollout stages, "
                         "is used for all of them")
    measured = MeasuredProfile.load(profile) if profile else None
    if measured is not None:
        w = measured_lengths(plan, measured, w, notes)
    lengths = stage_lengths(w, name, rollout)
    drop_rate, redundancy = group_filter(plan, measured, control, notes)
    if mode is None:
        mode = "slots" if (w["rollout_tokens_per_s"] and not profile and len(rollouts) == 1) else "cost_model"
    if mode == "slots" and len(rollouts) > 1:
        raise ValueError(f"slots mode models one pool of slots; a plan with {len(rollouts)} rollout stages simulates in "
                         "cost_model mode (leave --mode out)")
    instances = counts[0]
    common = dict(lengths=lengths, group_size=rollout["group_size"], batch_groups=control.batch_size,
                  policy=control.kind, eta=control.eta, capacity=control.capacity,
                  # auto adapts to the group filter's drops at run time; the simulator applies the same rule to the
                  # drop rate a measured profile gives (group_filter), else to none
                  batch_redundancy=redundancy, filter_drop_rate=drop_rate, steps=steps, warmup_steps=min(10, steps // 5),
                  seed=plan.pipeline["seed"] if seed is None else seed, prompt_tokens=prompt_tokens, stage_name=name,
                  **episodes(rollout, w, notes))
    if mode == "slots":
        if not w["rollout_tokens_per_s"]:
            raise ValueError("slots mode needs workload.rollout_tokens_per_s (set it in the pipeline or with --set)")
        slots = w["concurrency"] or instances * rollout["max_running"]
        speed = w["rollout_tokens_per_s"] / slots
        if coordination["routing"] != "least_loaded" or coordination["migration"] != "none" or dispatch["kind"] != "round_robin":
            notes.append("slots mode has no instances to coordinate; routing / migration / dispatch are not modelled")
        if sync != "global":
            notes.append(f"slots mode syncs weights in flight (the closed form's assumption); {sync} sync is not modelled")
        config_kw = dict(mode="slots", instances=min(instances, slots), slots=slots, speed=speed, weight_sync="global",
                         partial_rollout=True)
        v_r = w["rollout_tokens_per_s"]
    else:
        prof = base = profile_or_default(profile, notes)
        if rollout["max_running"] < prof.max_running:  # the stage's cap binds, as in the runtime's coordinator
            prof = replace(prof, max_running=rollout["max_running"])
        if pc.skew_aware and ranker != "oracle":  # slots mode drops dispatch (noted above)
            notes.append(f"ranker {ranker!r}: the simulator has no prompt text; simulated as a noisy oracle (lognormal error, sigma 0.5)")
        notes += share_notes(plan)
        config_kw = dict(mode="cost_model", instances=instances, profile=prof, weight_sync=sync,
                         partial_rollout=pc.partial_rollout, scale=tuple(scale), **coordination, **_elastic(rollout))
        v_r = decode_rate(prof, rollout, control.batch_size, lengths, instances, prompt_tokens)
        stages = []
        for (other, stage), n in zip(rollouts[1:], counts[1:]):
            stage_prof = replace(base, max_running=min(base.max_running, stage["max_running"]))
            stages.append(StageSim(other, n, stage_lengths(w, other, stage), stage["group_size"], stage_prof.max_running))
            v_r += decode_rate(stage_prof, stage, control.batch_size, stages[-1].lengths, n, prompt_tokens)
        config_kw["stages"] = tuple(stages)
    # the trainer: a speed stated on the command line; else the profile's calibration run, which measured it and the
    # control costs beside it on this machine (over the workload block's train_tokens_per_s, a guess written with
    # the pipeline: streamrl's still beat the measured profile in tune_validation, issue 47); else the workload block
    if measured is not None and not train_tokens_per_s and w["train_tokens_per_s"]:
        notes.append(f"workload.train_tokens_per_s ({w['train_tokens_per_s']:g}) is not used: the profile measured the "
                     "trainer (--train-tokens-per-s states a speed instead)")
    v_t = train_tokens_per_s or (None if measured is not None else w["train_tokens_per_s"])
    from_run = v_t is None and measured is not None
    if from_run:
        trainer = measured_trainer(plan, measured, trainer_ranks)
        layout_notes(plan, measured, notes, trainer.ranks)
        notes.append(f"trainer from the profile's calibration run ({measured.pipeline}): {measured.base_s:.3f} s + "
                     f"{measured.s_per_micro_batch * 1000:.1f} ms per micro-batch + {measured.s_per_token * 1000:.3f} ms "
                     f"per trained token a step, at {trainer.ranks} rank(s) of micro-batches of {trainer.micro_rows} rows")
    else:
        if v_t is None:
            v_t = v_r
            notes.append(f"trainer speed assumed equal to rollout speed (rho = 1, {v_t:,.0f} tokens/s"
                         + (f", summed over {len(rollouts)} rollout stages" if len(rollouts) > 1 else "")
                         + "); set workload.train_tokens_per_s or --train-tokens-per-s")
        split = micro_batching(plan)
        trainer = TrainerModel(s_per_token=1.0 / v_t, epochs=split["epochs"], mini_batches=split["mini_batches"])
    control_fields = (measured_control(measured, notes) if from_run and not control_costs
                      else control_cost_fields(control_costs, notes))
    return SimConfig(**config_kw, trainer=trainer, **common, **control_fields), notes


def micro_batching(plan: Plan) -> dict:
    """How the plan's trainer splits a batch (TrainerModel's ranks / micro_rows / micro_tokens), as rlflow run's
    stages/batch_shards.py does: DeepSpeed's train_micro_batch_size_per_gpu rows (the train stage's micro_batch_size
    over the config's), and with packing at most micro_batch_tokens tokens where the stage declares it."""
    t = plan.trainer
    kw = t.trainer_kwargs
    rows = kw.get("micro_batch_size")
    if rows is None and t.deepspeed:
        try:
            rows = json.loads(Path(t.deepspeed).read_text()).get("train_micro_batch_size_per_gpu")
        except (OSError, ValueError):
            rows = None
    # with packing and no micro_batch_tokens, rlflow run bounds a packed row by the model's shape (stages/packing.py
    # row_token_bound); not modelled: micro-batches are counted by rows (the bound did not bind in the quickstart's
    # calibration runs: 16 micro-batches of 8 rows a step)
    tokens = kw.get("micro_batch_tokens") if kw.get("packing") else None
    return {"ranks": t.replicas, "micro_rows": int(rows or 8), "micro_tokens": tokens,
            "epochs": kw.get("epochs", 1), "mini_batches": kw.get("mini_batches", 1)}


def measured_trainer(plan: Plan, measured: MeasuredProfile, ranks: int | None = None) -> TrainerModel:
    """The trainer the profile's calibration run measured, splitting the plan's batches as the plan does, at `ranks`
    ranks (default the plan's)."""
    split = micro_batching(plan)
    if ranks is not None:
        split["ranks"] = ranks
    return TrainerModel(base_s=measured.base_s, s_per_token=measured.s_per_token,
                        s_per_micro_batch=measured.s_per_micro_batch, **split)


def layout_notes(plan: Plan, measured: MeasuredProfile, notes: list[str], ranks: int | None = None) -> None:
    """A profile is measured at one layout: a plan with more trainer ranks or rollout instances on the same machine
    shares its cores differently, which the profile did not measure (tune_validation: 2 ranks or 2 instances on 2
    cores ran 30-40% slower than the 1-rank, 1-instance profile predicts)."""
    ranks, instances = ranks or plan.trainer.replicas, len(plan.rollouts())
    if measured.trainer_ranks is not None and ranks != measured.trainer_ranks:
        notes.append(f"the trainer was measured at {measured.trainer_ranks} rank(s); this plan trains on {ranks}: its "
                     "cost per micro-batch at this layout is not measured (profile this layout)")
    if measured.rollout_instances is not None and instances != measured.rollout_instances:
        notes.append(f"the engine was measured as {measured.rollout_instances} instance(s); this plan runs {instances}: "
                     "their decode cost sharing this machine is not measured (profile this layout)")


def control_cost_fields(control_costs: str | None, notes: list[str]) -> dict:
    """reward_latency_s / step_control_s from a control-costs file (sim/control_costs.py), with a note saying which."""
    if control_costs == "none":
        notes.append("control costs: none (hand-offs between actors take no time)")
        return {}
    costs = ControlCosts.load(control_costs)
    notes.append(f"control costs from {costs.path.name} ({costs.source}): {costs.reward_latency_s * 1000:.0f} ms from a "
                 f"group's last sample to the buffer, {costs.step_control_s * 1000:.0f} ms per train step outside "
                 "trainer compute; measured on a small CPU run, --control-costs none (control_costs='none') leaves them out")
    return {"reward_latency_s": costs.reward_latency_s, "step_control_s": costs.step_control_s}


def measured_control(measured: MeasuredProfile, notes: list[str]) -> dict:
    """The control costs the profile's calibration run measured (instead of configs/control_costs/'s)."""
    notes.append(f"control costs from the profile's calibration run: {measured.reward_latency_s * 1000:.0f} ms from a "
                 f"group's last sample to scored, {measured.step_control_s * 1000:.0f} ms per train step outside trainer "
                 f"compute, {measured.route_s * 1000:.0f} ms before routed work reaches an idle engine")
    return {"reward_latency_s": measured.reward_latency_s, "step_control_s": measured.step_control_s,
            "route_s": measured.route_s}


def measured_lengths(plan: Plan, measured: MeasuredProfile, w: dict, notes: list[str]) -> dict:
    """The workload block with the lengths the profile's run trained on, where it drew from the same data source at
    the same max_new_tokens (a measurement beats the block's statement); else the block as it is, with a note."""
    rollouts = plan_rollouts(plan)
    source = plan.pipeline["data"]["source"]
    if len(rollouts) > 1 or not measured.same_workload(source, rollouts[0][1]["max_new_tokens"]):
        notes.append(f"response lengths from the workload block (mean {w['mean_length']:g}, tailness {w['tailness']:g}): "
                     f"the profile measured {measured.data_source} at max_new_tokens {measured.max_new_tokens}, not "
                     f"this plan's {source} at {rollouts[0][1]['max_new_tokens']}")
        return w
    m = measured.workload
    notes.append(f"response lengths measured in the profile's calibration run: mean {m['mean_length']:g}, tailness "
                 f"{m['tailness']:g}, prompt_share {m['prompt_share']:g}")
    return {**w, **m, "stages": None}


def group_filter(plan: Plan, measured: MeasuredProfile | None, control, notes: list[str]) -> tuple[float, int]:
    """(filter drop rate, batch_redundancy): the profile's measured drop rate where the plan filters groups, and auto
    redundancy as the runtime's buffer sets it for that rate (runtime/buffer.py _scored)."""
    filters = [e["policy"]["filter"] for e in plan.pipeline["edges"] if (e.get("policy") or {}).get("filter")]
    auto = control.batch_redundancy == "auto"
    if not filters:
        return 0.0, 0 if auto else control.batch_redundancy
    if measured is None:
        notes.append(f"group filter {filters[0]}: not modelled (no profile measured in a run says how many groups it "
                     "drops; rlflow profile PIPELINE measures it): every generated group is trained")
        return 0.0, 0 if auto else control.batch_redundancy
    p = min(measured.filter_drop_rate, 0.95)
    extra = auto_redundancy(control.batch_size, p) if auto else control.batch_redundancy
    notes.append(f"group filter {filters[0]}: drops {p:.0%} of scored groups (measured in the profile's run)"
                 + (f"; batch_redundancy auto admits {extra} extra" if auto else ""))
    return p, extra
