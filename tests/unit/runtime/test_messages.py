"""The runtime's hop messages (rlflow/runtime/messages.py): the ledger's JSON of a prompt, and cheap pickles."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest

from rlflow.runtime.ledger import Ledger
from rlflow.runtime.messages import FinishedMeta, Prompt, ScoredBatch, ScoredTrajectory, StepReport, TrainBatch


def test_a_prompt_keeps_the_ledger_json_it_had_as_a_dict():
    p = Prompt(task="t", n=3, prompt="1+1=", answer="2", prompt_ids=[5, 6], row={"q": "1+1=", "id": 9})
    as_dict_before = {"task": "t", "n": 3, "prompt": "1+1=", "answer": "2", "prompt_ids": [5, 6], "row": {"q": "1+1=", "id": 9}}
    assert json.dumps(p.to_json()) == json.dumps(as_dict_before)  # same keys, same order: old ledgers resume
    assert Prompt.from_json(as_dict_before) == p and p.group_id == "t-3"


def test_the_ledger_gives_back_the_prompt_it_was_given(tmp_path):
    led = Ledger(tmp_path, eta=None, fresh=True)
    p = Prompt(task="t", n=0, prompt="p", answer="a", prompt_ids=[1], row={"k": 0})
    led.drawn(p.group_id, p)
    led.flush()
    assert Ledger(tmp_path, eta=None, fresh=False).resume(0).replay == [p]


def test_a_scored_batch_is_the_reward_streams_columns_row_by_row():
    columns = {"group_id": ["g", "g"], "traj_id": ["g/0", "g/1"], "task": ["t", "t"], "reward": [1.0, float("nan")],
               "reward_error": ["", "boom"], "kept": [True, True]}
    batch = ScoredBatch.from_columns(columns)
    assert [r.traj_id for r in batch.rows] == ["g/0", "g/1"] and batch.group_ids() == {"g"}
    assert batch.rows[1].reward_error == "boom" and batch.rows[0].v_min is None  # no version span carried
    spans = ScoredBatch.from_columns(columns | {"v_min": [0, 1], "v_max": [2, 1]})
    assert [(r.v_min, r.v_max) for r in spans.rows] == [(0, 2), (1, 1)]


@pytest.mark.parametrize("message", [
    Prompt("t", 0, "p"),
    ScoredBatch([ScoredTrajectory("g/0", "g", "t", 1.0, "", True, 0, 1)]),
    StepReport(0, [FinishedMeta("t-0", 1, 2, "stop", 7)], [], {"version": 2}, 0.1, 0.0, True),
    TrainBatch(None, {"t-0/0": 1.0}, {"t-0": ["t-0/0"]}),
])
def test_messages_are_frozen_slotted_and_pickle(message):
    assert not hasattr(message, "__dict__")  # slots: no per-object dict to pickle
    assert pickle.loads(pickle.dumps(message)) == message
    with pytest.raises(dataclasses.FrozenInstanceError):
        message.__setattr__(dataclasses.fields(message)[0].name, None)
