"""The environment interface of multi-turn rollouts: what a rollout stage's `env:` names.

An episode alternates turns of generation with environment steps. The rollout worker
(rlflow/runtime/episodes.py) makes one instance per trajectory, `env_cls(**env_kwargs)`, and calls:

- `reset(row)` once, before the first turn: its text (often "") is appended after the prompt as an
  environment segment (tokens not trained, loss mask 0);
- `step(action)` after every turn that ends at one of the stage's stop strings (a tool call): `action` is
  the text generated in that turn, the stop string included. It returns the observation to append (an
  environment segment), a reward, and whether the episode is over.

The episode ends when a turn ends any other way (eos, the token budget), when `step` says done, or after
`max_turns` turns. Then the reward stage scores the whole completion (the transcript: turns and observations)
as for single-turn rollouts; the environment's rewards are summed on the trajectory (`env_reward`), which the
reward stage does not see yet.

Calls run on a thread pool in the rollout worker, so the instance keeps generating other trajectories
while environments work; an instance is used by one thread at a time. An episode can move between rollout
instances between turns (migration, interruption at a weight sync): the instance is pickled into the
trajectory then, so environments must be picklable (plain attributes, no open handles between calls).
"""

from __future__ import annotations

import abc
from typing import NamedTuple


class EnvStep(NamedTuple):
    observation: str  # appended after the action (not trained); ignored when done (chat form: tool messages)
    reward: float = 0.0
    done: bool = False


class Environment(abc.ABC):
    """One episode's environment; subclasses implement `step` and may override `reset`."""

    def reset(self, row: dict) -> str:
        """Start the episode for a data row (its original columns); returns text to append before turn 1."""
        return ""

    @abc.abstractmethod
    def step(self, action: str) -> EnvStep:
        """React to one turn's text (ending in the tool-call stop string); must not raise for bad actions:
        report them in the observation, so the policy learns from them."""
