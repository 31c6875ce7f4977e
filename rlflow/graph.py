"""Pipeline -> networkx graph, and the rules the graph and its policies must keep (docs/internals/architecture.md).

Every check appends Problems; nothing raises until all rules ran, so one compile shows every error.
The rules reject what the runtime cannot run (SHAPES); task-type routing rules are in rlflow/task_routes.py;
what the pipeline names outside itself (components, files, the model's limits) in rlflow/component_checks.py.
"""

from __future__ import annotations

from pathlib import Path

import networkx as nx

from rlflow.component_checks import (
    check_components,
    check_data,
    check_profiles,
    component,
    resolve_path,  # noqa: F401 - re-exported for rlflow/plan.py
)
from rlflow.errors import Problem, did_you_mean
from rlflow.resource_checks import check_resources
from rlflow.schema import CONSUME_POLICIES, DATA_NODE, Pipeline
from rlflow.task_routes import BACK_EDGE, check_tasks, kind_of
from rlflow.user_code import importable_from

#: the data edges the runtime executes, as (source kind, target kind); train -> rollout is the weight_sync back edge
SHAPES = {("data", "rollout"), ("rollout", "reward"), ("reward", "buffer"), ("reward", "train"), ("buffer", "train")}
SHAPES_TEXT = "data -> rollout, rollout -> reward, reward -> buffer or train, buffer -> train, train -> rollout (weight_sync)"
#: rules about an edge's ends; another rule on the same edge would only echo them
EDGE_SHAPE_RULES = {"unknown-stage", "self-loop", "edge-into-data", "duplicate-edge", "bad-weight-sync", "train-out-edge",
                    "data-not-to-rollout", "cycle", "unsupported-edge"}
#: graph problems after which task routing would only echo them
STRUCTURAL_RULES = EDGE_SHAPE_RULES | {"reserved-name", "no-train", "two-train-stages", "no-rollout", "unreachable-train",
                                       "unreachable-stage", "dead-end-stage", "no-reward", "data-source-or-tasks"}


def build_graph(spec: Pipeline) -> nx.DiGraph:
    """Data-flow graph: `data` plus one node per stage; edges carry their index and policy kind.

    Weight-sync (back) edges are kept with back=True; only edges between known nodes are added.
    """
    g = nx.DiGraph()
    g.add_node(DATA_NODE, kind="data")
    for name, stage in spec.stages.items():
        g.add_node(name, kind=stage.kind)
    trains = set(stages_of(spec, "train"))
    for i, e in enumerate(spec.edges):
        back = e.policy.kind == BACK_EDGE and e.from_ != DATA_NODE  # weight_sync out of data: a data edge, reported as such
        # Self-loops, edges into data and data edges out of train get their own errors; kept out of
        # the graph so they do not also show up as cycles.
        if e.from_ == e.to or e.to == DATA_NODE or (e.from_ in trains and not back):
            continue
        if e.from_ in g and e.to in g and not g.has_edge(e.from_, e.to):
            g.add_edge(e.from_, e.to, index=i, policy=e.policy.kind, back=back)
    return g


def data_graph(g: nx.DiGraph) -> nx.DiGraph:
    """The graph without the weight-sync back edges."""
    return nx.DiGraph([(u, v, d) for u, v, d in g.edges(data=True) if not d["back"]]) if g.number_of_edges() else nx.DiGraph()


def check(spec: Pipeline, base_dir: Path) -> list[Problem]:
    """All graph, policy and component problems of a schema-valid pipeline.

    Import strings resolve with `base_dir` (the pipeline's directory) and the working directory on sys.path.
    """
    problems: list[Problem] = []
    with importable_from(base_dir):
        dangling = _check_names(spec, problems)
        g = build_graph(spec)
        # An edge to an unknown stage disconnects the graph; reachability errors would only echo it.
        _check_shape(spec, g, problems, connectivity=not dangling)
        _check_edge_shapes(spec, g, problems, skip=dangling)
        _check_policies(spec, problems, skip=dangling)
        check_data(spec, base_dir, problems)
        check_tasks(spec, problems, dangling, edge_rules=EDGE_SHAPE_RULES, structural_rules=STRUCTURAL_RULES)
        check_components(spec, base_dir, problems)
        check_profiles(spec, base_dir, problems)
        check_resources(spec, batch_groups(spec), problems)
    _check_workload(spec, problems)
    return problems


def _check_workload(spec: Pipeline, problems: list[Problem]) -> None:
    """workload.stages gives rollout stages' response lengths: each key names a rollout stage. A prompt_share needs
    lengths that vary (tailness > 0): with equal lengths it would change nothing."""
    rollouts = stages_of(spec, "rollout")
    fix = f"name a rollout stage: {', '.join(rollouts)}"
    w = spec.workload
    for loc, own in [(("workload",), w), *((("workload", "stages", n), s) for n, s in (w.stages or {}).items())]:
        tailness = own.tailness if own.tailness is not None else w.tailness
        if own.prompt_share and not tailness:  # only where it is declared: an inherited share is not the user's here
            problems.append(Problem(loc + ("prompt_share",), f"prompt_share {own.prompt_share:g} with tailness 0: every length is "
                                    "the mean, so there is no variance for a prompt to share", "prompt-share-without-tail",
                                    "set a tailness (e.g. 60), or remove prompt_share"))
    for name in w.stages or {}:
        loc = ("workload", "stages", name)
        if name not in spec.stages:
            problems.append(Problem(loc, f"unknown stage '{name}'{did_you_mean(name, rollouts)}", "unknown-workload-stage", fix))
        elif spec.stages[name].kind != "rollout":
            problems.append(Problem(loc, f"'{name}' is a {spec.stages[name].kind} stage; workload.stages gives a rollout "
                                    "stage's response lengths", "workload-not-rollout", fix))


def stages_of(spec: Pipeline, kind: str) -> list[str]:
    return [n for n, s in spec.stages.items() if s.kind == kind]


def _edge_reported(problems: list[Problem], i: int, rules=EDGE_SHAPE_RULES) -> bool:
    return any(p.loc[:2] == ("edges", i) and p.rule in rules for p in problems)


def _check_names(spec: Pipeline, problems: list[Problem]) -> set[int]:
    """Name problems; returns the indices of edges with an unknown end."""
    known = [DATA_NODE, *spec.stages]
    seen: dict[tuple, int] = {}
    dangling = set()
    if DATA_NODE in spec.stages:
        problems.append(Problem(("stages", DATA_NODE), f"'{DATA_NODE}' names the data source in edges",
                                "reserved-name", "rename the stage"))
        dangling.add(-1)  # the graph is ambiguous: skip connectivity checks
    for i, e in enumerate(spec.edges):
        for end, name in (("from", e.from_), ("to", e.to)):
            if name not in known:
                dangling.add(i)
                problems.append(Problem(("edges", i, end), f"unknown stage '{name}'{did_you_mean(name, known)}",
                                        "unknown-stage", "stages are: " + ", ".join(known)))
        if e.to == DATA_NODE:
            problems.append(Problem(("edges", i, "to"), "nothing flows into 'data': it is the source",
                                    "edge-into-data", "point the edge at a stage"))
        if e.from_ == e.to:
            problems.append(Problem(("edges", i), f"edge from '{e.from_}' to itself", "self-loop", "remove it"))
        key = (e.from_, e.to)
        if key in seen:
            problems.append(Problem(("edges", i), f"duplicate edge {e.from_} -> {e.to} (also edges[{seen[key]}])",
                                    "duplicate-edge", "keep one edge per pair of stages"))
        seen.setdefault(key, i)
    return dangling


def _check_shape(spec: Pipeline, g: nx.DiGraph, problems: list[Problem], connectivity: bool) -> None:
    trains, rollouts = stages_of(spec, "train"), stages_of(spec, "rollout")
    if not trains:
        problems.append(Problem(("stages",), "no stage of kind train", "no-train", "add one: {kind: train}"))
    for extra in trains[1:]:
        problems.append(Problem(("stages", extra), f"second train stage '{extra}' (first: '{trains[0]}'); a pipeline trains one policy",
                                "two-train-stages", "keep one train stage"))
    if not rollouts:
        problems.append(Problem(("stages",), "no stage of kind rollout", "no-rollout", "add one: {kind: rollout}"))
    buffers = stages_of(spec, "buffer")
    for extra in buffers[1:]:
        problems.append(Problem(("stages", extra), f"second buffer stage '{extra}' (first: '{buffers[0]}')",
                                "two-buffers", "one buffer feeds train; remove one"))

    dg = data_graph(g)
    for i, e in enumerate(spec.edges):
        if e.policy.kind == BACK_EDGE:
            src, dst = spec.stages.get(e.from_), spec.stages.get(e.to)
            if e.from_ == DATA_NODE or (src and src.kind != "train") or (dst and dst.kind != "rollout"):
                problems.append(Problem(("edges", i), f"weight_sync {e.from_} -> {e.to}: weights flow from the train stage to a rollout stage",
                                        "bad-weight-sync", "use from: <train stage>, to: <rollout stage>"))
        elif e.from_ in spec.stages and spec.stages[e.from_].kind == "train":
            problems.append(Problem(("edges", i), f"edge {e.from_} -> {e.to} leaves train with '{e.policy.kind}'; the only edge out of train is the weight_sync back edge to rollout",
                                    "train-out-edge", "use policy kind weight_sync towards a rollout stage, or remove the edge"))
        elif e.from_ == DATA_NODE and e.to in spec.stages and spec.stages[e.to].kind != "rollout":
            problems.append(Problem(("edges", i, "to"), f"data feeds '{e.to}' (a {spec.stages[e.to].kind} stage); prompts go to rollout stages",
                                    "data-not-to-rollout", "connect data to a rollout stage"))

    if dg.number_of_nodes() and not nx.is_directed_acyclic_graph(dg):
        cycle = nx.find_cycle(dg)
        path = " -> ".join([u for u, _ in cycle] + [cycle[0][0]])
        first = min(g.edges[u, v]["index"] for u, v in cycle)
        problems.append(Problem(("edges", first), f"cycle {path}; data edges must flow from data to train",
                                "cycle", "the only back edge allowed is weight_sync from train to rollout"))
    if len(trains) != 1 or not connectivity:
        return
    train = trains[0]
    reach = nx.descendants(dg, DATA_NODE) if DATA_NODE in dg else set()
    if train not in reach:
        problems.append(Problem(("stages", train), f"train '{train}' is not reachable from data",
                                "unreachable-train", "connect data -> rollout -> reward -> ... -> train"))
    # Report root causes only: stages nothing flows into, and reachable stages nothing flows out of.
    for name in spec.stages:
        if name == train:
            continue
        if name not in reach and (name not in dg or dg.in_degree(name) == 0):
            problems.append(Problem(("stages", name), f"stage '{name}' is not reachable from data", "unreachable-stage",
                                    "connect it, or remove it"))
        elif name in reach and dg.out_degree(name) == 0:
            problems.append(Problem(("stages", name), f"stage '{name}' does not lead to train '{train}'", "dead-end-stage",
                                    "connect it towards train, or remove it"))
    no_reward = dg.subgraph([n for n in dg if n not in stages_of(spec, "reward")])
    for r in rollouts:
        if r in no_reward and train in no_reward and nx.has_path(no_reward, r, train):
            problems.append(Problem(("stages", r), f"rollout '{r}' reaches train without passing a reward stage",
                                    "no-reward", "add a stage of kind reward between rollout and train"))
    into_train = [(i, e) for i, e in enumerate(spec.edges) if e.to == train and e.policy.kind != BACK_EDGE]
    for i, e in into_train[1:]:
        problems.append(Problem(("edges", i), f"second edge into train ({e.from_} -> {train}); train takes batches from one stage",
                                "two-train-inputs", "merge the inputs in a buffer stage"))
    for r in rollouts:
        syncs = [i for i, e in enumerate(spec.edges) if e.to == r and e.policy.kind == BACK_EDGE and e.from_ != DATA_NODE]
        if not syncs:
            problems.append(Problem(("stages", r), f"rollout '{r}' never receives new weights",
                                    "no-weight-sync", f"add an edge {{from: {train}, to: {r}, policy: {{kind: weight_sync}}}}"))
        for i in syncs[1:]:
            problems.append(Problem(("edges", i), f"second weight_sync into '{r}'", "two-weight-syncs", "keep one"))
    _check_weight_transport(spec, problems)


def _check_weight_transport(spec: Pipeline, problems: list[Problem]) -> None:
    """The trainer publishes each version once, over one transport in one bucket size: every weight_sync edge
    must declare the same (or leave them at their defaults)."""
    syncs = [(i, e.policy) for i, e in enumerate(spec.edges) if e.policy.kind == BACK_EDGE]
    for field in ("transport", "bucket_mb"):
        first_i, first = syncs[0] if syncs else (None, None)
        for i, p in syncs[1:]:
            if getattr(p, field) != getattr(first, field):
                problems.append(Problem(("edges", i, "policy", field), f"weight_sync {field} {getattr(p, field)!r} differs from "
                                        f"edges[{first_i}]'s {getattr(first, field)!r}; the trainer publishes each version once, "
                                        "to every rollout stage the same way", "weight-transports-differ",
                                        f"set the same {field} on every weight_sync edge"))


def _check_policies(spec: Pipeline, problems: list[Problem], skip: set[int]) -> None:
    trains = stages_of(spec, "train")
    train = trains[0] if len(trains) == 1 else None  # with 0 or 2 trains, placement rules have no anchor
    for i, e in enumerate(spec.edges):
        if i in skip:
            continue
        p, loc = e.policy, ("edges", i, "policy")
        src = spec.stages.get(e.from_)
        if p.kind in CONSUME_POLICIES:
            if train is not None and e.to != train:
                problems.append(Problem(loc + ("kind",), f"'{p.kind}' decides what train consumes; it belongs on the edge into train, not {e.from_} -> {e.to}",
                                        "consume-policy-placement", "use streaming here"))
        elif train is not None and e.to == train and p.kind != BACK_EDGE:
            problems.append(Problem(loc + ("kind",), f"'{p.kind}' cannot feed train: the edge into train decides staleness",
                                    "train-edge-policy", "use one of: " + ", ".join(CONSUME_POLICIES)))
        if p.kind == "staleness_bound":
            if src is not None and src.kind != "buffer":
                problems.append(Problem(loc, f"a staleness bound needs a buffer in front of train, but '{e.from_}' is a {src.kind} stage",
                                        "bound-needs-buffer", "add a stage of kind buffer before train, or use in_flight_limit / one_step / unbounded on this edge"))
            if p.eta is None and p.queue != "drop":
                problems.append(Problem(loc + ("eta",), f"queue '{p.queue}' needs eta (the max staleness)", "missing-eta",
                                        "set eta: 0 for on-policy, 1-4 is typical for async"))
            if p.capacity is not None and p.queue == "none":
                problems.append(Problem(loc + ("capacity",), "capacity applies to queue drop or max; staleness buffers are sized by eta",
                                        "capacity-without-queue", "remove capacity, or set queue: drop"))
            if p.batch_redundancy and p.queue != "none":
                problems.append(Problem(loc + ("batch_redundancy",), "batch_redundancy needs staleness buffers (queue: none)",
                                        "redundancy-needs-buffers", "remove it, or set queue: none"))
            batch = batch_groups(spec)
            if p.capacity is not None and batch and p.capacity < batch:
                problems.append(Problem(loc + ("capacity",), f"capacity {p.capacity} groups is less than one batch ({batch} groups)",
                                        "capacity-below-batch", f"set capacity >= {batch} (q = capacity / batch >= 1)"))
        if p.kind == "skew_aware_dispatch":
            if src is not None or (e.to in spec.stages and spec.stages[e.to].kind != "rollout"):
                problems.append(Problem(loc, f"skew-aware dispatch needs a data -> rollout edge, not {e.from_} -> {e.to}",
                                        "dispatch-placement", "put it on the edge from data to a rollout stage"))
            if p.ranker == "oracle":
                problems.append(Problem(loc + ("ranker",), "ranker 'oracle' needs each prompt's true length before generation, "
                                        "which only the simulator's synthetic lengths give; `rlflow run` cannot run it",
                                        "oracle-ranker-not-runnable", "use ranker: learned (rlflow simulate models a learned ranker as a noisy oracle)"))
            else:
                component(problems, "ranker", p.ranker, loc + ("ranker",))
        if p.kind == "streaming" and p.filter is not None:
            component(problems, "filter", p.filter, loc + ("filter",))
            if src is None or src.kind != "reward":
                problems.append(Problem(loc + ("filter",), f"filters act on rewarded groups, but '{e.from_}' is not a reward stage",
                                        "filter-placement", "put the filter on the edge out of a reward stage"))
            elif p.filter == "drop_uniform_groups" and any(spec.stages[r].group_size == 1 for r in _rollouts_into(spec, e.from_)):
                problems.append(Problem(loc + ("filter",), "drop_uniform_groups with group_size 1 drops every group",
                                        "filter-drops-all", "raise the rollout's group_size, or remove the filter"))
        if p.kind == BACK_EDGE and e.to in spec.stages and spec.stages[e.to].kind == "rollout":
            rollout = spec.stages[e.to]
            bound = _consume_policy(spec)
            if p.mode == "throughput_aware" and not (bound and bound.kind == "staleness_bound" and bound.queue == "none"):
                problems.append(Problem(loc + ("mode",), "throughput_aware sync is StaleFlow's and needs staleness buffers",
                                        "sync-needs-buffers", "use a staleness_bound with queue: none into train, or mode: global"))
            if rollout.coordinator.migration == "repack" and p.mode != "per_instance":
                problems.append(Problem(("stages", e.to, "coordinator", "migration"), "Laminar repack needs per-instance weight sync",
                                        "repack-needs-per-instance", f"set edges[{i}].policy.mode: per_instance"))
    if batch_groups(spec) is None:
        problems.append(Problem(("stages",), "no batch size: nothing says how many groups a training step takes",
                                "no-batch-size", "add a buffer stage with batch_groups, or set data.prompts_per_step"))


def _rollouts_into(spec: Pipeline, reward: str) -> list[str]:
    """The rollout stages with an edge into `reward` (all rollout stages when none has)."""
    feeding = [e.from_ for e in spec.edges if e.to == reward and kind_of(spec, e.from_) == "rollout"]
    return feeding or stages_of(spec, "rollout")


def _consume_policy(spec: Pipeline):
    for e in spec.edges:
        if e.policy.kind in CONSUME_POLICIES:
            return e.policy
    return None


def batch_groups(spec: Pipeline) -> int | None:
    """Groups per training step: the buffer's batch_groups, else data.prompts_per_step (None: neither set)."""
    buffers = stages_of(spec, "buffer")
    return spec.stages[buffers[0]].batch_groups if buffers else spec.data.prompts_per_step



# --------------------------------------------------------------------------- edge shapes the runtime runs


def _check_edge_shapes(spec: Pipeline, g: nx.DiGraph, problems: list[Problem], skip: set[int]) -> None:
    """Every data edge is one of SHAPES, unless a rule about its ends already reported it."""
    dg = data_graph(g)
    in_cycle = set()
    if dg.number_of_nodes() and not nx.is_directed_acyclic_graph(dg):
        in_cycle = {g.edges[u, v]["index"] for u, v in nx.find_cycle(dg)}  # the cycle rule reports this one
    no_reward = {p.loc[1] for p in problems if p.rule == "no-reward"}
    two_buffers = any(p.rule == "two-buffers" for p in problems)
    for i, e in enumerate(spec.edges):
        src, dst = kind_of(spec, e.from_), kind_of(spec, e.to)
        if (i in skip or e.policy.kind == BACK_EDGE or src in (None, "data", "train") or dst in (None, "data")
                or e.from_ == e.to or i in in_cycle or _edge_reported(problems, i)
                or (src == "rollout" and dst in ("buffer", "train") and e.from_ in no_reward)
                or (src == dst == "buffer" and two_buffers)):
            continue
        if (src, dst) in SHAPES:
            continue
        if src == dst == "reward":
            why, out = ": two reward stages in sequence", "score each task in one reward stage (one fn may combine checks)"
        elif src == dst == "rollout":
            why, out = "", "give each task its own rollout stage, routed from data with tasks: [...]"
        else:
            why, out = "", f"reconnect '{e.from_}' into one of those shapes"
        problems.append(Problem(("edges", i), f"edge {e.from_} -> {e.to} is {src} -> {dst}{why}, not a shape the runtime runs",
                                "unsupported-edge", f"the runtime runs {SHAPES_TEXT}; {out}"))
