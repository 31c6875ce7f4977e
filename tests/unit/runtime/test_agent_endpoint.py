"""Agents through the OpenAI-compatible endpoint (issue 48: rlflow/runtime/agent_gateway.py, agent_episodes.py), on
a real engine with the real `openai` client: an agent written as a user writes it (tests/agents/calc_agents.py) drives
episodes of a tiny model taught the Hermes tool format (tests/tool_model.py), streamed and not; the trained ids are
exactly the ids each response carried, turn by turn, each response names the versions that generated it, and the
agent's own failures fail its trajectory by name. The rollout worker's loop runs in-process (no Ray: the hub runs on
its own event loop in a thread, LoopHub, as the Ray actor runs it in its process)."""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from engine_helpers import trajectories  # noqa: E402
from test_chat_episodes import make_engine, runs  # noqa: E402
from test_episodes import run_episodes  # noqa: E402
from tool_model import teach_tool_format  # noqa: E402

from rlflow.runtime.agent_episodes import AgentForm  # noqa: E402
from rlflow.runtime.agent_gateway import LoopHub  # noqa: E402
from rlflow.runtime.episodes import Episodes  # noqa: E402
from rlflow.stages import tasks  # noqa: E402

MAX_NEW = 128


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(teach_tool_format(tmp_path_factory.mktemp("tool-model")))


def roll_out(engine_name: str, model_dir: str, agent: dict, n: int = 6, max_turns: int = 3, keep=None):
    """n episodes of `agent` on a fresh engine: the finished trajectories (by id) and the hub's URL. keep: a list to
    put the hub in, left open (else it is closed)."""
    engine = make_engine(engine_name, model_dir)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    hub = LoopHub({"timeout_s": 60, **agent})
    try:
        form = AgentForm({"tool_parser": "hermes", "max_turns": max_turns, "timeout_s": agent.get("timeout_s", 60)},
                         tok, hub, MAX_NEW)
        episodes = Episodes(None, {}, max_turns=max_turns, tokenizer=tok, max_new_tokens=MAX_NEW, stop=(), form=form)
        batch = trajectories(tok, tasks.calc(31, n), group=engine_name)
        done = run_episodes(engine, episodes, batch, limit=4000)
    finally:
        if keep is None:
            hub.close()
        else:
            keep.append(hub)
        if hasattr(engine, "close"):
            engine.close()
    assert len(done) == n
    return {t.traj_id: t for t in done}, hub.url


@pytest.mark.parametrize("engine_name,agent", [
    ("hf", "rlflow.stages.openai_calc_agent:calc_agent"),
    ("hf", "agents.calc_agents:calc_agent_streamed"),
    ("hf", "agents.calc_agents:completions_agent"),
    ("hf", "agents.calc_agents:completions_agent_streamed"),
    pytest.param("vllm", "rlflow.stages.openai_calc_agent:calc_agent", marks=pytest.mark.vllm),
    pytest.param("vllm", "agents.calc_agents:calc_agent_streamed", marks=pytest.mark.vllm),
])
def test_the_trained_ids_are_the_ids_each_response_carried(engine_name, agent, model_dir):
    import json

    done, _ = roll_out(engine_name, model_dir, {"fn": agent})
    called = 0
    for t in done.values():
        assert not t.rollout_error, t.rollout_error
        result = json.loads(t.agent_result)
        responses = result["responses"]
        generated = [t.completion_ids[a:b] for a, b in runs(t.loss_mask, 1)]
        assert generated == [r["choices"][0]["token_ids"] for r in responses]  # turn by turn, as sampled
        assert [a for a, _ in runs(t.loss_mask, 1)] == t.turn_starts
        asked = "completions" in agent or agent.endswith("_streamed")  # these ask for OpenAI's logprobs object
        for r, (start, end) in zip(responses, runs(t.loss_mask, 1)):  # what the model saw: its ids up to the turn
            assert r["prompt_token_ids"] == t.prompt_ids + t.completion_ids[:start]
            choice = r["choices"][0]
            assert choice["token_logprobs"] == t.behaviour_logprobs[start:end]  # what the trainer corrects against
            assert (choice["logprobs"] is not None) == asked
            if asked and "completions" in agent:
                assert choice["logprobs"]["token_logprobs"] == choice["token_logprobs"]
            elif asked:
                assert [c["logprob"] for c in choice["logprobs"]["content"]] == choice["token_logprobs"]
            assert r["rlflow"]["versions"] == [t.version]  # the version that generated it, named
            assert r["rlflow"]["episode_id"] in result["base_url"]
        n = len(t.completion_ids)
        assert len(t.loss_mask) == len(t.behaviour_logprobs) == n
        assert all(lp == 0.0 for lp, m in zip(t.behaviour_logprobs, t.loss_mask) if not m)  # tool results: not sampled
        called += len(responses) > 1
    # the taught format: most episodes call the calculator and get its result back; a completions agent asks twice
    # unless its first turn (the chat-taught model on a raw prompt) spent the episode's tokens
    assert called >= (1 if "completions" in agent else len(done) // 2)


def test_a_command_agent_rolls_out_and_its_result_is_its_last_line(model_dir):
    import json
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[3] / "stages" / "openai_calc_agent.py"
    done, _ = roll_out("hf", model_dir, {"command": [sys.executable, str(script)]}, n=2)
    for t in done.values():
        assert not t.rollout_error, t.rollout_error
        assert json.loads(t.agent_result)["turns"] == len(t.turn_starts)


@pytest.mark.parametrize("agent,rule", [
    ({"fn": "agents.calc_agents:raising_agent"}, "agent-raised: RuntimeError: the agent's own bug"),
    ({"fn": "agents.calc_agents:hanging_agent", "timeout_s": 1}, "agent-timeout"),
    ({"fn": "agents.calc_agents:malformed_agent"}, "agent-malformed-request"),
    ({"fn": "agents.calc_agents:rewriting_agent"}, "agent-history-rewritten"),
])
def test_an_agent_that_fails_fails_its_trajectory_by_name(agent, rule, model_dir):
    done, _ = roll_out("hf", model_dir, agent, n=2)
    for t in done.values():
        assert rule in t.rollout_error and not t.agent_result
        assert t.finish_reason in ("stop", "length") and len(t.loss_mask) == len(t.completion_ids)


def test_a_call_after_the_episode_ended_is_refused_by_name(model_dir):
    import json

    hubs = []
    done, _ = roll_out("hf", model_dir, {"fn": "rlflow.stages.openai_calc_agent:calc_agent"}, n=1, keep=hubs)
    (t,) = done.values()
    try:
        async def late():  # the agent's client, used again after its episode ended
            client = openai.AsyncOpenAI(base_url=json.loads(t.agent_result)["base_url"], api_key="unused", max_retries=0)
            await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "1+1="}])

        with pytest.raises(openai.NotFoundError, match="agent-episode-ended"):
            asyncio.run(late())
    finally:
        hubs[0].close()
