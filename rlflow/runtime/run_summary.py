"""The end of `rlflow run`: a few lines for a person on the terminal, the whole summary in `<run dir>/summary.json`."""

from __future__ import annotations

import json
from pathlib import Path

from rlflow.runtime.progress import format_duration

SUMMARY_FILE = "summary.json"


def write(summary: dict, run_dir: Path) -> Path:
    """The run's summary (launch.launch returns it) as JSON in its run directory."""
    path = Path(run_dir) / SUMMARY_FILE
    path.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return path


def describe(summary: dict, total_steps: int | None = None) -> list[str]:
    """What ended, where everything is, and what to do next; every figure is also in summary.json."""
    def f(x):
        return "-" if x is None else f"{x:.3f}"

    steps, run_dir = summary.get("steps", 0), summary.get("run_dir")
    of = f" of {total_steps}" if total_steps and steps != total_steps else ""
    ended = f"stopped ({summary['stopped_by']})" if summary.get("stopped_by") else "stopped" if summary.get("stopped") else "done"
    lines = [f"{ended}: {steps}{of} steps in {format_duration(summary.get('elapsed_s') or 0)}"
             + (f"; reward(all) {f(summary.get('reward_first'))} -> {f(summary.get('reward_last'))}"
                if "reward_first" in summary else "")]  # means over the first and last `window` steps
    if summary.get("eval_last"):
        first, last = summary["eval_first"], summary["eval_last"]
        if first.get("step") == last.get("step"):  # one evaluation: a value, not a change
            lines.append(f"held-out accuracy {f(last.get('eval/accuracy'))} (step {last.get('step')})")
        else:
            lines.append(f"held-out accuracy {f(first.get('eval/accuracy'))} (step {first.get('step')}) -> "
                         f"{f(last.get('eval/accuracy'))} (step {last.get('step')})")
        if hint := diverging(summary):
            lines.append(hint)
    if run_dir:
        export = Path(run_dir) / "export"
        lines.append(f"run directory: {run_dir} ({SUMMARY_FILE}, run.log, checkpoint/"
                     + (", export/)" if export.is_dir() else ")"))
    if summary.get("checkpoints"):
        lines.append(checkpoints_line(summary["checkpoints"]))
    if run_dir and (Path(run_dir) / "export").is_dir():
        lines.append(f"the policy: {Path(run_dir) / 'export'} (transformers.AutoModelForCausalLM.from_pretrained loads it)")
    if summary.get("mlflow_run_id"):
        uri = summary.get("mlflow_uri")
        lines.append(f"MLflow run {summary['mlflow_run_id']}" + (f": mlflow ui --backend-store-uri {uri}" if uri else ""))
    if run_dir:
        if summary.get("stopped"):
            lines.append(f"resume with: rlflow run --resume (the newest run), or --resume {Path(run_dir).name} (this one)")
        lines.append(f"next: rlflow eval {run_dir}   rlflow export {run_dir} -o DIR")
    return lines


#: how far held-out accuracy must fall below its first value, and the training reward rise, for `diverging` to
#: speak: a clear margin over the noise of a few dozen held-out prompts (one prompt of 32 is 0.031)
EVAL_DROP = 0.1
REWARD_RISE = 0.02


def diverging(summary: dict) -> str | None:
    """One line when the training reward rose while held-out accuracy fell by a clear margin (EVAL_DROP), else None:
    the policy may be learning the training prompts (or a flaw of the reward) rather than the task."""
    first, last = summary.get("eval_first") or {}, summary.get("eval_last") or {}
    acc0, acc1 = first.get("eval/accuracy"), last.get("eval/accuracy")
    r0, r1 = summary.get("reward_first"), summary.get("reward_last")
    if None in (acc0, acc1, r0, r1) or first.get("step") == last.get("step"):
        return None
    if acc0 - acc1 < EVAL_DROP or r1 - r0 < REWARD_RISE:
        return None
    return (f"note: the training reward rose ({r0:.3f} -> {r1:.3f}) while held-out accuracy fell ({acc0:.3f} -> "
            f"{acc1:.3f}): the policy may be overfitting the training prompts or exploiting the reward (reward "
            "hacking); compare the eval/ and reward/ curves in MLflow before using this policy")


def checkpoints_line(ckpts: dict) -> str:
    """E.g. `checkpoints: 3 kept (step-80, step-90, step-100), 290.1 MB; 7 pruned (train.keep_checkpoints)`."""
    kept, pruned = ckpts.get("kept") or [], ckpts.get("pruned") or 0
    return (f"checkpoints: {len(kept)} kept ({', '.join(kept)}), {ckpts.get('bytes', 0) / 1e6:.1f} MB"
            + (f"; {pruned} pruned (train.keep_checkpoints)" if pruned else ""))
