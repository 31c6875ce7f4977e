"""Validated pipeline -> physical plan: versioned JSON with every default resolved (docs/internals/architecture.md).

The plan names each task type and its route, the Ray actors with their resources and constructor
arguments, the Ray Data operators, the control-plane policies with their parameters, and the
closed-form staleness prediction when it applies. Executors (`rlflow run`, `rlflow simulate`) read
only the plan.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import networkx as nx

from rlflow import reward_scorers
from rlflow.devices import sleep_plan, thread_plan, vllm_settings
from rlflow.graph import BACK_EDGE, batch_groups, build_graph, data_graph, resolve_path, stages_of
from rlflow.plan_read import stage_length_law
from rlflow.schema import ALGO_BLOCKS, CONSUME_POLICIES, DATA_NODE, MAIN_TASK, AgentSpec, Pipeline, TaskSource
from rlflow.staleness_model import predict_mean_staleness, tail_multiplier
from rlflow.task_routes import task_routes
from rlflow.tool_checks import tiny_template
from rlflow.version import __version__

PLAN_VERSION = 2


def staleness_control(spec: Pipeline) -> dict:
    """The edge policy into train, as operators.policy_kinds.make_policy arguments (batch in groups)."""
    batch = batch_groups(spec)
    policy = next(e.policy for e in spec.edges if e.policy.kind in CONSUME_POLICIES)
    args = {"batch_size": batch, "eta": None, "capacity": None, "batch_redundancy": 0}
    if policy.kind == "barrier":
        return {"kind": "synchronous", **args, "eta": 0, "batch_redundancy": policy.batch_redundancy}
    if policy.kind == "one_step":
        return {"kind": "one_step", **args, "eta": 1}
    if policy.kind == "unbounded":
        return {"kind": "unbounded", **args}
    if policy.kind == "in_flight_limit":
        return {"kind": "in_flight_limit", **args, "eta": policy.eta}
    # staleness_bound
    if policy.queue == "none":
        return {"kind": "staleflow", **args, "eta": policy.eta, "batch_redundancy": policy.batch_redundancy}
    kind = {"drop": "queue_drop", "max": "queue_max"}[policy.queue]
    return {"kind": kind, **args, "eta": policy.eta, "capacity": policy.capacity or batch}


def predict(spec: Pipeline, control: dict) -> dict:
    """Closed-form mean staleness (docs/concepts/staleness.md) when the pipeline gives its inputs."""
    w = spec.workload
    if control["kind"] != "queue_drop":
        return {"available": False, "reason": f"the closed form models queue-drop; this plan uses {control['kind']}"}
    if w.rollout_tokens_per_s is None or w.train_tokens_per_s is None:
        return {"available": False, "reason": "set workload.rollout_tokens_per_s and workload.train_tokens_per_s"}
    rollouts = [spec.stages[n] for n in stages_of(spec, "rollout")]
    group = rollouts[0].group_size
    concurrency = w.concurrency or sum(r.replicas * r.max_running for r in rollouts)
    mean, tailness, cap, share = w.mean_length, w.tailness, w.length_cap or max(r.max_new_tokens for r in rollouts), w.prompt_share
    if w.stages:  # per-stage lengths: the closed form has one length law, so the stages must agree on it
        declared = w.model_dump()
        laws = {stage_length_law(declared, name, spec.stages[name].max_new_tokens) for name in stages_of(spec, "rollout")}
        if len(laws) > 1:
            return {"available": False, "reason": "the rollout stages' lengths differ (workload.stages) and the closed form "
                                                  "models one length distribution; `rlflow simulate` runs each stage's"}
        mean, tailness, cap, share = laws.pop()
    tail = tail_multiplier(tailness, group, cap=cap / mean if cap else None, prompt_share=share)
    rho = w.rollout_tokens_per_s / w.train_tokens_per_s
    q = control["capacity"] / control["batch_size"]
    p = predict_mean_staleness(rho=rho, concurrency=concurrency, batch=control["batch_size"] * group, tail=tail, queue_factor=q)
    return {"available": True, **p.as_dict(), "tail_multiplier": tail, "concurrency": concurrency,
            "batch_samples": control["batch_size"] * group, "queue_factor": q}


def _tasks(spec: Pipeline, base_dir: Path) -> dict[str, dict]:
    """Each task type: where its prompts come from and the rollout, reward and filter they flow through."""
    d = spec.data
    sources = d.tasks or {MAIN_TASK: TaskSource(source=d.source, limit=d.limit, prompt_field=d.prompt_field,
                                                  answer_field=d.answer_field, prompt_format=d.prompt_format,
                                                  system_prompt=d.system_prompt, split=d.split)}
    routes = task_routes(spec)
    out = {}
    for name, t in sources.items():
        src = t.source if t.source.startswith("builtin:") else str(resolve_path(t.source, base_dir) or t.source)
        out[name] = {"source": src, "weight": t.weight, "limit": t.limit, "prompt_field": t.prompt_field,
                     "answer_field": t.answer_field, "prompt_format": t.prompt_format, "system_prompt": t.system_prompt,
                     **({"split": t.split} if t.split else {}),  # a DatasetDict directory's (rlflow/data_sources.py)
                     **routes[name],
                     # share of rows held out for evaluation (runtime/evaluation.py), never trained on
                     "holdout": d.eval if isinstance(d.eval, float) else None}
    return out


def _tasks_of(tasks: dict[str, dict], role: str, stage: str) -> list[str]:
    return [t for t, route in tasks.items() if route[role] == stage]


def _episode(spec: Pipeline, name: str, tasks: dict[str, dict]) -> dict:
    """A multi-turn rollout stage's episode settings (rlflow/runtime/episodes.py; with tools, chat_episodes.py);
    nothing for single-turn ones."""
    stage = spec.stages[name]
    if stage.agent is not None:  # agents: the conversation is theirs, through the endpoint (runtime/agent_gateway.py)
        agent = AgentSpec.entry(stage.agent)
        return {"episode": {"env": None, "agent": agent, "tool_parser": stage.tool_parser, "max_turns": stage.max_turns,
                            "timeout_s": agent["timeout_s"], "chat_template": tiny_template(spec),
                            "model_name": spec.model.path}}
    if stage.tools:  # chat form: the system prompt of each task it serves that has one goes into its conversation
        system = {t: route["system_prompt"] for t, route in tasks.items()
                  if route["rollout"] == name and route.get("system_prompt") is not None}
        return {"episode": {"env": None, "tools": list(stage.tools), "tool_parser": stage.tool_parser,
                            "max_turns": stage.max_turns, "chat_template": tiny_template(spec), "system_prompts": system}}
    if stage.env is None:
        return {}
    return {"episode": {"env": stage.env, "env_kwargs": dict(stage.env_kwargs), "max_turns": stage.max_turns}}


def _elastic(stage) -> dict:
    """An elastic rollout stage's bounds and pace (rlflow/runtime/scaling.py); nothing for a fixed one."""
    return {"elastic": stage.elastic.model_dump(mode="json")} if stage.elastic else {}


def _elastic_extra(actors: list[dict], key: str) -> float:
    """CPUs or GPUs the instances an elastic stage may add need beyond its first `replicas`."""
    firsts = [a for a in actors if a["role"] == "rollout" and a["index"] == 0 and "elastic" in a]
    return sum(a[key] * (a["elastic"]["max_replicas"] - sum(b["stage"] == a["stage"] for b in actors)) for a in firsts)


def _sleep(spec: Pipeline, stage: str) -> dict:
    """Whether the stage's engine sleeps during each train step, and why (rlflow/devices.py sleep_plan)."""
    level, why = sleep_plan(spec, stage)
    return {"sleep_level": level, "sleep_reason": why}


def _threads(spec: Pipeline, stage: str) -> dict:
    """The CPU threads of each of the stage's actors, and why (rlflow/devices.py thread_plan)."""
    threads, share, why = thread_plan(spec, stage)
    return {"threads": threads, "threads_share": share, "threads_reason": why}


def _actors(spec: Pipeline, tasks: dict[str, dict], base_dir: Path) -> list[dict]:
    actors = []
    rollouts = stages_of(spec, "rollout")
    for name in rollouts:
        s = spec.stages[name]
        engine_kwargs = {"max_running": s.max_running, "max_new_tokens": s.max_new_tokens, "temperature": s.temperature,
                         "top_p": s.top_p, "seed": spec.seed, "dtype": spec.model.dtype, "max_model_len": spec.model.max_model_len}
        if s.stop:  # only when set: plans of pipelines without stop strings stay as they were
            engine_kwargs["stop"] = list(s.stop)
        if s.max_turn_tokens is not None:
            engine_kwargs["max_turn_tokens"] = s.max_turn_tokens
        engine_kwargs |= vllm_settings(spec, name)  # from the stage's GPUs (rlflow/devices.py); nothing for hf
        engine_kwargs |= lora_kwargs(spec)  # train.lora: the engine injects the adapters it is sent
        for r in range(s.replicas):
            actors.append({"name": f"{name}-{r}", "role": "rollout", "stage": name, "index": r, "engine": s.engine,
                           "num_cpus": s.num_cpus, "num_gpus": s.num_gpus, "tasks": _tasks_of(tasks, "rollout", name),
                           "engine_kwargs": dict(engine_kwargs), "group_size": s.group_size, "group_redundancy": s.group_redundancy,
                           "resources": dict(s.resources), **_episode(spec, name, tasks), **_elastic(s), **_sleep(spec, name),
                           **_threads(spec, name)})
    for name in stages_of(spec, "train"):
        s = spec.stages[name]
        ds = resolve_path(s.deepspeed, base_dir)
        trainer_kwargs = {"lr": s.lr, "lr_schedule": {"kind": s.lr_schedule, "warmup_steps": s.lr_warmup_steps,
                                                          "min_ratio": s.lr_min_ratio, "total_steps": s.steps},
                          "clip_low": s.clip_low, "clip_high": s.clip_high, "loss_agg": s.loss_agg, "kl_coef": s.kl_coef,
                          "max_importance_ratio": s.max_importance_ratio, "off_policy": s.off_policy, "tis_cap": s.tis_cap,
                          "mask_low": s.mask_low, "mask_high": s.mask_high, "packing": s.packing,
                          "micro_batch_tokens": s.micro_batch_tokens, "gradient_checkpointing": s.gradient_checkpointing,
                          # the behaviour log-probs are recomputed at the rollouts' one temperature (rule temperatures-differ)
                          "temperature": spec.stages[rollouts[0]].temperature, "seed": spec.seed, "dtype": spec.model.dtype}
        trainer_kwargs |= _algorithm_kwargs(spec, s, rollouts)
        trainer_kwargs |= lora_kwargs(spec)
        if s.distill is not None:  # the teacher, found like the pipeline's files
            trainer_kwargs["distill"] = {**s.distill.model_dump(),
                                         "teacher": str(resolve_path(s.distill.teacher, base_dir) or s.distill.teacher)}
        if s.ppo is not None and s.ppo.critic_model:  # the critic's own model, found like the pipeline's files
            trainer_kwargs["algo_options"]["critic_model"] = str(resolve_path(s.ppo.critic_model, base_dir) or s.ppo.critic_model)
        actors.append({"name": name, "role": "trainer", "stage": name, "replicas": s.replicas, "num_cpus": s.num_cpus, "num_gpus": s.num_gpus,
                       "deepspeed": str(ds) if ds else s.deepspeed, "trainer_kwargs": trainer_kwargs,
                       "steps": s.steps, "checkpoint_every": s.checkpoint_every, "keep_checkpoints": s.keep_checkpoints,
                       "resources": dict(s.resources),
                       "stall_factor": s.stall_factor, "no_progress_groups": s.no_progress_groups, "on_nonfinite": s.on_nonfinite,
                       "save_every": s.save_every, "weights": weight_transport(spec), **_threads(spec, name)})
        if spec.data.eval is not None:
            actors.append(_evaluator(spec, tasks, base_dir, every=10 if s.eval_every is None else s.eval_every))
    # control-plane servers: light, so they take a sliver of a CPU
    actors.append({"name": "payload-store", "role": "payload_store", "stage": None, "num_cpus": 0.1, "num_gpus": 0})
    actors.append({"name": "parameter-server", "role": "parameter_server", "stage": None, "num_cpus": 0.1, "num_gpus": 0})
    return actors


def _algorithm_kwargs(spec: Pipeline, s, rollouts: list[str]) -> dict:
    """The train stage's algorithm options beyond GRPO's defaults, as DeepSpeedTrainer takes them (only those that
    differ: a GRPO plan stays as it was). The generation budget is the rollouts' largest max_new_tokens."""
    budget = max((spec.stages[r].max_new_tokens for r in rollouts), default=None)
    out: dict = {}
    if s.algo != "grpo":
        out["algo"] = s.algo
        block = getattr(s, s.algo) if s.algo in ALGO_BLOCKS else None
        if block is not None:
            out["algo_options"] = block.model_dump()
    if s.entropy_coef:
        out["entropy_coef"] = s.entropy_coef
    if s.epochs != 1 or s.mini_batches != 1:  # several optimizer steps per batch
        out |= {"epochs": s.epochs, "mini_batches": s.mini_batches}
    if s.kl_estimator is not None:
        out["kl_estimator"] = s.kl_estimator
    if s.loss_agg == "seq-mean-token-sum-norm":
        out["max_new_tokens"] = budget  # Dr.GRPO's constant normaliser
    if s.overlong is not None:
        out["overlong"] = {"max_tokens": s.overlong.max_tokens or budget, "cache_tokens": s.overlong.cache_tokens,
                           "penalty_factor": s.overlong.penalty_factor}
    return out


def lora_kwargs(spec: Pipeline) -> dict:
    """{"lora": train.lora} for the trainer and every engine when the train stage trains LoRA adapters (stages/lora.py),
    else nothing (plans without LoRA stay as they were)."""
    lora = next((spec.stages[n].lora for n in stages_of(spec, "train")), None)
    return {"lora": lora.model_dump()} if lora is not None else {}


def weight_transport(spec: Pipeline) -> dict:
    """How versions leave the trainer (rlflow/runtime/parameter_server.py): the weight_sync edges' transport (they agree:
    rule weight-transports-differ) resolved, why, and the bucket size. auto: `object_store`, the fastest way in measured
    for both engines (benchmarks/bench_scale.py): vLLM's workers read each bucket from the store themselves, 2.6x the
    old file reload at 0.5B against the gloo collective's 1.3-1.6x; the hf engine copies it in where it lands, and a
    version over the store costs less than over gloo's loopback on one host. `collective` is there to be declared (it
    needs no object store, and it is the link that runs over NCCL). Both stage through host memory, on GPUs too
    (docs/internals/data-path.md)."""
    syncs = [e.policy for e in spec.edges if e.policy.kind == BACK_EDGE]
    declared = syncs[0].transport if syncs else "auto"
    vllm = any(spec.stages[n].engine == "vllm" for n in stages_of(spec, "rollout"))
    if declared != "auto":
        transport, why = declared, "declared"
    elif vllm:
        transport, why = "object_store", "auto: vLLM's workers read each bucket from the store themselves, in memory"
    else:
        transport, why = "object_store", "auto: the engines copy from the object store where it lands"
    return {"transport": transport, "declared": declared, "reason": why,
            "bucket_bytes": (syncs[0].bucket_mb if syncs else 256) * 2**20}


def _evaluator(spec: Pipeline, tasks: dict[str, dict], base_dir: Path, every: int) -> dict:
    """The evaluator actor (runtime/evaluation.py): its own engine with the first rollout stage's settings, and
    per task the held-out rows, the reward function and the rollout settings it is scored with."""
    rollouts = stages_of(spec, "rollout")
    first = spec.stages[rollouts[0]]
    rewards = {n: spec.stages[n].function_reward() for n in stages_of(spec, "reward")}
    d, per_task = spec.data, {}
    for name, task in tasks.items():
        rollout = spec.stages[task["rollout"]]
        held = ({"source": str(resolve_path(d.eval, base_dir) or d.eval), "holdout": None, "limit": None,
                 "prompt_field": task["prompt_field"], "answer_field": task["answer_field"]} if isinstance(d.eval, str)
                else {k: task[k] for k in ("source", "split", "holdout", "limit", "prompt_field", "answer_field") if k in task})
        per_task[name] = {**held, "reward_fn": rewards[task["reward"]], "max_new_tokens": rollout.max_new_tokens,
                          "temperature": rollout.temperature, "prompt_format": task.get("prompt_format", "raw"),
                          "system_prompt": task.get("system_prompt")}
    engine_kwargs = {"max_running": first.max_running, "max_new_tokens": max(t["max_new_tokens"] for t in per_task.values()),
                     "temperature": first.temperature, "top_p": first.top_p, "seed": spec.seed, "dtype": spec.model.dtype,
                     "max_model_len": spec.model.max_model_len}
    if first.stop:  # held-out completions end where training's do
        engine_kwargs["stop"] = list(first.stop)
    if first.max_turn_tokens is not None:
        engine_kwargs["max_turn_tokens"] = first.max_turn_tokens
    engine_kwargs |= vllm_settings(spec, rollouts[0])  # its GPUs are the first rollout stage's
    engine_kwargs |= lora_kwargs(spec)
    return {**_episode(spec, rollouts[0], tasks), "name": "evaluator", "role": "evaluator", "stage": rollouts[0], "engine": first.engine,
            "num_cpus": first.num_cpus, "num_gpus": first.num_gpus, "resources": dict(first.resources),
            "engine_kwargs": engine_kwargs, "every": every, "size": d.eval_size, "k": d.eval_k, "seed": d.seed,
            "tasks": per_task}


def _operators(spec: Pipeline, tasks: dict[str, dict], order: list[str], base_dir: Path) -> list[dict]:
    """Ray Data streaming operators, in data-flow order: a reader per task, a map per reward stage, a filter per filtered edge."""
    ops = [{"name": f"read:{t}", "kind": "read", "task": t, **{k: task[k] for k in ("source", "weight", "limit", "prompt_field", "answer_field")},
            "seed": spec.data.seed, "to": task["rollout"]} for t, task in tasks.items()]
    rewards = [n for n in order if n in stages_of(spec, "reward")]
    for name in rewards:
        s = spec.stages[name]
        ops.append({"name": name, "kind": "reward", "stage": name, "fn": s.fn or s.function_reward(), "tasks": _tasks_of(tasks, "reward", name),
                    "concurrency": s.concurrency, "num_cpus": s.num_cpus, "resources": dict(s.resources)})
        if s.fn is None or s.num_gpus:  # model / judge / http / scorers (rlflow/reward_scorers.py); a plain fn stage's op is as it was
            ops[-1] |= {"scorers": reward_scorers.lowered(s, base_dir, resolve_path), "batch_size": s.batch_size,
                        "num_gpus": s.num_gpus}
    for name in rewards:
        for e in spec.edges:
            if e.from_ == name and e.policy.kind == "streaming" and e.policy.filter:
                ops.append({"name": f"filter:{name}->{e.to}", "kind": "filter", "after": name, "fn": e.policy.filter})
    return ops


def _coordination(spec: Pipeline, tasks: dict[str, dict], base_dir: Path) -> dict:
    out = {}
    for name in stages_of(spec, "rollout"):
        s = spec.stages[name]
        sync = next((e.policy for e in spec.edges if e.to == name and e.policy.kind == BACK_EDGE), None)
        dispatch = next((e.policy for e in spec.edges if e.to == name and e.policy.kind == "skew_aware_dispatch"), None)
        profile = resolve_path(s.coordinator.profile, base_dir) if s.coordinator.profile else None
        out[name] = {
            "routing": s.coordinator.routing,
            "migration": s.coordinator.migration,
            "profile": str(profile) if profile else None,
            "allow_foreign_profile": s.coordinator.allow_foreign_profile,
            "interval_s": s.coordinator.interval_s,
            "mu": s.coordinator.mu, "phi_wait": s.coordinator.phi_wait, "phi_throughput": s.coordinator.phi_throughput,
            "weight_sync": {"mode": sync.mode, "partial_rollout": sync.partial_rollout} if sync else None,
            "dispatch": dispatch.model_dump(mode="json") if dispatch else {"kind": "round_robin"},
            "tasks": _tasks_of(tasks, "rollout", name),
        }
    return out


def lower(spec: Pipeline, *, source: str, text: str, overrides: list[str], base_dir: Path) -> dict:
    """The physical plan for a checked pipeline."""
    g = build_graph(spec)
    order = _topo(g)
    control = staleness_control(spec)
    tasks = _tasks(spec, base_dir)
    actors, operators = _actors(spec, tasks, base_dir), _operators(spec, tasks, order, base_dir)
    resolved = spec.model_dump(mode="json", by_alias=True)
    for name in stages_of(spec, "train"):
        ds = resolve_path(spec.stages[name].deepspeed, base_dir)
        resolved["stages"][name]["deepspeed"] = str(ds) if ds else spec.stages[name].deepspeed
    if spec.data.source is not None:
        resolved["data"]["source"] = tasks[MAIN_TASK]["source"]
    for name in spec.data.tasks or {}:
        resolved["data"]["tasks"][name]["source"] = tasks[name]["source"]
    if not spec.model.path.startswith("builtin:"):
        resolved["model"]["path"] = str(resolve_path(spec.model.path, base_dir) or spec.model.path)
    return {
        "plan_version": PLAN_VERSION,
        "rlflow_version": __version__,
        "name": spec.name,
        "source": source,
        "source_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "overrides": list(overrides),
        "pipeline": resolved,
        "graph": {
            "order": order,
            "nodes": [{"name": n, "kind": g.nodes[n]["kind"]} for n in order],
            "edges": [{"from": e.from_, "to": e.to, "policy": e.policy.model_dump(mode="json"), "back": e.policy.kind == BACK_EDGE,
                       "tasks": e.tasks} for e in spec.edges],
        },
        "tasks": tasks,
        "actors": actors,
        "data_operators": operators,
        "control": {"staleness": control, "coordination": _coordination(spec, tasks, base_dir)},
        "prediction": predict(spec, control),
        "resources": {
            # at the peak: an elastic rollout stage at its max_replicas
            "num_cpus": round(sum(a["num_cpus"] * a.get("replicas", 1) for a in actors) + _elastic_extra(actors, "num_cpus")
                              + sum(o.get("num_cpus", 0) * o.get("concurrency", 1) for o in operators), 3),
            "num_gpus": sum(a["num_gpus"] * a.get("replicas", 1) for a in actors) + _elastic_extra(actors, "num_gpus"),
            "cluster": spec.resources.model_dump(mode="json"),
        },
    }


def _topo(g) -> list[str]:
    dg = data_graph(g)
    dg.add_nodes_from(g.nodes)
    return list(nx.lexicographical_topological_sort(dg, key=lambda n: (n != DATA_NODE, n)))
