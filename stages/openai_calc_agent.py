"""An agent written against the plain `openai` client, as a user writes one (pipelines/agentic_openai.yaml, issue 48):
it asks the model with the calculator offered as a tool, runs each call the model makes, sends the results back, and
returns the final answer. rlflow serves the model behind an OpenAI-compatible endpoint (runtime/agent_gateway.py); the
agent knows nothing of rlflow but the base_url it is given.

    python -m rlflow.stages.openai_calc_agent      # as a command: RLFLOW_TASK / OPENAI_BASE_URL from the environment
"""

from __future__ import annotations

import asyncio
import json
import ssl

import openai

from rlflow.stages.tools import calculator

# the calculator's schema as a user's agent states it (the same words the tiny model was taught with,
# tests/tool_model.py: a tiny model calls only on the prompt it learned)
CALCULATOR = {"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression (numbers, + - * / // %, parentheses) and return its value.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string",
                                                                   "description": "the expression, e.g. 37+48"}},
                   "required": ["expression"]}}}


async def _create(client, stream: bool, **kw) -> dict:
    """One chat completion as a dict (streamed: the chunks put back together, rlflow's extra fields kept)."""
    if not stream:
        return (await client.chat.completions.create(**kw)).model_dump()
    content, calls, out = "", [], {}
    async for chunk in await client.chat.completions.create(stream=True, **kw):
        c = chunk.model_dump()
        choice = c["choices"][0]
        content += choice["delta"].get("content") or ""
        calls += choice["delta"].get("tool_calls") or []
        for k in ("prompt_token_ids", "rlflow"):
            out[k] = out.get(k) or c.get(k)
        for k in ("token_ids", "token_logprobs", "logprobs"):
            out[k] = out.get(k) or choice.get(k)
        out["finish_reason"] = choice.get("finish_reason") or out.get("finish_reason")
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
    return {"choices": [{"message": message, "token_ids": out["token_ids"], "token_logprobs": out["token_logprobs"],
                         "logprobs": out["logprobs"], "finish_reason": out["finish_reason"]}],
            "prompt_token_ids": out["prompt_token_ids"], "rlflow": out["rlflow"]}


# made once per process: building an SSL context is most of what a new client costs (~18 ms of CPU with httpx's
# default verify=True), and the endpoint is plain http, so every episode's client may share one
_TLS = ssl.create_default_context()


def episode_client(base_url: str) -> openai.AsyncOpenAI:
    """A client of the episode's own, on its own connection pool (~0.1 ms). Not one client shared by every episode
    (`with_options` keeps its pool): httpx scans all of a pool's connections on each request and response, for
    expiry and for the idle count, so with the episodes of a run on one loop each request cost O(episodes)
    syscalls and O(episodes^2) steps, most of the endpoint's CPU."""
    http = openai.DefaultAsyncHttpxClient(verify=_TLS)
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=http)


async def calc_agent(row: dict, base_url: str, episode_id: str, stream: bool = False, logprobs: bool = False) -> dict:
    """Ask, run the calculator for each call the model makes, send the results back, up to 3 requests. `logprobs`:
    ask for OpenAI's logprobs object too (every response carries the sampled ids' log-probs as `token_logprobs`)."""
    async with episode_client(base_url) as client:  # closes its connection when the episode's agent returns
        return await _solve(client, row, base_url, stream, logprobs)


async def _solve(client: openai.AsyncOpenAI, row: dict, base_url: str, stream: bool, logprobs: bool = False) -> dict:
    messages = [{"role": "user", "content": row["prompt"]}]
    responses = []
    for _ in range(3):
        r = await _create(client, stream, model="policy", messages=messages, tools=[CALCULATOR],
                          **({"logprobs": True} if logprobs else {}))
        responses.append(r)
        msg = r["choices"][0]["message"]
        messages.append({k: v for k, v in msg.items() if v is not None})
        if not msg.get("tool_calls"):
            break
        for call in msg["tool_calls"]:
            try:
                # the calculator runs in a sandboxed process: off the event loop, which every episode's agent shares
                result = await asyncio.to_thread(calculator, json.loads(call["function"]["arguments"])["expression"])
            except (KeyError, ValueError) as e:
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return {"answer": messages[-1].get("content"), "responses": responses, "base_url": base_url}


async def calc_agent_streamed(row: dict, base_url: str, episode_id: str) -> dict:
    return await calc_agent(row, base_url, episode_id, stream=True)


def main() -> None:
    """The calculator agent as a command (agent: {command: [python, -m, rlflow.stages.openai_calc_agent]})."""
    import os

    row = json.loads(os.environ["RLFLOW_TASK"])
    result = asyncio.run(calc_agent(row, os.environ["OPENAI_BASE_URL"], os.environ["RLFLOW_EPISODE_ID"]))
    print(json.dumps({"answer": result["answer"], "turns": len(result["responses"])}))


if __name__ == "__main__":
    main()
