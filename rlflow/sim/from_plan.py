"""A compiled plan -> SimConfig: the simulator executes the same plan and the same policies as `rlflow run`.

What the plan does not say (engine speed, trainer speed at scale) comes from flags, the plan's
`workload` block, or a stated assumption; every assumption is returned as a note and printed.
"""

from __future__ import annotations

from dataclasses import replace

from rlflow.operators.cost_profile import CostProfile
from rlflow.plan_read import PlanCoordination, rollout_stages, stage_coordination
from rlflow.plan_read import load_profile as read_profile
from rlflow.sim.config import LengthSpec, SimConfig, TrainerModel
from rlflow.sim.lengths import expected_length

DEFAULT_PROFILE = "staleflow-table4-qwen3-30b-a3b"


ONE_STAGE_RULE = "sim-one-rollout-stage"
ONE_STAGE_FIX = ("simulate or tune a pipeline with one rollout stage per task (e.g. quickstart.yaml for arith, "
                 "learn_repeat.yaml for repeat); the simulator does not model several rollout fleets yet")


def not_simulable(plan: dict) -> str | None:
    """Why the simulator cannot run this plan as declared (None: it can). It models one rollout fleet: with several
    rollout stages, simulating the first alone would leave the others' instances and lengths out, a silent
    substitution, so `rlflow simulate` and `rlflow tune` refuse it (rule ONE_STAGE_RULE)."""
    stages = rollout_stages(plan)
    if len(stages) > 1:
        return (f"the simulator models one rollout stage; this plan has {len(stages)} ({', '.join(stages)}), and "
                "simulating the first alone would leave the others' instances and lengths out")
    return None


def plan_rollout(plan: dict) -> tuple[str, dict]:
    """The plan's rollout stage: the one the simulator runs."""
    why = not_simulable(plan)
    if why:
        raise ValueError(f"{why} [{ONE_STAGE_RULE}]")
    name = rollout_stages(plan)[0]
    return name, plan["pipeline"]["stages"][name]


def plan_coordination(plan: dict) -> PlanCoordination:
    """The coordination of the plan's rollout stage (the one the simulator runs)."""
    return stage_coordination(plan, plan_rollout(plan)[0])


def load_profile(profile: str | None, notes: list[str], hint: str = "pass --profile to change") -> CostProfile:
    """The named cost-model profile, or DEFAULT_PROFILE with a note saying so (the simulator states its assumptions)."""
    if not profile:
        profile = DEFAULT_PROFILE
        notes.append(f"no cost-model profile in the plan: using {DEFAULT_PROFILE} ({hint})")
    return read_profile(profile)


def episodes(rollout: dict, w: dict, notes: list[str]) -> dict:
    """turns / env_latency_s / env_latency: the workload block's, else read off the rollout stage's environment."""
    env, kwargs = rollout.get("env"), rollout.get("env_kwargs") or {}
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
                        else "env_latency_s = 0 (env_kwargs has no latency_s; the step's own run time is not known)")
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


def sim_config(plan: dict, *, steps: int, mode: str | None = None, instances: int | None = None,
               profile: str | None = None, train_tokens_per_s: float | None = None, prompt_tokens: int = 0,
               seed: int | None = None, scale: tuple = ()) -> tuple[SimConfig, list[str]]:
    """The simulation of `plan`, and notes on what was assumed. scale: ((after_step, instances), ...), what
    `rlflow scale` would ask of an elastic stage during the run."""
    notes: list[str] = []
    _, rollout = plan_rollout(plan)
    w = plan["pipeline"]["workload"]
    control = plan["control"]["staleness"]
    pc = plan_coordination(plan)
    sync, dispatch = pc.sync, pc.dispatch
    coordination = dict(routing=pc.routing, migration=pc.migration, coordinator_interval_s=pc.interval_s,
                        mu=pc.mu, phi_wait=pc.phi_wait, phi_throughput=pc.phi_throughput)
    ranker = dispatch.get("ranker", "learned")
    if pc.skew_aware:
        coordination.update(dispatch="skew_aware", long_tail_fraction=dispatch.get("long_tail_fraction", 0.2),
                            ranker="oracle" if ranker == "oracle" else "noisy")
    cap = w["length_cap"] or rollout["max_new_tokens"]
    lengths = LengthSpec(kind="lognormal" if w["tailness"] > 0 else "fixed", mean=w["mean_length"],
                         tailness=w["tailness"], cap=cap)
    profile = profile or pc.profile
    if mode is None:
        mode = "slots" if (w["rollout_tokens_per_s"] and not profile) else "cost_model"
    instances = instances or rollout["replicas"]
    common = dict(lengths=lengths, group_size=rollout["group_size"], batch_groups=control["batch_size"],
                  policy=control["kind"], eta=control["eta"], capacity=control["capacity"],
                  batch_redundancy=control["batch_redundancy"], steps=steps, warmup_steps=min(10, steps // 5),
                  seed=plan["pipeline"]["seed"] if seed is None else seed, prompt_tokens=prompt_tokens,
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
        prof = load_profile(profile, notes)
        if rollout["max_running"] < prof.max_running:  # the stage's cap binds, as in the runtime's coordinator
            prof = replace(prof, max_running=rollout["max_running"])
        if pc.skew_aware and ranker != "oracle":  # slots mode drops dispatch (noted above)
            notes.append(f"ranker {ranker!r}: the simulator has no prompt text; simulated as a noisy oracle (lognormal error, sigma 0.5)")
        config_kw = dict(mode="cost_model", instances=instances, profile=prof, weight_sync=sync,
                         partial_rollout=pc.partial_rollout, scale=tuple(scale), **coordination, **_elastic(rollout))
        n = min(prof.max_running, rollout["max_running"], control["batch_size"] * rollout["group_size"])
        held = n * (prompt_tokens + expected_length(lengths) / 2)
        v_r = instances * n / prof.step_latency(prof.k5 * held, n)  # decode tokens/s of a full fleet
    v_t = train_tokens_per_s or w["train_tokens_per_s"]
    if v_t is None:
        v_t = v_r
        notes.append(f"trainer speed assumed equal to rollout speed (rho = 1, {v_t:,.0f} tokens/s); "
                     "set workload.train_tokens_per_s or --train-tokens-per-s")
    trainer = TrainerModel(s_per_token=1.0 / v_t)
    return SimConfig(**config_kw, trainer=trainer, **common), notes
