"""Chat-form multi-turn episodes (a rollout stage with `tools:`): what runtime/episodes.py's Episodes does
differently when the conversation is the model's chat template instead of raw text.

- The prompt is rendered by the chat template with the tools' schemas (and the task's system prompt), replacing
  the raw prompt ids when the episode begins (a pure function of the prompt text: a trajectory re-sent fresh gets
  the same ids).
- A turn is a tool call when the stage's `tool_parser` finds a call in it (a malformed one counts: its tool message
  says what was wrong); stop strings play no part, the turn ends at the model's end-of-turn token.
- The calls run on the episode thread pool (stages/tools.py ToolBox), and their `tool` messages come back as the
  template's token ids (stages/chat_template.py: a delta on a fixed conversation), appended with loss mask 0. The
  generated ids are never re-tokenised, so the trainer scores exactly the tokens the engine sampled.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from rlflow.stages.chat_template import ChatRenderer
from rlflow.stages.environment import EnvStep
from rlflow.stages.tool_parsers import parse
from rlflow.stages.tools import ToolBox, load_tools
from rlflow.stages.trajectory import Trajectory


class ChatForm:
    """`episode`: the plan entry (plan.py `_episode`): tools, tool_parser, max_turns, chat_template (None: the
    tokenizer's own), system_prompts (task -> system prompt)."""

    env_cls = ToolBox

    def __init__(self, episode: dict, tokenizer):
        self.parser = episode["tool_parser"]
        self.env_kwargs = {"tools": episode["tools"], "parser": self.parser}
        self.system_prompts = dict(episode.get("system_prompts") or {})
        self.renderer = ChatRenderer(tokenizer, load_tools(episode["tools"])[0], episode.get("chat_template"))

    def begin(self, traj: Trajectory) -> None:
        """A fresh episode: its conversation starts in the template."""
        traj.prompt_ids = self.prompt_ids(traj.task, traj.prompt)

    def prompt_ids(self, task: str, prompt: str) -> list[int]:
        """`prompt` in the template for a trajectory of `task`: its system prompt, the tools block, the user turn."""
        return self.renderer.prompt_ids(prompt, self.system_prompts.get(task))

    def is_call(self, traj: Trajectory, action: str) -> bool:
        return traj.finish_reason == "stop" and bool(parse(self.parser, action))

    def step(self, env: ToolBox, action: str, turn_ids: list[int]) -> EnvStep:
        """Run the turn's calls; the observation is the template's ids for their tool messages."""
        result = env.step(action)
        if result.done:
            return result
        return EnvStep(self.renderer.observation_ids(turn_ids, result.observation), result.reward, False)


def prompt_measures(plan, tokenizer) -> dict[str, Callable[[str], int]]:
    """Each task served by a stage with tools -> the length of a prompt as that stage renders it (template, tools
    block, the task's system prompt): what the driver's prompt-length checks measure for those tasks, since the raw
    prompt they encode is not what the engine gets (runtime/prompt_source.py)."""
    out = {}
    for stage in plan.rollout_stages():
        first = plan.rollouts(stage)[0]
        if first.episode and first.episode.get("tools"):
            form = ChatForm(first.episode, tokenizer)
            out |= {task: functools.partial(_length, form, task) for task in first.tasks}
    return out


def _length(form: ChatForm, task: str, prompt: str) -> int:
    return len(form.prompt_ids(task, prompt))
