"""What a run reports: one row per training step (MLflow metrics, the progress line) and the summary.

Rewards are counted when scored (everything generated, the policy's success rate) and when trained
(the batch, after filters); both overall and per task type (`task/<name>/...`). A step in which
nothing new was scored reports no `reward_all_mean` rather than 0.0.
"""

from __future__ import annotations

import math
import time
from collections import deque

from rlflow.plan_model import Plan
from rlflow.runtime.progress import Field, Progress, format_duration
from rlflow.runtime.workload_measured import MEASURED_GROUPS, measured_workload, prompt_share

REWARD_LEGEND = ("reward(all): every completion scored since the last step (the success rate)",
                 "reward(trained): the batch trained on, after the filters (biased by them)")


def _is_print(log) -> bool:
    """`log` is Python's own print, though `print` may be another by now (Ray's tqdm_ray replaces builtins.print on a
    driver at a terminal)."""
    return log is print or (getattr(log, "__module__", None) == "builtins" and getattr(log, "__name__", None) == "print")


def _mean(xs) -> float | None:
    return sum(xs) / len(xs) if xs else None


class Metrics:
    def __init__(self, plan: dict | Plan, log=print, t0: float | None = None):
        """t0: the run's time origin (run_clock.RunClock.t0), so `elapsed` and the start-up timeline agree."""
        plan = Plan.of(plan)
        self.steps = plan.trainer.steps
        # to stdout: a bar with the ETA on a terminal, a line per step in a log (progress.py); every other message
        # of the run goes through `self.log` so it never lands on the end of a bar drawn in place
        self.out = Progress(self.steps) if _is_print(log) else None
        self.plan, self.log = plan, (self.out.message if self.out else log)
        self.history: list[dict] = []
        self.staleness_all: list[int] = []
        self.scored: dict[str, list[float]] = {}  # task -> rewards scored since the last step
        self.evals: list[dict] = []  # held-out evaluations, {"step", "eval/...": value}, in the order they arrived
        self._busy_prev = 0.0
        self._instance_s_prev = 0.0
        self.t0 = time.monotonic() if t0 is None else t0
        self._legend_shown = False
        self.trained_groups: deque[list[int]] = deque(maxlen=MEASURED_GROUPS)  # lengths, for the measured workload

    @staticmethod
    def batch_info(rewards: dict[str, float], groups: dict[str, list[str]], staleness: dict[str, int],
                   lengths: dict[str, int]) -> dict:
        """What a step row needs of the consumed batch (traj ids are `<task>-<n>/<member>`)."""
        tids = list(rewards)
        gid = {t: t.split("/")[0] for t in tids}
        return {"staleness": [staleness[g] for g in groups], "rewards": [rewards[t] for t in tids],
                "lengths": [lengths[t] for t in tids], "group_lengths": [[lengths[t] for t in m] for m in groups.values()],
                "task_of_traj": [gid[t].rsplit("-", 1)[0] for t in tids],
                "staleness_of_traj": [staleness[gid[t]] for t in tids]}

    def rewarded(self, task: str, rewards: list[float]) -> None:
        self.scored.setdefault(task, []).extend(rewards)

    def start(self, instance_s: float) -> None:
        """The loop starts: rollout idle ratios count instance-seconds from here, not from the actors' start-up."""
        self._instance_s_prev = instance_s

    def step_row(self, step: int, version: int, info: dict, result, wall: float, busy_s: float,
                 instance_s: float, counters, counts: dict, recall: float | None) -> dict:
        """result: the step's messages.StepResult. instance_s: cumulative rollout instance-seconds served
        (instances may join or leave, scaling.py)."""
        trained = {**result.metrics, "sync_s": result.sync_s, "ranks": result.ranks}
        st, rw, lengths = info["staleness"], info["rewards"], info["lengths"]
        mean_len = _mean(lengths) or 0.0
        everything = [r for rs in self.scored.values() for r in rs]
        row = {
            "step": step, "version": version, "reward_mean": _mean(rw),
            # the policy's success rate on everything scored since the last step (the trained batch is filter-biased)
            "reward_all_mean": _mean(everything), "scored": len(everything),
            "reward_std": math.sqrt(sum((r - _mean(rw)) ** 2 for r in rw) / len(rw)),
            "staleness_mean": _mean(st), "staleness_max": max(st),
            "length_mean": mean_len, "length_max": max(lengths, default=0),
            # measured group tailness multiplier M_tail = E[max over a group] / E[L] (docs/concepts/staleness.md)
            "length_tailness": (_mean([max(g) for g in info["group_lengths"]]) / mean_len) if mean_len else 0.0,
            # measured workload.prompt_share: how alike a prompt's samples are in length (the simulator's input)
            "length_prompt_share": prompt_share(info["group_lengths"]),
            "trajectories_per_s": len(rw) / wall, "tokens_per_s": trained.get("tokens", 0) / wall,
            "trainer_idle_ratio": max(0.0, 1 - trained.get("step_time_s", 0) / wall),
            "rollout_idle_ratio": max(0.0, 1 - (busy_s - self._busy_prev) / max(instance_s - self._instance_s_prev, 1e-9)),
            "admitted": counters.admitted, "consumed": counters.consumed, "aborted": counters.aborted,
            "filtered": counters.filtered, "dropped": counters.dropped, "in_flight": counters.in_flight,
            "pending": counters.pending, **counts,
            **{k: v for k, v in trained.items() if isinstance(v, (int, float)) and not isinstance(v, bool)},
        }
        self._busy_prev, self._instance_s_prev = busy_s, instance_s
        for task in self.plan.tasks:
            mine = [i for i, t in enumerate(info["task_of_traj"]) if t == task]
            row[f"task/{task}/reward_all_mean"] = _mean(self.scored.get(task, []))
            row[f"task/{task}/scored"] = len(self.scored.get(task, []))
            row[f"task/{task}/trained"] = len(mine)
            row[f"task/{task}/reward_mean"] = _mean([rw[i] for i in mine])
            row[f"task/{task}/length_mean"] = _mean([lengths[i] for i in mine])
            row[f"task/{task}/staleness_mean"] = _mean([info["staleness_of_traj"][i] for i in mine])
        self.scored = {}
        for s in range(max(st) + 1):
            row[f"staleness_hist_{s}"] = st.count(s)
        pred = self.plan.prediction
        if pred.get("available"):
            row["staleness_predicted"] = pred["mean"]
        if recall is not None:
            row["ranker_recall_top20"] = recall
        self.staleness_all += st
        self.trained_groups.extend(info["group_lengths"])
        self.history.append(row)
        return row

    def evaluated(self, step: int, metrics: dict, show: bool = False) -> None:
        """Held-out metrics of the weights of `step` (they arrive after its row): into that row and the list."""
        self.evals.append({"step": step, **metrics})
        for row in self.history:
            if row["step"] == step:
                row.update(metrics)
        if show:
            k = next((key for key in metrics if key.startswith("eval/pass_at_")), None)
            self.log(f"eval of step {step}: accuracy {metrics['eval/accuracy']:.3f}"
                     + (f"  pass@{k.rsplit('_', 1)[1]} {metrics[k]:.3f}" if k else "")
                     + f"  reward {metrics['eval/reward_mean']:.3f}  ({metrics['eval/prompts']} held-out prompts)")

    def progress(self, row: dict) -> None:
        """The step's line: its fields in order, ranked for a narrow terminal (progress.fit); the legend of the
        two rewards before the first."""
        def f(x):
            return "-" if x is None else f"{x:.3f}"

        if not self._legend_shown:
            self._legend_shown = True
            for line in REWARD_LEGEND:
                self.log(line)
        tasks = sorted({k.split("/")[1] for k in row if k.startswith("task/")})
        fields = [Field(f"step {row['step']}/{self.steps}"), Field(f"reward(all) {f(row['reward_all_mean'])}"),
                  Field(f"reward(trained) {f(row['reward_mean'])}"), Field(f"loss {row.get('loss', 0):+.4f}", 1)]
        if self.evals:
            fields.append(Field(f"eval acc {self.evals[-1]['eval/accuracy']:.3f} (step {self.evals[-1]['step']})", 2))
        fields += [Field(f"elapsed {format_duration(time.monotonic() - self.t0)}", 2),
                   Field(f"staleness {row['staleness_mean']:.2f} (max {row['staleness_max']})", 3),
                   Field(f"{row['trajectories_per_s']:.1f} traj/s", 4)]
        if len(tasks) > 1:
            fields.append(Field("[" + "  ".join(f"{t} {f(row[f'task/{t}/reward_all_mean'])}" for t in tasks) + "]", 5))
        if self.out:
            self.out.step(row["step"], fields)
        else:
            self.log("  ".join(x.text for x in fields))

    def close(self) -> None:
        """Ends the progress line drawn in place, if the run ends before its last step."""
        if self.out:
            self.out.close()

    def summary(self, counters, counts: dict, run_id: str, recall: float | None) -> dict:
        h = [r for r in self.history if r["reward_all_mean"] is not None]
        k = max(1, min(10, len(h) // 3))  # mean over the first and last k steps that scored something
        st = self.staleness_all
        return {"steps": len(self.history), "reward_first": _mean([r["reward_all_mean"] for r in h[:k]]),
                "reward_last": _mean([r["reward_all_mean"] for r in h[-k:]]), "window": k,
                "staleness_mean": _mean(st) or 0.0, "staleness_max": max(st, default=0),
                "counters": vars(counters), **counts, "elapsed_s": time.monotonic() - self.t0,
                "mlflow_run_id": run_id, "workload_measured": measured_workload(list(self.trained_groups)),
                **({"ranker_recall_top20": recall} if recall is not None else {}),
                **({"eval_first": self.evals[0], "eval_last": self.evals[-1], "evals": len(self.evals)} if self.evals else {})}
