"""verifiers environments rlflow cannot run as declared, for the compile rules of the `verifiers:` agent adapter
(tests/unit/runtime/test_agent_verifiers.py): each is a taskset whose episodes would need something installed or a
container at run time, or a tool server verifiers cannot start. No `if __name__ == "__main__"` here, on purpose."""

from __future__ import annotations

import verifiers.v1 as vf

from rlflow.stages.verifiers_calc import CalcData
from rlflow.stages.verifiers_calc_tools import CalcToolset


class Echo(vf.Toolset[vf.ToolsetConfig, vf.State]):
    @vf.tool
    def echo(self, text: str) -> str:
        """Say it back."""
        return text


class _Task(vf.Task[CalcData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def one(self, trace: vf.Trace) -> float:
        return 1.0


class ContainerTask(_Task):
    NEEDS_CONTAINER = True  # e.g. a SWE task that edits a repository in its image


class DockerToolTask(_Task):
    @classmethod
    def toolsets(cls, config):
        return [CalcToolset(vf.SharedToolsetConfig(runtime=vf.DockerConfig()))]  # verifiers uv-installs it in there


class NotRunnableToolTask(_Task):
    @classmethod
    def toolsets(cls, config):
        return [Echo(vf.ToolsetConfig())]  # this module never calls Echo.run()


def _taskset(task_cls):
    class One(vf.Taskset[task_cls, vf.TasksetConfig]):
        def load(self):
            yield task_cls(CalcData(prompt="1+1?", answer="2"), self.config.task)

    return lambda: One(vf.TasksetConfig())


container = _taskset(ContainerTask)
docker_tool = _taskset(DockerToolTask)
not_runnable_tool = _taskset(NotRunnableToolTask)
