"""The scorers of a reward stage that sets model, judge, http or scorers (docs/guides/reward-models.md), inside its
Score actors: the stateful callable class of the stage's Ray Data actor pool (reward_stream.py) loads each model
once, then scores every bundle of groups it is handed.

A trajectory's reward is the weighted sum of its parts; one part that fails fails the trajectory (nan, the parts'
reasons in reward_error), as a failing function does: it is recorded, never dropped. A function part runs as a
function stage's does (its own child process, reward_process.py); a reward model, judge or endpoint scores the
bundle's trajectories together, in batches. The stage-stopping rules stay reward_call.py's: a function's timeouts
in a row, and for the others TIMEOUTS_IN_A_ROW bundles on which every trajectory of the part timed out.

Driver side, `prepared` resolves the built-in models to directories before the actors start.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from rlflow import registry
from rlflow.reward_schema import TINY_JUDGE
from rlflow.runtime.reward_call import TIMEOUTS_IN_A_ROW


def part_name(spec: dict) -> str:
    """How messages name a scorer: its function, or 'reward model <dir>', 'judge <model>', 'http <url>'."""
    if spec.get("fn"):
        return spec["fn"]
    if spec.get("model"):
        return f"reward model {spec['model']}"
    if spec.get("judge"):
        return f"judge {spec['judge']['model']}"
    return f"http {spec['http']['url']}"


def stage_name(scorers: list[dict]) -> str:
    """The name a stage's failure messages give its reward: its one part's, or the parts' joined by ' + '."""
    return " + ".join(part_name(s) for s in scorers)


def prepared(scorers: list[dict], policy_dir: str | None, log=print) -> list[dict]:
    """`scorers` with a built-in reward model (registry.REWARD_MODELS) built and cached, and a judge's
    builtin:tiny-llama as the run's policy start `policy_dir` (the driver's: built once, before the actors that read
    it start)."""
    out = []
    for s in scorers:
        s = dict(s)
        if s.get("model", "").startswith("builtin:"):
            s["model"] = str(registry.resolve("reward_model", s["model"])(progress=log))
        if s.get("judge") and s["judge"]["model"] == TINY_JUDGE:
            if policy_dir is None:
                raise ValueError("a judge on builtin:tiny-llama needs the run's tiny Llama (model.path builtin:tiny-llama)")
            s["judge"] = {**s["judge"], "model": str(policy_dir)}
        out.append(s)
    return out


class Part:
    """One weighted scorer; `score(groups)` -> per group a list of (reward, error, timed_out)."""

    def __init__(self, spec: dict, batch_size: int, fn_scorer: Callable[[str], object]):
        self.weight, self.name = float(spec.get("weight", 1.0)), part_name(spec)
        self.fn = fn_scorer(spec["fn"]) if spec.get("fn") else None  # a Score of that function (reward_stream.py)
        self.batched = None if self.fn else _batched(spec, batch_size)
        self.timeouts_in_row = 0
        self.hung = ""
        self.rule = ""  # why it hung: reward-hangs, or user-code-error (a function part that no longer loads)

    def score(self, groups: list[dict]) -> list[list[tuple[float, str, bool]]]:
        if self.fn is not None:
            out = []
            for g in groups:
                r = self.fn.score(g)
                if r["stage_error"] and not self.hung:
                    self.hung, self.rule = r["stage_error"], r["stage_rule"]
                out.append([(v, e, False) for v, e in zip(r["reward"], r["reward_error"], strict=True)])
            return out
        items = [{"traj_id": tid, "prompt": g["prompt"], "completion": str(c), "answer": g["answer"]}
                 for g in groups for tid, c in zip(g["traj_id"], g["completion"], strict=True)]
        flat = self.batched.score(items) if items else []
        if flat and all(t for _, _, t in flat):
            self.timeouts_in_row += 1
            if self.timeouts_in_row >= TIMEOUTS_IN_A_ROW and not self.hung:
                self.hung = f"{self.name} timed out on every trajectory of {self.timeouts_in_row} bundles in a row"
        elif flat:
            self.timeouts_in_row = 0
        out, at = [], 0
        for g in groups:
            out.append(flat[at:at + len(g["traj_id"])])
            at += len(g["traj_id"])
        return out


def _batched(spec: dict, batch_size: int):
    if spec.get("model"):
        from rlflow.stages.reward_model import RewardModel

        return RewardModel(spec["model"], batch_size=batch_size, dtype=spec.get("dtype", "auto"))
    if spec.get("judge"):
        from rlflow.stages.reward_judge import Judge

        j = spec["judge"]
        return Judge(j["model"], j["template"], j["verdict"], engine=j.get("engine", "hf"),
                     max_new_tokens=j.get("max_new_tokens", 8), timeout_s=j.get("timeout_s", 30.0),
                     batch_size=batch_size, dtype=spec.get("dtype", "auto"),
                     gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.5))
    from rlflow.stages.reward_http import HttpReward

    h = spec["http"]
    return HttpReward(h["url"], timeout_s=h.get("timeout_s", 10.0), retries=h.get("retries", 3),
                      backoff_s=h.get("backoff_s", 0.5), concurrency=h.get("concurrency", 8), headers=h.get("headers"))


class ScorerPool:
    """A stage's weighted scorers, loaded once; `score(groups)` -> per group {reward, reward_error, stage_error}."""

    def __init__(self, scorers: list[dict], batch_size: int, fn_scorer: Callable[[str], object]):
        self.parts = [Part(s, batch_size, fn_scorer) for s in scorers]
        self.single = len(self.parts) == 1 and self.parts[0].weight == 1.0

    @property
    def hung(self) -> str:
        return next((p.hung for p in self.parts if p.hung), "")

    @property
    def rule(self) -> str:
        return next((p.rule or "reward-hangs" for p in self.parts if p.hung), "")

    def close(self) -> None:
        """Shut down what the scorers hold beyond memory (a vLLM judge's engine process)."""
        for p in self.parts:
            closing = getattr(p.batched, "close", None)
            if closing:
                closing()

    def score(self, groups: list[dict]) -> list[dict]:
        per_part = [p.score(groups) for p in self.parts]
        out = []
        for k, g in enumerate(groups):
            rewards, errors = [], []
            for i in range(len(g["traj_id"])):
                got = [(p, part[k][i]) for p, part in zip(self.parts, per_part, strict=True)]
                failed = [(p, e) for p, (_, e, _) in got if e]
                if failed:
                    rewards.append(math.nan)
                    errors.append("; ".join(e if self.single or e.startswith(p.name) else f"{p.name}: {e}" for p, e in failed))
                else:
                    rewards.append(got[0][1][0] if self.single else sum(p.weight * r for p, (r, _, _) in got))
                    errors.append("")
            out.append({"reward": rewards, "reward_error": errors, "stage_error": self.hung, "stage_rule": self.rule})
        return out
