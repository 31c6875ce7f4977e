"""Validated pipeline -> physical plan: versioned JSON with every default resolved (ARCHITECTURE.md §3).

The plan names the Ray actors and their resources, the Ray Data operators, the control-plane
policies with their parameters, and the closed-form staleness prediction when it applies.
Executors (`rlflow run`, `rlflow simulate`) read only the plan.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import networkx as nx

from rlflow import __version__
from rlflow.graph import BACK_EDGE, batch_groups, build_graph, data_graph, resolve_path, stages_of
from rlflow.schema import CONSUME_POLICIES, DATA_NODE, Pipeline
from rlflow.staleness_model import predict_mean_staleness, tail_multiplier

PLAN_VERSION = 1


def staleness_control(spec: Pipeline) -> dict:
    """The edge policy into train, as operators.registry.make_policy arguments (batch in groups)."""
    batch = batch_groups(spec)
    policy = next(e.policy for e in spec.edges if e.policy.kind in CONSUME_POLICIES)
    args = {"batch_size": batch, "eta": None, "capacity": None, "batch_redundancy": 0}
    if policy.kind == "barrier":
        return {"kind": "synchronous", **args, "eta": 0}
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
    """Closed-form mean staleness (staleness-model.md) when the pipeline gives its inputs."""
    w = spec.workload
    if control["kind"] != "queue_drop":
        return {"available": False, "reason": f"the closed form models queue-drop; this plan uses {control['kind']}"}
    if w.rollout_tokens_per_s is None or w.train_tokens_per_s is None:
        return {"available": False, "reason": "set workload.rollout_tokens_per_s and workload.train_tokens_per_s"}
    rollouts = [spec.stages[n] for n in stages_of(spec, "rollout")]
    group = rollouts[0].group_size
    concurrency = w.concurrency or sum(r.replicas * r.max_running for r in rollouts)
    cap = w.length_cap or max(r.max_new_tokens for r in rollouts)
    tail = tail_multiplier(w.tailness, group, cap=cap / w.mean_length if cap else None)
    rho = w.rollout_tokens_per_s / w.train_tokens_per_s
    q = control["capacity"] / control["batch_size"]
    p = predict_mean_staleness(rho=rho, concurrency=concurrency, batch=control["batch_size"] * group, tail=tail, queue_factor=q)
    return {"available": True, **p.as_dict(), "tail_multiplier": tail, "concurrency": concurrency,
            "batch_samples": control["batch_size"] * group, "queue_factor": q}


def _actors(spec: Pipeline) -> list[dict]:
    actors = []
    for name in stages_of(spec, "rollout"):
        s = spec.stages[name]
        for r in range(s.replicas):
            actors.append({"name": f"{name}-{r}", "role": "rollout", "stage": name, "engine": s.engine,
                           "num_cpus": s.num_cpus, "num_gpus": s.num_gpus})
    for name in stages_of(spec, "train"):
        s = spec.stages[name]
        actors.append({"name": name, "role": "trainer", "stage": name, "num_cpus": s.num_cpus, "num_gpus": s.num_gpus})
    # control-plane servers: light, so they take a sliver of a CPU
    actors.append({"name": "trajectory-server", "role": "trajectory_server", "stage": None, "num_cpus": 0.1, "num_gpus": 0})
    actors.append({"name": "parameter-server", "role": "parameter_server", "stage": None, "num_cpus": 0.1, "num_gpus": 0})
    return actors


def _operators(spec: Pipeline) -> list[dict]:
    """Ray Data streaming operators, in data-flow order."""
    ops = [{"name": "read_prompts", "kind": "read", "source": spec.data.source}]
    for name in stages_of(spec, "reward"):
        s = spec.stages[name]
        ops.append({"name": name, "kind": "map", "fn": s.fn, "concurrency": s.concurrency, "num_cpus": s.num_cpus})
    for e in spec.edges:
        if e.policy.kind == "streaming" and e.policy.filter:
            ops.append({"name": f"filter:{e.from_}->{e.to}", "kind": "filter", "fn": e.policy.filter})
    return ops


def _coordination(spec: Pipeline, base_dir: Path) -> dict:
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
            "interval_s": s.coordinator.interval_s,
            "mu": s.coordinator.mu, "phi_wait": s.coordinator.phi_wait, "phi_throughput": s.coordinator.phi_throughput,
            "weight_sync": {"mode": sync.mode, "partial_rollout": sync.partial_rollout} if sync else None,
            "dispatch": dispatch.model_dump(mode="json") if dispatch else {"kind": "round_robin"},
        }
    return out


def lower(spec: Pipeline, *, source: str, text: str, overrides: list[str], base_dir: Path) -> dict:
    """The physical plan for a checked pipeline."""
    g = build_graph(spec)
    order = _topo(g)
    control = staleness_control(spec)
    actors, operators = _actors(spec), _operators(spec)
    resolved = spec.model_dump(mode="json", by_alias=True)
    for name in stages_of(spec, "train"):
        ds = resolve_path(spec.stages[name].deepspeed, base_dir)
        resolved["stages"][name]["deepspeed"] = str(ds) if ds else spec.stages[name].deepspeed
    src = spec.data.source
    if not src.startswith("builtin:"):
        resolved["data"]["source"] = str(resolve_path(src, base_dir) or src)
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
            "edges": [{"from": e.from_, "to": e.to, "policy": e.policy.model_dump(mode="json"), "back": e.policy.kind == BACK_EDGE}
                      for e in spec.edges],
        },
        "actors": actors,
        "data_operators": operators,
        "control": {"staleness": control, "coordination": _coordination(spec, base_dir)},
        "prediction": predict(spec, control),
        "resources": {
            "num_cpus": round(sum(a["num_cpus"] for a in actors) + sum(o.get("num_cpus", 0) * o.get("concurrency", 1) for o in operators), 3),
            "num_gpus": sum(a["num_gpus"] for a in actors),
            "cluster": spec.resources.model_dump(mode="json"),
        },
    }


def _topo(g) -> list[str]:
    dg = data_graph(g)
    dg.add_nodes_from(g.nodes)
    return list(nx.lexicographical_topological_sort(dg, key=lambda n: (n != DATA_NODE, n)))
