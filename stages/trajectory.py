"""What flows from rollout to reward to buffer to train: one sampled completion and its metadata.

Plain data (lists, not tensors) so it crosses Ray's object store and Ray Data blocks cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


def member_id(group_id: str, index: int) -> str:
    """A trajectory's id: its group and its index in the group (one format across the runtime)."""
    return f"{group_id}/{index}"

@dataclass
class Trajectory:
    """One completion of one prompt; `group_id` ties the group_size samples of a prompt together."""

    group_id: str  # the group (prompt) this sample belongs to
    index: int  # member index within the group, 0..group_size(+redundancy)-1
    prompt: str
    answer: str  # reference answer for the reward function
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    behaviour_logprobs: list[float] = field(default_factory=list)  # log pi_behaviour(token), one per completion token
    version: int = 0  # V_traj: oldest weights version that generated any of its tokens
    versions_seen: list[int] = field(default_factory=list)  # every version that produced a segment (partial rollout)
    finish_reason: str = ""  # "stop" | "length" | "abort" | "interrupt"
    completion: str = ""  # decoded completion text
    reward: float | None = None
    reward_error: str | None = None  # set when the reward function raised; the trajectory is then failed
    instance: int | None = None  # rollout instance that finished it
    task: str = "main"  # the task type (plan["tasks"]): picks the rollout and reward stages
    row: dict = field(default_factory=dict)  # the whole data row (its original columns), for reward functions
    # Multi-turn episodes (stages/environment.py, rlflow/runtime/episodes.py); all empty for single-turn ones.
    # completion_ids then interleaves generated turns with environment segments (observations).
    loss_mask: list[int] = field(default_factory=list)  # per completion token: 1 generated (trained), 0 environment; empty = all 1
    turn_starts: list[int] = field(default_factory=list)  # offset in completion_ids where each generated turn began
    env_state: str = ""  # the episode's environment, pickled, while the trajectory is between instances mid-episode
    env_reward: float = 0.0  # sum of the environment's step rewards
    env_s: float = 0.0  # seconds the episode waited on its environment
    # Agent episodes (rlflow/runtime/agent_episodes.py): the agent's return value as JSON (the reward function's
    # row["agent"]), or why its rollout failed by name (the trajectory is then failed, never trained)
    agent_result: str = ""
    rollout_error: str = ""

    @property
    def turn_start(self) -> int:
        """Offset of the turn being generated: stop strings and per-turn budgets count from here."""
        return self.turn_starts[-1] if self.turn_starts else 0

    def trained_mask(self) -> list[int]:
        """One 0/1 per completion token: whether the trainer learns from it."""
        return list(self.loss_mask) if self.loss_mask else [1] * len(self.completion_ids)

    @property
    def traj_id(self) -> str:
        return member_id(self.group_id, self.index)

    def version_span(self) -> tuple[int, int]:
        """(v_min, v_max): its V_traj and every version that produced a segment (partial rollout)."""
        versions = [self.version, *self.versions_seen]
        return min(versions), max(versions)

    def as_dict(self) -> dict:
        """Its fields as a dict, lists and the row copied one level (dataclasses.asdict copies recursively, element by
        element: 1.3 ms a group of 8 in the driver's ledger write, on every step's critical path)."""
        return {f.name: _copy(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, row: dict) -> Trajectory:
        return cls(**{k: row[k] for k in cls.__dataclass_fields__ if k in row})


def _copy(value):
    return list(value) if isinstance(value, list) else dict(value) if isinstance(value, dict) else value
