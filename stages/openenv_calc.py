"""A tiny OpenEnv environment, for `pipelines/openenv_calc.yaml` and its test: the calculator of `env: calculator`
written as an OpenEnv server-side Environment (typed Action / Observation / State, a Rubric for the reward).

The model writes `<calc>37+48</calc>`; the observation's `result` is `=85`. A turn that gives the final answer
(`A=85`) ends the episode, scored by the rubric: 1.0 when the number after the last `A=` is the row's answer (passed
to reset). The pipeline runs it through the `openenv:` adapter (stages/env_openenv.py) in-process, as it would run
one from the OpenEnv hub. Needs openenv-core (`pip install 'rlflow[ecosystem]'`).
"""

from __future__ import annotations

import re
import uuid

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from openenv.core.rubrics.base import Rubric

from rlflow.stages.env_calculator import CALL, calculate

TAGGED = re.compile(r"A=\s*(-?\d+(?:\.\d+)?)")


class CalcAction(Action):
    text: str
    """The model's turn: a `<calc>EXPR</calc>` call, or the answer `A=N`."""


class CalcObservation(Observation):
    result: str = ""
    """What the calculator printed (`=85`), or "" once the answer is given."""


class AnswerRubric(Rubric):
    """1.0 when the number after the action's last `A=` equals the expected answer, else 0.0."""

    def __init__(self):
        super().__init__()
        self.expected: str | None = None

    def forward(self, action: CalcAction, observation: CalcObservation) -> float:
        found = TAGGED.findall(action.text)
        return 1.0 if found and self.expected is not None and float(found[-1]) == float(self.expected) else 0.0


class CalcEnv(Environment[CalcAction, CalcObservation, State]):
    """Evaluates `<calc>EXPR</calc>` (the sandboxed calculator of env_calculator.py); the answer ends the episode."""

    def __init__(self):
        super().__init__(rubric=AnswerRubric())
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, answer: str | None = None,
              **kwargs) -> CalcObservation:
        self._reset_rubric()
        self.rubric.expected = answer
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        return CalcObservation()

    def step(self, action: CalcAction, timeout_s: float | None = None, **kwargs) -> CalcObservation:
        self._state.step_count += 1
        if TAGGED.search(action.text):
            observation = CalcObservation(done=True)
            observation.reward = self._apply_rubric(action, observation)
            return observation
        calls = CALL.findall(action.text)
        return CalcObservation(result="=" + (calculate(calls[-1]) if calls else "error: no <calc>...</calc>"), reward=0.0)

    @property
    def state(self) -> State:
        return self._state
