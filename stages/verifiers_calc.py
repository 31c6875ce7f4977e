"""A tiny `verifiers` environment, for `pipelines/verifiers_calc.yaml` and its test: the calculator word problems
(builtin:calc) as a verifiers v1 Taskset, scored by its Task's `@vf.reward` (the answer after the last `A=`); the
pipeline reads its tasks as prompts and scores with its rubric.

Written as any verifiers taskset is (verifiers.v1: TaskData, Task with @vf.reward, Taskset.load), so the pipeline
runs it through the `verifiers:` adapter (stages/env_verifiers.py) exactly as it would run one from the hub.
Needs the verifiers package (`pip install 'rlflow[ecosystem]'`).
"""

from __future__ import annotations

import re

import verifiers.v1 as vf

from rlflow.stages.tasks import calc

TAGGED = re.compile(r"A=\s*(-?\d+(?:\.\d+)?)")


class CalcData(vf.TaskData):
    answer: str
    """The number the problem asks for."""
    demo: str | None = None
    """A worked transcript using the calculator (`<calc>37+48</calc>=85 A=85`), for warm starts."""


class CalcTask(vf.Task[CalcData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        """1.0 when the number after the reply's last `A=` is the answer."""
        found = TAGGED.findall(trace.last_reply)
        return 1.0 if found and float(found[-1]) == float(self.data.answer) else 0.0


class CalcTaskset(vf.Taskset[CalcTask, vf.TasksetConfig]):
    def load(self):
        for row in calc(seed=0, count=64):
            yield CalcTask(CalcData(prompt=row["prompt"], answer=row["answer"], demo=row["demo"]), self.config.task)


def load_taskset(config: vf.TasksetConfig | None = None) -> CalcTaskset:
    """The taskset, as a verifiers environment package's loader returns it."""
    return CalcTaskset(config or vf.TasksetConfig())
