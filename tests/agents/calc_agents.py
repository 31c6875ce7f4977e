"""Agents for the endpoint's tests: the shipped calculator agent streamed, and agents that fail in each way issue 48
names (raise, hang, malformed request, rewritten history)."""

from __future__ import annotations

import asyncio

import openai

from rlflow.stages.openai_calc_agent import calc_agent


async def calc_agent_streamed(row: dict, base_url: str, episode_id: str) -> dict:
    return await calc_agent(row, base_url, episode_id, stream=True)


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
