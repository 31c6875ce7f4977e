"""Agent episodes inside a rollout instance (a rollout stage with `agent:`): what runtime/episodes.py's Episodes does
when the conversation is driven by an agent program through the OpenAI-compatible endpoint (runtime/agent_gateway.py).

- The episode begins when its agent's first request arrives, not when the trajectory is routed: the request's
  messages (or prompt), rendered by the stage's chat template with the tools the request names, become the
  trajectory's prompt ids. Until then the trajectory waits here like one on its environment.
- Every generated turn goes back to the agent as the answer to its request: the text, tool calls found by the stage's
  `tool_parser`, and beside the OpenAI fields the prompt and completion token ids, their log-probs and the weight
  versions that generated them. The agent's next request brings the new tool / user messages, appended as the
  template's token ids after the generated ones (stages/chat_template.py: a delta on a fixed conversation) with loss
  mask 0: generated ids are never re-tokenised, so the trainer scores exactly what was sampled.
- The episode ends when the agent returns (its result goes to the reward function as row["agent"]), raises or runs
  past its timeout (the trajectory fails by name: rollout_error), or the token budget (max_new_tokens) or max_turns
  is spent (its next request is refused with agent-budget-spent; the agent's return still ends the episode).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from rlflow.stages.chat_template import ChatRenderer, TemplateError
from rlflow.stages.environment import EnvStep
from rlflow.stages.tool_parsers import content, parse
from rlflow.stages.trajectory import Trajectory

EVENT_POLL_S = 20.0  # one wait on the hub for the agent's next event; asked again until the agent's own timeout


@dataclass
class AgentLink:
    """An episode's place in the endpoint's protocol; plain data, so it travels with the trajectory (env_state)."""

    eid: str
    row: dict
    seq: int = 0  # the next event to ask the hub for
    kind: str = ""  # "chat" or "completion", from the first request
    tools: list = field(default_factory=list)  # the tool schemas of the first request (the template renders them)
    turns: int = 0  # turns answered
    versions_at: int = 0  # len(versions_seen) when the turn began: the versions that generated it are after
    logprobs: bool = False  # the request being answered asked for OpenAI's logprobs object


def episode_id(traj: Trajectory) -> str:
    """The episode's id in URLs: the trajectory's (group/index), with a character a URL path keeps."""
    return traj.traj_id.replace("/", "~")


class AgentForm:
    """`episode`: the plan entry (plan.py `_episode`): agent, tool_parser, chat_template, max_turns, timeout_s,
    model_name. `client`: the hub (agent_gateway.GatewayClient, or LoopHub in tests)."""

    deferred = True  # the trajectory starts on the engine when its agent's first request came, not when routed

    def __init__(self, episode: dict, tokenizer, client, max_new_tokens: int):
        self.tokenizer, self.client, self.max_new_tokens = tokenizer, client, max_new_tokens
        self.parser = episode.get("tool_parser")
        self.template = episode.get("chat_template")
        self.max_turns = episode["max_turns"]
        self.timeout_s = float(episode.get("timeout_s", 600))
        self.model = episode.get("model_name", "rlflow-policy")
        self._renderers: dict[str, ChatRenderer] = {}

    # -- Episodes' hooks ------------------------------------------------------------------------------------------
    def link(self, traj: Trajectory) -> AgentLink:
        return AgentLink(episode_id(traj), dict(traj.row or {}) | {"prompt": traj.prompt, "answer": traj.answer})

    def first(self, link: AgentLink, traj: Trajectory) -> EnvStep:
        """On the episode thread: start the agent and wait for its first request, whose ids become the prompt."""
        event = self.client.begin_and_wait(link.eid, link.row, EVENT_POLL_S)
        return self._until_request(link, traj, None, event)

    def is_call(self, traj: Trajectory, action: str) -> bool:
        return True  # every turn is an answer the agent waits for; the agent ends the episode

    def step(self, link: AgentLink, action: str, turn_ids: list[int], traj: Trajectory) -> EnvStep:
        """On the episode thread: answer the agent's request with the turn, then wait for its next event."""
        answer = self.answer(link, traj, action, turn_ids)
        event = self.client.reply_and_wait(link.eid, link.seq - 1, answer, EVENT_POLL_S)
        link.turns += 1
        return self._until_request(link, traj, turn_ids, event)

    def close(self, link: AgentLink | None) -> None:
        if link is not None:
            self.client.end(link.eid)

    # -- the protocol ---------------------------------------------------------------------------------------------
    def _until_request(self, link: AgentLink, traj: Trajectory, turn_ids: list[int] | None, event: dict) -> EnvStep:
        """From `event` (the agent's next, as the call that started the episode or answered its request returned
        it): a request becomes the ids to generate after (first: the prompt, set on traj); the agent's end ends the
        episode. A request this episode cannot serve is refused to the agent (it may end, or ask otherwise)."""
        deadline = time.monotonic() + self.timeout_s + 60  # the hub ends a late agent itself, at timeout_s
        while True:
            kind = event["kind"]
            if kind == "wait":
                if time.monotonic() > deadline:
                    traj.rollout_error = f"agent-timeout: no event from the agent in {self.timeout_s + 60:.0f} s"
                    return EnvStep("", 0.0, True)
                event = self.client.next_event(link.eid, link.seq, EVENT_POLL_S)
                continue
            if kind == "done":
                traj.agent_result = json.dumps(event["result"], default=str)
                return EnvStep("", 0.0, True)
            if kind == "error":
                traj.rollout_error = f"{event['rule']}: {event['message']}"
                return EnvStep("", 0.0, True)
            link.seq = event["seq"] + 1
            link.logprobs = bool(event.get("logprobs"))
            try:
                ids = self._ids(link, event, turn_ids)
            except (TemplateError, ValueError) as e:
                event = self._refuse(link, 400, "agent-malformed-request", str(e))
                continue
            room = self.max_new_tokens - len(traj.completion_ids)
            if link.turns >= self.max_turns or (turn_ids is not None and len(ids) >= room):
                why = (f"max_turns={self.max_turns} turns answered" if link.turns >= self.max_turns
                       else f"the episode's token budget (max_new_tokens={self.max_new_tokens}) is spent")
                event = self._refuse(link, 400, "agent-budget-spent", why + ": return from the agent to end the episode")
                continue
            link.versions_at = len(traj.versions_seen)
            if turn_ids is None:
                traj.prompt_ids = ids
                return EnvStep([], 0.0, False)
            return EnvStep(ids, 0.0, False)

    def _refuse(self, link: AgentLink, status: int, rule: str, message: str) -> dict:
        """Refuse the request with an OpenAI error body; returns the agent's next event."""
        body = {"error": {"status": status, "rule": rule, "message": message}}
        return self.client.reply_and_wait(link.eid, link.seq - 1, body, EVENT_POLL_S)

    def _ids(self, link: AgentLink, event: dict, turn_ids: list[int] | None) -> list[int]:
        if turn_ids is None:
            link.kind = event["kind"]
            if link.kind == "completion":
                return list(self.tokenizer.encode(event["prompt"]))
            link.tools = list(event.get("tools") or [])
            return self._renderer(link).render(event["messages"], generation=True)
        if event["kind"] != link.kind:
            raise ValueError("an episode is chat or completions, not both")
        if link.kind == "completion":
            return list(self.tokenizer.encode(event["prompt"], add_special_tokens=False)) if event["prompt"] else []
        return self._renderer(link).observation_ids(turn_ids, event["messages"])

    def _renderer(self, link: AgentLink) -> ChatRenderer:
        key = json.dumps(link.tools, sort_keys=True)
        if key not in self._renderers:
            self._renderers[key] = ChatRenderer(self.tokenizer, link.tools, self.template)
        return self._renderers[key]

    def answer(self, link: AgentLink, traj: Trajectory, text: str, turn_ids: list[int]) -> dict:
        """The OpenAI response to the request the turn answers, with the ids, log-probs and versions behind it.
        The sampled ids and their log-probs are always there as two lists (`token_ids`, `token_logprobs`); OpenAI's
        `logprobs` object (a token string per id) only when the request asked for it, as OpenAI answers: building
        it decodes every token here, in the engine's process, and the client builds a model per token from it (the
        endpoint's CPU per episode 1.05-1.28x with it: benchmarks/results/agent_gateway.md)."""
        start = traj.turn_start
        logprobs = list(traj.behaviour_logprobs[start:start + len(turn_ids)])
        prompt_ids = [*traj.prompt_ids, *traj.completion_ids[:start]]
        versions = sorted(set(traj.versions_seen[link.versions_at:] or [traj.version]))
        tokens = [self.tokenizer.decode([t]) for t in turn_ids] if link.logprobs else []
        finish = "length" if traj.finish_reason == "length" else "stop"
        choice: dict = {"index": 0, "finish_reason": finish, "token_ids": list(turn_ids), "token_logprobs": logprobs,
                        "logprobs": None}
        if link.kind == "completion":
            choice["text"] = text
            if link.logprobs:
                choice["logprobs"] = {"tokens": tokens, "token_logprobs": logprobs}
            obj = "text_completion"
        else:
            calls = [c for c in parse(self.parser, text) if c.error is None] if self.parser and link.tools else []
            message = {"role": "assistant", "content": content(self.parser, text) if calls else text}
            if calls:
                message["tool_calls"] = [{"id": f"call_{link.eid}_{link.turns}_{i}", "type": "function",
                                          "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                         for i, c in enumerate(calls)]
                choice["finish_reason"] = "tool_calls"
            choice["message"] = message
            if link.logprobs:
                choice["logprobs"] = {"content": [{"token": tok, "logprob": lp, "bytes": None, "top_logprobs": []}
                                                  for tok, lp in zip(tokens, logprobs)]}
            obj = "chat.completion"
        return {"id": f"rlflow-{link.eid}-{link.turns}", "object": obj, "created": int(time.time()),
                "model": self.model, "choices": [choice], "prompt_token_ids": prompt_ids,
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(turn_ids),
                          "total_tokens": len(prompt_ids) + len(turn_ids)},
                "rlflow": {"episode_id": link.eid, "versions": versions, "turn": link.turns}}
