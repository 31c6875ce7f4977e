"""Agents for the endpoint's tests: the shipped calculator agent streamed, one on the completions API, and agents that
fail in each way issue 48 names (raise, hang, malformed request, rewritten history)."""

from __future__ import annotations

import asyncio

import openai

from rlflow.stages.openai_calc_agent import calc_agent


async def calc_agent_streamed(row: dict, base_url: str, episode_id: str) -> dict:
    return await calc_agent(row, base_url, episode_id, stream=True, logprobs=True)  # and OpenAI's logprobs object


async def completions_agent(row: dict, base_url: str, episode_id: str, stream: bool = False) -> dict:
    """Two requests on /v1/completions, the second the first's prompt and completion and a line of text after (the
    way a completions agent appends an observation; one when the first spent the episode's tokens); asks for the logprobs
    object (a count, as that API takes)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    prompt, responses = row["prompt"], []
    for _ in range(2):
        try:
            r = await client.completions.create(model="policy", prompt=prompt, logprobs=1, stream=stream)
        except openai.BadRequestError as e:
            if "agent-budget-spent" not in str(e):
                raise
            break  # the first turn spent the episode's tokens: the episode ends with one
        if stream:
            chunks = [c.model_dump() async for c in r]
            first = chunks[0]
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            r = {**first, "choices": [{**first["choices"][0], "text": text}]}
        else:
            r = r.model_dump()
        responses.append(r)
        prompt += r["choices"][0]["text"] + "\nResult: 4\n"
    return {"responses": responses, "base_url": base_url}


async def completions_agent_streamed(row: dict, base_url: str, episode_id: str) -> dict:
    return await completions_agent(row, base_url, episode_id, stream=True)


async def raising_agent(row: dict, base_url: str, episode_id: str):
    raise RuntimeError("the agent's own bug")


async def hanging_agent(row: dict, base_url: str, episode_id: str):
    await asyncio.sleep(3600)


async def malformed_agent(row: dict, base_url: str, episode_id: str):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}], n=2)


async def rewriting_agent(row: dict, base_url: str, episode_id: str):
    """Edits its history after the first answer (drops the assistant's turn): refused, it raises the 400."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    await client.chat.completions.create(model="policy", messages=messages)
    await client.chat.completions.create(model="policy", messages=messages + [{"role": "user", "content": "again"}])
