"""`rlflow compile`: YAML -> spec -> graph -> checks -> plan, plus the printed summary."""

from __future__ import annotations

import json
from pathlib import Path

from rlflow import devices, graph, hub, loader, registry
from rlflow.component_checks import resolve_path
from rlflow.draw import render_svg
from rlflow.errors import PipelineInvalid
from rlflow.placement import check_stage_resources
from rlflow.plan import lower
from rlflow.plan_model import Plan, PlanOutdated
from rlflow.resource_checks import check_machine
from rlflow.reward_scorers import check_reward_gpus, reward_settings
from rlflow.schema import Pipeline
from rlflow.tool_checks import picked_tool_parsers
from rlflow.user_code import python_path, search_dirs
from rlflow.validate import validate_partial

DEFAULT_PLAN = Path(".rlflow/plan.json")


def check_pipeline(path: str | Path, overrides: list[str] = (), gpus: int | None = None) -> tuple[Pipeline, loader.Document]:
    """Parse, validate and check a pipeline file; raise PipelineInvalid with every problem.

    Schema problems do not hide the graph's and components' (an unknown stage, a missing reward):
    those rules also run on the pipeline without its bad values where that still builds. The device rules check
    it against `gpus` GPUs (`--gpus`), else the GPUs counted here (rlflow/devices.py gpu_count).
    """
    doc = loader.load(path)
    loader.apply_overrides(doc, list(overrides))
    spec, problems, repairs = validate_partial(doc)
    if spec is not None:
        # Hub ids -> their snapshots in the local Hub cache (rlflow/hub.py); what they resolved to goes into the plan
        spec, doc.hub, hub_problems = hub.resolve_spec(spec, Path(path).resolve().parent)
        problems += hub_problems
        problems += [p for p in graph.check(spec, Path(path).resolve().parent) if not repairs.echoes(p)]
        problems += check_stage_resources(spec)
        count = devices.gpu_count(spec, gpus)
        placed, placing = devices.place(spec, count)
        problems += [p for p in placing if not repairs.echoes(p)]
        problems += check_reward_gpus(spec, count)
        problems += [p for p in devices.check_sleep(devices.resolve(spec, placed)) if not repairs.echoes(p)]
        if gpus is None:  # compiled for this machine: its CPUs bound the embedded cluster
            check_machine(spec, problems)
        problems = hub.without_echoes(problems, hub_problems)
    if problems:
        raise PipelineInvalid(doc.source, [doc.locate(p) for p in problems])  # a line of the file, or the --set
    return spec, doc


def compile_pipeline(path: str | Path, overrides: list[str] = (), gpus: int | None = None) -> dict:
    """The physical plan of a pipeline file, for a cluster of `gpus` GPUs (default: the GPUs counted here).

    plan["python_path"]: the directories (absolute) that modules named by the pipeline's import strings
    were found in beside the pipeline or in the working directory; every worker needs them on its path.
    plan["devices"]: where each stage runs and in which dtype (rlflow/devices.py); the plan's pipeline has them written in.
    """
    spec, doc = check_pipeline(path, overrides, gpus)
    text = Path(path).read_text()
    base_dir = Path(path).resolve().parent
    spec, picked = _pick_tool_parsers(spec, base_dir)
    placed, _ = devices.place(spec, devices.gpu_count(spec, gpus))
    plan = lower(devices.resolve(spec, placed), source=str(path), text=text, overrides=list(overrides), base_dir=base_dir)
    plan["python_path"] = python_path(import_strings(spec), search_dirs(base_dir))
    plan["devices"] = placed.as_dict() | {"given_gpus": gpus}
    hub.annotate(plan, getattr(doc, "hub", {}))  # plan["hub"]: each Hub id, its revision and the snapshot used
    if picked:  # rollout stage -> the tool_parser compile gave it, and the template marker that named it
        plan["tool_parsers"] = {name: {"parser": parser, "from": "chat template", "marker": marker}
                                for name, (parser, marker) in picked.items()}
    return plan


def _pick_tool_parsers(spec: Pipeline, base_dir: Path) -> tuple[Pipeline, dict[str, tuple[str, str]]]:
    """`spec` with the tool_parser the model's chat template names written into each stage with tools (or an agent)
    that sets none (rlflow/tool_checks.py picked_tool_parsers), and those picks."""
    picked = picked_tool_parsers(spec, base_dir, resolve_path)
    if not picked:
        return spec, picked
    spec = spec.model_copy(deep=True)
    for name, (parser, _) in picked.items():
        spec.stages[name].tool_parser = parser
    return spec, picked


def gpus_given(plan: dict | Plan) -> int | None:
    """The `--gpus N` a plan was compiled with (None: counted where it was compiled), to compile it again the same."""
    return (plan.get("devices") or {}).get("given_gpus")


def import_strings(spec: Pipeline) -> list[str]:
    """The `module:attr` references of a pipeline (rewards, filters, rankers, engines, tools)."""
    refs = [getattr(s, "fn", None) or getattr(s, "engine", None) for s in spec.stages.values()]
    refs += [getattr(e.policy, "filter", None) or getattr(e.policy, "ranker", None) for e in spec.edges]
    # chat-form tools (a string, or a schema dict's fn): imported in the rollout workers
    refs += [t if isinstance(t, str) else t.get("fn") for s in spec.stages.values() for t in getattr(s, "tools", None) or []]
    # a reward stage's weighted parts and its held-out reward (rlflow/reward_scorers.py): imported in the reward actors
    refs += [p.fn for s in spec.stages.values() for p in getattr(s, "scorers", None) or []]
    refs += [getattr(s, "eval_fn", None) for s in spec.stages.values()]
    # environments (imported in the rollout workers), and prompts a taskset makes (in the driver)
    refs += [getattr(s, "env", None) for s in spec.stages.values()]
    refs += [spec.data.source] + [t.source for t in (spec.data.tasks or {}).values()]
    refs = [r for r in refs if isinstance(r, str) and ":" in r and not r.startswith("builtin:")]
    # `verifiers:pkg.mod:attr` and `openenv:pkg.mod:Class` (registry.ADAPTERS): the module to find is pkg.mod
    return [registry.adapter_target("task", r) or r for r in refs]


def write_plan(plan: dict, out: str | Path = DEFAULT_PLAN) -> tuple[Path, Path]:
    """Write the plan JSON and its SVG picture beside it; returns both paths."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(plan, indent=2) + "\n")
    svg = out.with_suffix(".svg")
    svg.write_text(render_svg(Plan.of(plan)))
    return out, svg


def read_plan(path: str | Path = DEFAULT_PLAN) -> Plan:
    """Load a plan written by `rlflow compile`, typed, or raise PipelineInvalid saying what to do."""
    path = Path(path)
    from rlflow.errors import Problem
    from rlflow.plan import PLAN_VERSION

    if not path.exists():
        raise PipelineInvalid(str(path), [Problem((), "no plan here", "no-plan", "run `rlflow compile PIPELINE` first")])
    try:
        plan = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PipelineInvalid(str(path), [Problem((), f"not a plan: {e}", "bad-plan", "re-run `rlflow compile`")]) from None
    if not isinstance(plan, dict) or plan.get("plan_version") != PLAN_VERSION:
        raise PipelineInvalid(str(path), [Problem((), f"plan version {plan.get('plan_version') if isinstance(plan, dict) else '?'} is not {PLAN_VERSION}",
                                                  "plan-version", "re-run `rlflow compile` with this rlflow")])
    try:
        return Plan.checked(plan)  # a wrong shape here, not a KeyError deep in the runtime
    except PlanOutdated as e:
        raise PipelineInvalid(str(path), [Problem((), str(e), "plan-outdated", "re-run `rlflow compile` with this rlflow")]) from None


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _devices(plan: dict) -> list[str]:
    """Where each stage runs, in which dtype, with which vLLM settings (plan["devices"], rlflow/devices.py)."""
    d = plan.get("devices")
    if not d:
        return []
    gpus = "GPUs not counted" if d["gpus"] is None else f"{d['gpus']} GPU{'s' if d['gpus'] != 1 else ''}"
    unused = f", {d['unused_gpus']:g} unused" if d.get("unused_gpus") else ""
    lines = [f"  devices: {gpus} ({d['counted_by']}){unused}; dtype {d['dtype']} ({d['dtype_reason']})",
             f"  stages without num_gpus: {d['split']}"]
    engines = {a["stage"]: a for a in plan["actors"] if a["role"] == "rollout"}
    placed = [(n, p, engines.get(n)) for n, p in d["stages"].items()]
    if d.get("evaluator"):
        placed.append(("evaluator", d["evaluator"], next(a for a in plan["actors"] if a["role"] == "evaluator")))
    rows = []
    for name, p, actor in placed:
        unit = "" if name == "evaluator" and actor else " per rank" if actor is None else " per instance"
        where = "cpu" if p["device"] == "cpu" else f"cuda, {p['gpus']:g} GPU{unit}"
        rows.append([name, where, "declared" if p["declared"] else "auto", _vllm_settings(actor) + _sleep(actor)])
    return lines + _table(rows, indent="    ") + _threads(plan)


def _threads(plan: dict) -> list[str]:
    """CPU threads of each rollout instance and trainer rank, and why (rlflow/devices.py thread_plan)."""
    stages: dict[tuple[str, str], list[str]] = {}  # (threads, why) -> the stages with them
    for a in plan["actors"]:
        if a["role"] in ("rollout", "trainer") and "threads" in a:
            n, share = a["threads"], a.get("threads_share", 1)
            what = f"the node's cores{f' / {share}' if share > 1 else ''}" if n == "cores" else str(n)
            names = stages.setdefault((what, a["threads_reason"]), [])
            names += [a["stage"]] if a["stage"] not in names else []
    parts = [f"{', '.join(names)}: {what} ({why})" for (what, why), names in stages.items()]
    return [f"  cpu threads per actor: {'; '.join(parts)}"] if parts else []


def _sleep(actor: dict | None) -> str:
    """A rollout stage's engine asleep during train steps (rlflow/devices.py sleep_plan), and why; nothing when not."""
    if not actor or not actor.get("sleep_level"):
        return ""
    return f"{'; ' if 'enforce_eager' in actor.get('engine_kwargs', {}) else ''}sleeps during train steps at level " \
           f"{actor['sleep_level']} ({actor['sleep_reason']})"


def _vllm_settings(actor: dict | None) -> str:
    kw = (actor or {}).get("engine_kwargs", {})
    if "enforce_eager" not in kw:
        return ""
    out = f"vllm: tensor_parallel_size={kw['tensor_parallel_size']}, {'eager' if kw['enforce_eager'] else 'CUDA graphs'}"
    if "gpu_memory_utilization" in kw:
        out += f", gpu_memory_utilization={kw['gpu_memory_utilization']:g}"
    return out + (", sleep mode" if kw.get("enable_sleep_mode") else "")


def tool_parser_note(plan: dict) -> list[str]:
    """The tool-call format compile picked from the model's chat template, per stage (compile_pipeline)."""
    return [f"rollout '{name}' reads {p['parser']} tool calls: picked from the model's chat template (it has "
            f"{p['marker']!r}); set tool_parser: to choose another" for name, p in (plan.get("tool_parsers") or {}).items()]


def model_note(plan: dict) -> list[str]:
    """What a built-in model is, and what it was warm-started on: a user's own task must not meet an unknown model
    silently (builtin:tiny-llama knows only what it is warm-started on: rlflow/runtime/model.py warm_start_of)."""
    if plan["pipeline"]["model"]["path"] != "builtin:tiny-llama":
        return []
    tasks = plan["tasks"].values()
    files = [f"the training rows of {t['source']}" for t in tasks if not t["source"].startswith("builtin:")]
    builtin = sorted({t["source"] for t in tasks if t["source"].startswith("builtin:")})
    return [f"builtin:tiny-llama: a 0.6M-parameter Llama built on this machine (about a minute, then cached), "
            f"warm-started on {', '.join(files + builtin)}"]


def summary(plan: dict) -> str:
    """The plan as a person reads it before spending compute."""
    p = plan["pipeline"]
    lines = [f"pipeline '{plan['name']}' from {plan['source']}" + (f"  (overrides: {' '.join(plan['overrides'])})" if plan["overrides"] else "")]
    tasks = plan["tasks"]
    data = p["data"]["source"] or f"{len(tasks)} task types"
    lines.append(f"  model {p['model']['path']} ({p['model']['dtype']}, max_model_len {p['model']['max_model_len']}); data {data}")
    lines += [f"    {line}" for line in model_note(plan) + tool_parser_note(plan)]
    rows = [["stage", "kind", "settings", "resources"]]
    for name in plan["graph"]["order"]:
        if name not in p["stages"]:
            continue
        s = p["stages"][name]
        if s["kind"] == "rollout":
            settings = f"engine={s['engine']} group_size={s['group_size']} max_new_tokens={s['max_new_tokens']} max_running={s['max_running']}"
            res = f"{s['replicas']} x (cpu {s['num_cpus']:g}, gpu {s['num_gpus']:g})"
            if s.get("elastic"):
                e = s["elastic"]
                res += f", elastic {e['min_replicas']}..{e['max_replicas']}{' auto' if e['auto'] else ''}"
        elif s["kind"] == "reward":
            settings, res = reward_settings(s), f"{s['concurrency']} x (cpu {s['num_cpus']:g}" + (
                f", gpu {s['num_gpus']:g})" if s.get("num_gpus") else ")")
        elif s["kind"] == "buffer":
            settings, res = f"batch_groups={s['batch_groups']}", "-"
        else:
            settings = f"{s['algo']} on {s['backend']} ({Path(s['deepspeed']).name}) steps={s['steps']} lr={s['lr']:g}"
            res = f"{s.get('replicas', 1)} rank(s) x (cpu {s['num_cpus']:g}, gpu {s['num_gpus']:g})"
        if s.get("resources"):  # custom resources: the nodes it may run on
            res += " on " + ", ".join(f"{k} {v:g}" for k, v in s["resources"].items())
        rows.append([name, s["kind"], settings, res])
    lines += ["", *_table(rows), "", *_devices(plan)]
    rows = [["edge", "policy"]]
    from rlflow.draw import _policy_label

    for e in plan["graph"]["edges"]:
        rows.append([f"{e['from']} -> {e['to']}" + ("  (back edge)" if e["back"] else ""),
                     _policy_label(e["policy"]) + (f"  tasks: {', '.join(e['tasks'])}" if e.get("tasks") else "")])
    lines += ["", *_table(rows)]
    rows = [["task", "route", "source"]]
    for name, t in tasks.items():
        route = f"{t['rollout']} -> {t['reward']}" + (f" [{t['filter']}]" if t["filter"] else "")
        share = f", weight {t['weight']:g}" if len(tasks) > 1 else ""
        rows.append([f"{name}:", route, f"{t['source']}{share}" + (f", limit {t['limit']}" if t["limit"] else "")])
    lines += ["", *_table(rows)]
    c = plan["control"]["staleness"]
    params = ", ".join(f"{k}={v}" for k, v in c.items() if k != "kind" and v not in (None, 0) or k == "eta" and v == 0)
    lines += ["", f"  staleness control: {c['kind']}({params})"]
    for name, co in plan["control"]["coordination"].items():
        ws = co["weight_sync"]
        lines.append(f"  coordination of {name}: routing={co['routing']} migration={co['migration']} dispatch={co['dispatch']['kind']}"
                     + (f" sync={ws['mode']} partial_rollout={'on' if ws['partial_rollout'] else 'off'}" if ws else ""))
    trainer = next((a for a in plan["actors"] if a["role"] == "trainer"), None)
    if trainer and trainer.get("weights"):
        w = trainer["weights"]
        lines.append(f"  weights to rollout: {w['transport']}" + (f" ({w.get('reason', 'auto')})" if w["declared"] == "auto" else "")
                     + f", {w['bucket_bytes'] / 2**20:g} MiB buckets, in {trainer['trainer_kwargs']['dtype']}")
    pred = plan["prediction"]
    if pred["available"]:
        lines.append(f"  predicted mean staleness: {pred['mean']:.2f} steps = pre-queue {pred['pre_queue']:.2f} + in-queue {pred['in_queue']:.2f}"
                     f"  (rho={pred['rho']:.2f}, C={pred['concurrency']}, B={pred['batch_samples']}, M_tail={pred['tail_multiplier']:.2f}, q={pred['queue_factor']:g})")
    else:
        lines.append(f"  predicted mean staleness: n/a ({pred['reason']})")
    if plan.get("python_path"):
        lines.append(f"  user code: modules from {', '.join(plan['python_path'])} (plan python_path: the workers need it on their path)")
    r = plan["resources"]
    lines.append(f"  resources: {r['num_cpus']:g} CPUs, {r['num_gpus']:g} GPUs over {len(plan['actors'])} actors"
                 + (f" on {r['cluster']['address']}" if r["cluster"]["address"] else " on an embedded local Ray cluster"))
    return "\n".join(lines)
