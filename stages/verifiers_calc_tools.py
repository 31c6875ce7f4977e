"""A multi-turn `verifiers` environment with a Python-function tool, for `pipelines/verifiers_tools.yaml` and its test
(issue 48): the calculator word problems (builtin:calc) as a verifiers v1 Taskset that offers a calculator `Toolset`,
its Task verifiers_calc's (scored by its `@vf.reward`: the number after the last `A=` of the final reply).

Written as any verifiers environment is (verifiers.v1: a Toolset with `@vf.tool`, a Taskset with `toolsets` and
`load`, the module runnable as the Toolset's MCP server), so rlflow runs it through the `verifiers:` agent adapter
(stages/agent_verifiers.py) as `vf eval` would: verifiers' own chat loop sends the model's requests to rlflow's
endpoint, verifiers serves the tool over MCP, and the Task's rubric scores the finished Trace.
Needs the verifiers package (`pip install 'rlflow[ecosystem]'`).

    python -m rlflow.stages.verifiers_calc_tools    # the calculator's MCP server, as verifiers starts it
"""

from __future__ import annotations

import verifiers.v1 as vf

from rlflow.stages.tasks import calc
from rlflow.stages.tools import calculator as evaluate
from rlflow.stages.verifiers_calc import CalcData, CalcTask


class CalcToolset(vf.Toolset[vf.SharedToolsetConfig, vf.State]):
    """The calculator, served to the model over MCP by verifiers."""

    TOOL_PREFIX = None  # the tool is `calculator`, not `calc_toolset_calculator`: the name the tiny model learned

    @vf.tool
    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression (numbers, + - * / // %, parentheses) and return its value."""
        return evaluate(expression)


class CalcToolsTaskset(vf.Taskset[CalcTask, vf.TasksetConfig]):
    """verifiers_calc's Task (its `@vf.reward`: the number after the final reply's last `A=`), with a calculator."""

    @classmethod
    def toolsets(cls, config: vf.TasksetConfig) -> list[vf.Toolset]:
        """The calculator knows nothing of the task: one server for all episodes (a taskset-scoped Toolset), not one
        per episode (a Task's `toolsets`), as verifiers advises for task-agnostic tools."""
        return [CalcToolset(vf.SharedToolsetConfig())]

    def load(self):
        for row in calc(seed=0, count=64):
            yield CalcTask(CalcData(prompt=row["prompt"], answer=row["answer"]), self.config.task)


def load_taskset(config: vf.TasksetConfig | None = None) -> CalcToolsTaskset:
    """The taskset, as a verifiers environment package's loader returns it."""
    return CalcToolsTaskset(config or vf.TasksetConfig())


if __name__ == "__main__":  # verifiers starts the tool server as `python -m <this module>`
    CalcToolset.run()
