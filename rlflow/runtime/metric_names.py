"""The names a step row's metrics get in MLflow: grouped by prefix, headline curves first, zero counters held back.

The row (metrics.py) keeps its flat keys (`reward_mean`, `ranks`, ...): the driver, the summary, the plots and the
tests read those. Only the MLflow boundary (tracking.Tracker.log_metrics) renames them, through `mlflow_key`.

MLflow's UI makes one chart section per prefix (everything before the last `/`), sections in alphabetical order,
charts in alphabetical order within a section; `system/<name>` goes to its "System metrics" tab. So each group's
headline curve has the name that sorts first in its section (`reward/mean`, `train/loss`, `staleness/max` and
`staleness/mean`), and the details sit in sub-sections (`train/policy/`, `staleness/groups/`, ...). The names are the
only lever: MLflow has no API for a client to order the charts or choose the runs table's columns (a person can,
and keep it as a saved view). The layout is documented in docs/guides/tracking.md.
"""

from __future__ import annotations

import re

# one entry per row key a run reports; None: not logged (the step axis, or the same number under another name)
NAMES: dict[str, str | None] = {
    # the step axis, not metrics: MLflow's step is the training step and the weights' version equals it
    "step": None,
    "version": None,
    # reward/: the policy's success rate on everything scored since the last step is the headline; the trained
    # batch (after filters) is biased by them
    "reward_all_mean": "reward/mean",
    "reward_mean": "reward/mean_trained",
    "reward_std": "reward/std_trained",
    # train/: loss first; batching, optimiser and policy-distribution details in their own sections
    "loss": "train/loss",
    "pg_loss": "train/pg_loss",
    "tokens": "train/tokens",
    "tokens_per_s": "train/tokens_per_s",
    "step_time_s": "train/step_time_s",
    "trainer_idle_ratio": "train/step_idle_ratio",
    "micro_batches": "train/batch/micro_batches",
    "optimizer_steps": "train/batch/optimizer_steps",  # train.epochs x train.mini_batches, when above 1
    "rank_token_imbalance": "train/batch/rank_token_imbalance",
    "grad_norm": "train/optim/grad_norm",
    "lr": "train/optim/lr",
    "entropy": "train/policy/entropy",
    "kl": "train/policy/kl",
    "clip_frac": "train/policy/clip_frac",
    "ratio_mean": "train/policy/ratio_mean",
    "ratio_mean_first": "train/policy/ratio_mean_first",  # with several optimizer steps a batch: 1 on its first
    "ratio_mean_last": "train/policy/ratio_mean_last",  # and its last, where pi_old is furthest behind
    "importance_weight_mean": "train/policy/importance_weight_mean",
    "importance_weight_max": "train/policy/importance_weight_max",
    "importance_weight_used_mean": "train/policy/importance_weight_used_mean",
    "importance_truncated_frac": "train/policy/importance_truncated_frac",
    "importance_masked_frac": "train/policy/importance_masked_frac",
    "distill_reverse_kl": "train/policy/distill_reverse_kl",  # train.distill: KL(student || teacher) on the samples
    # algo ppo's critic (stages/critic.py)
    "critic_loss": "train/critic/loss",
    "value_mean": "train/critic/value_mean",
    "value_clip_frac": "train/critic/value_clip_frac",
    "explained_variance": "train/critic/explained_variance",
    "critic_grad_norm": "train/critic/grad_norm",
    # rollout/: what the engines produced and how busy they were
    "trajectories_per_s": "rollout/trajectories_per_s",
    "scored": "rollout/scored",
    "length_mean": "rollout/length_mean",
    "length_max": "rollout/length_max",
    "length_tailness": "rollout/length_tailness",
    "length_prompt_share": "rollout/length_prompt_share",
    "rollout_idle_ratio": "rollout/idle_ratio",
    "rollout_instances": "rollout/instances",
    "reward_failed": "rollout/reward_failed",
    "rerouted": "rollout/rerouted",
    "aborted_trajectories": "rollout/aborted_trajectories",
    "episodes": "rollout/env/episodes",
    "episode_turns": "rollout/env/episode_turns",
    "env_tokens": "rollout/env/tokens",
    "env_wait_s": "rollout/env/wait_s",
    "coord_cycles": "rollout/coord/cycles",
    "coord_pulls": "rollout/coord/pulls",
    "coord_routed": "rollout/coord/routed",
    "coord_interrupted": "rollout/coord/interrupted",
    "coord_rejected": "rollout/coord/rejected",
    "coord_resyncs": "rollout/coord/resyncs",
    "dispatch_plans": "rollout/dispatch/plans",
    "dispatch_long_groups": "rollout/dispatch/long_groups",
    "dispatch_long_instances": "rollout/dispatch/long_instances",
    "ranker_observed": "rollout/dispatch/ranker_observed",
    "ranker_recall_top20": "rollout/dispatch/ranker_recall_top20",
    # staleness/: the staleness of the trained batch, then what the staleness policy did with each group
    "staleness_mean": "staleness/mean",
    "staleness_max": "staleness/max",
    "staleness_predicted": "staleness/predicted",
    "admitted": "staleness/groups/admitted",
    "consumed": "staleness/groups/consumed",
    "filtered": "staleness/groups/filtered",
    "dropped": "staleness/groups/dropped",
    "aborted": "staleness/groups/aborted",
    "in_flight": "staleness/groups/in_flight",
    "pending": "staleness/groups/pending",
    # the buffer's own counts in this process: the ledger's filtered/dropped above count the same groups, across
    # resumes too
    "filtered_groups": None,
    "dropped_groups": None,
    # system/: the run's own cost and health (MLflow's "System metrics" tab)
    "sync_s": "system/sync_s",
    "published_bytes": "system/published_bytes",  # one version's weights on the wire (with train.lora: the adapters)
    "control_share": "system/control_share",
    "driver_cpu_share": "system/driver_cpu_share",
    "steady_s": "system/steady_s",
    "ranks": "system/ranks",
    "nonfinite_steps": "system/nonfinite_steps",
    "duplicate_rewards": "system/duplicate_rewards",
    "resume_restored_groups": "system/resume_restored_groups",
    "resume_regenerated_groups": "system/resume_regenerated_groups",
    "resume_dropped_groups": "system/resume_dropped_groups",
    # evaluation.py's own bookkeeping: how many held-out prompts and how long, beside the run's other costs
    "eval/prompts": "system/eval_prompts",
    "eval/seconds": "system/eval_s",
}

# counters: not logged while they are zero, then at every step from the first one on which they are not (a counter
# that stays zero is noise; one that moves is a curve). Also the diagnostics that are 0 by construction when their
# feature is off (kl without a reference model, the clip and importance fractions without off-policy correction).
SPARSE = frozenset({
    "reward_failed", "rerouted", "aborted_trajectories", "episodes", "episode_turns", "env_tokens", "env_wait_s",
    "coord_interrupted", "coord_rejected", "coord_resyncs", "dispatch_plans", "dispatch_long_groups",
    "dispatch_long_instances", "ranker_observed", "filtered", "dropped", "aborted", "nonfinite_steps",
    "duplicate_rewards", "resume_restored_groups", "resume_regenerated_groups", "resume_dropped_groups",
    "eval/reward_failed",
    "kl", "clip_frac", "importance_truncated_frac", "importance_masked_frac",
})

# per task type (metrics.py `task/<task>/<key>`): into the group of the same number for the whole batch
TASK_NAMES = {
    "reward_all_mean": "reward/{task}/mean",
    "reward_mean": "reward/{task}/mean_trained",
    "scored": "rollout/{task}/scored",
    "length_mean": "rollout/{task}/length_mean",
    "trained": "train/{task}/trajectories",
    "staleness_mean": "staleness/{task}/mean",
}

# the ledger's groups per state: the terminal states are the counts above (consumed, filtered, ...)
LEDGER_TERMINAL = {"trained", "filtered", "dropped", "aborted"}

GROUPS = ("reward", "train", "rollout", "staleness", "system", "eval")
OTHER = "other"  # the group of a bare key no entry names (a new metric someone has not placed yet)

_HIST = re.compile(r"staleness_hist_(\d+)")
_ENV_WAITING = re.compile(r"env_waiting_(.+)")


def mlflow_key(key: str, *, per_task: bool = True) -> str | None:
    """The MLflow name of row key `key`; None where it is not logged. per_task False: a run of one task type,
    whose `task/<task>/...` numbers are the whole batch's."""
    if key in NAMES:
        return NAMES[key]
    if key.startswith("task/"):
        _, task, what = key.split("/", 2)
        if not per_task:
            return None
        return TASK_NAMES[what].format(task=task) if what in TASK_NAMES else key
    if m := _HIST.fullmatch(key):
        return f"staleness/hist/{m[1]}"
    if key.startswith("ledger_"):
        state = key.removeprefix("ledger_")
        return None if state in LEDGER_TERMINAL else f"staleness/ledger/{state}"
    if m := _ENV_WAITING.fullmatch(key):  # episodes waiting on an environment, per rollout stage and instance
        return f"rollout/env/waiting_{m[1]}"
    if "/" in key:  # already grouped (eval/...)
        return key
    return f"{OTHER}/{key}"


def sparse(key: str) -> bool:
    """Whether row key `key` is held back while it is zero (a counter)."""
    return key in SPARSE or key.startswith("env_waiting_")


def startup_tag(key: str) -> str | None:
    """The tag a start-up time (`startup/<mark>_s`, logged once) becomes: one number per run is a tag, not a
    one-bar chart. None for any other key."""
    return "startup." + key.removeprefix("startup/") if key.startswith("startup/") else None
