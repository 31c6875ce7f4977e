"""Chat-form tool calling (rlflow/runtime/chat_episodes.py, through runtime/episodes.py) on real engines, hf and
vllm: the trained token ids are exactly the generated ones, turn by turn. A tiny model is first taught the Hermes
format (tests/tool_model.py: a few seconds of supervised steps; the template is its tokenizer's own), so its episodes
call the tool; the test records what the engine hands back at
the end of every turn and compares it with the trajectory's segments of loss mask 1, and checks the segments of mask
0 are the chat template's tokens for the tool messages (stages/chat_template.py), the prompt the template's too."""

from __future__ import annotations

from collections import defaultdict

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine_helpers import trajectories  # noqa: E402
from test_episodes import run_episodes  # noqa: E402
from tool_model import TOOLS, teach_tool_format  # noqa: E402

from rlflow.runtime.episodes import episodes_for  # noqa: E402
from rlflow.stages import tasks  # noqa: E402
from rlflow.stages.chat_template import TINY_TOOL_TEMPLATE, ChatRenderer  # noqa: E402
from rlflow.stages.tools import ToolBox, load_tools  # noqa: E402

MAX_NEW, MAX_LEN, TEMPERATURE = 128, 384, 0.6
EPISODE = {"env": None, "tools": TOOLS, "tool_parser": "hermes", "max_turns": 3, "chat_template": None}  # its own


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    """The calc tiny model taught the Hermes format (tests/tool_model.py), and the renderer of its conversations."""
    model_dir = teach_tool_format(tmp_path_factory.mktemp("tool-model"))
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    return str(model_dir), ChatRenderer(tok, load_tools(TOOLS)[0], TINY_TOOL_TEMPLATE)


def make_engine(name: str, model_dir: str):
    if name == "hf":
        from rlflow.stages.engine_hf import HFEngine

        return HFEngine(model_dir, max_running=4, max_new_tokens=MAX_NEW, temperature=TEMPERATURE, seed=1, max_model_len=MAX_LEN)
    pytest.importorskip("vllm")
    from rlflow.stages.engine_vllm import VLLMEngine

    return VLLMEngine(model_dir, max_running=4, max_new_tokens=MAX_NEW, temperature=TEMPERATURE, seed=1, max_model_len=MAX_LEN)


def run(engine, episodes, batch):
    """The rollout worker's loop in-process (test_episodes.run_episodes); returns the finished episodes and, per
    trajectory, the ids the engine handed back at the end of each turn (recorded before the episode code sees them)."""
    turns, step = defaultdict(list), engine.step

    def recording_step():
        finished = step()
        for t in finished:
            turns[t.traj_id].append(list(t.completion_ids[t.turn_start:]))
        return finished

    engine.step = recording_step
    return run_episodes(engine, episodes, batch, limit=2000), turns


def runs(mask: list[int], value: int) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of `value` in the mask."""
    out, start = [], None
    for i, m in enumerate([*mask, None]):
        if m == value and start is None:
            start = i
        elif m != value and start is not None:
            out.append((start, i))
            start = None
    return out


@pytest.mark.parametrize("engine_name", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_trained_ids_are_the_generated_ids_turn_by_turn(engine_name, tool_model):
    model_dir, renderer = tool_model
    engine = make_engine(engine_name, model_dir)
    tok = renderer.tokenizer
    try:
        episodes = episodes_for(EPISODE, model_dir, {"max_new_tokens": MAX_NEW, "max_running": 4})
        batch = trajectories(tok, tasks.calc(77, 8), group=engine_name)
        done, turns = run(engine, episodes, batch)
    finally:
        if hasattr(engine, "close"):
            engine.close()
    assert len(done) == len(batch)
    called = [t for t in done if len(t.turn_starts) > 1]
    assert len(called) >= len(batch) // 2, [t.completion for t in done]  # the taught format: most episodes call
    box = ToolBox(TOOLS, "hermes")
    for t in done:
        assert t.prompt_ids == renderer.prompt_ids(t.prompt)  # the conversation starts in the template
        n = len(t.completion_ids)
        assert len(t.loss_mask) == len(t.behaviour_logprobs) == n
        generated = [t.completion_ids[a:b] for a, b in runs(t.loss_mask, 1)]
        assert generated == turns[t.traj_id]  # exactly what the engine generated, turn by turn, nothing re-tokenised
        assert [a for a, _ in runs(t.loss_mask, 1)] == t.turn_starts
        for (a, b), turn in zip(runs(t.loss_mask, 0), turns[t.traj_id]):
            messages = box.step(tok.decode(turn, skip_special_tokens=True)).observation
            expected = renderer.observation_ids(turn, messages)  # the template's tokens (cut where the budget ends)
            assert t.completion_ids[a:b] == (expected if b < n else expected[:b - a])
            assert all(lp == 0.0 for lp in t.behaviour_logprobs[a:b])
    assert any("tool\n" in t.completion and "A=" in t.completion for t in called)  # the transcript: call, result, answer
