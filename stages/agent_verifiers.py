"""A `verifiers` environment as a rollout stage's agent (issue 48): `agent: "verifiers:pkg.mod:load_taskset"`.

Each episode runs as `vf eval` runs it, against rlflow's endpoint instead of a hosted model: the row becomes the
taskset's Task (stages/env_verifiers.py, as for its rubric), a verifiers `Agent` runs verifiers' own chat-loop
program (the `null` harness: it sends the conversation to the model, calls the Task's tools over MCP, and loops
until a reply makes no call), its requests reach the episode's base_url through verifiers' interception server, the
Task's tool servers are started by verifiers (`python -m <the Toolset's module>`), and the Task's rubric scores the
finished Trace. The agent returns the scored Trace's reward; the reward stage reads it (`fn: agent_reward`). What is
trained is what rlflow recorded at the endpoint: the token ids the model sampled, turn by turn.

Two choices, and why:
- The harness is verifiers' chat loop whatever the taskset ships: it is the one harness that runs without a container
  (its NEEDS_CONTAINER is False) and speaks only to the model and the Task's tools. A harness that executes code
  (bash and every third-party program) would run the model's commands on this host; verifiers itself warns against
  that outside a container.
- Its program is run by this interpreter, not by uv: verifiers writes it as a PEP 723 script and has `uv sync`
  resolve its dependencies (openai, mcp, httpx, tenacity) from PyPI into a fresh environment per machine; they are
  rlflow's own dependencies with the `ecosystem` and `agents` extras, so the run needs no download and no uv. What
  would need installing at run time (a container runtime, tool servers outside the subprocess runtime) is refused at
  compile by rule (`verifiers-needs-install`), before any episode starts.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

from rlflow.stages.env_verifiers import INSTALL, task_for, taskset

#: the chat loop's imports (verifiers' PEP 723 header for its null/bash program lists them)
CHAT_LOOP_NEEDS = ("openai", "mcp", "httpx", "tenacity", "certifi")


def adapt(target: str) -> VerifiersAgent:
    """The agent for `agent: "verifiers:<target>"` (registry.agent_fn); ComponentError naming the rule when its
    episodes cannot run here as declared."""
    from rlflow.registry import ComponentError

    for rule, what, way_out in problems(target):
        raise ComponentError(f"{what}; {way_out}", rule)
    return VerifiersAgent(target)


class VerifiersAgent:
    """agent(row, base_url, episode_id) -> {"reward", "rewards", "turns", "reply"}: one verifiers episode on the row's
    Task against the episode's endpoint (picklable: it holds the target and loads the taskset where it runs)."""

    def __init__(self, target: str):
        self.target = target
        self.__name__ = f"verifiers:{target}"

    async def __call__(self, row: dict, base_url: str, episode_id: str, max_turns: int | None = None) -> dict:
        import verifiers.v1 as vf

        task = task_for(self.target, row)
        shared = await shared_tools(self.target)
        agent = vf.Agent(agent_config(base_url, max_turns))
        agent.harness = local_chat_harness(agent.harness.config)
        async with agent:
            trace = await agent.run(task, tools=shared)
        if not trace.ok:  # verifiers' errors end with their cause (a traceback's last line): keep that end
            causes = "; ".join(f"{e.type}: {(e.message.strip().splitlines() or [''])[-1].strip(' |')}"
                               for e in trace.errors)
            raise RuntimeError(f"the verifiers episode failed: {causes or 'no error recorded'}")
        return {"reward": trace.reward, "rewards": {k: r and r.score for k, r in trace.rewards.items()},
                "turns": len(trace.calls), "reply": trace.last_reply}


#: (target, event loop) -> the taskset's shared tool servers, started once and kept for the life of the process
_SHARED: dict = {}
_STACKS: list = []


async def shared_tools(target: str) -> dict:
    """The taskset-scoped tool servers (`Taskset.toolsets`), started once per process as verifiers starts them once
    per eval (serve_shared); the Task's own `toolsets` start per episode inside agent.run, as in verifiers. They stop
    with the process (verifiers' servers die with their parent)."""
    import asyncio
    import contextlib

    from verifiers.v1.mcp.launch import serve_shared

    key = (target, asyncio.get_running_loop())
    if key not in _SHARED:
        _SHARED[key] = asyncio.ensure_future(_start_shared(target, serve_shared, contextlib.AsyncExitStack()))
    return await asyncio.shield(_SHARED[key])


async def _start_shared(target: str, serve_shared, stack) -> dict:
    _share_import_path()
    ts = taskset(target)
    servers = type(ts).toolsets(ts.config)
    _STACKS.append(stack)  # held: a dropped stack is collected, and its servers torn down with it
    return await stack.enter_async_context(serve_shared(servers)) if servers else {}


def agent_config(base_url: str, max_turns: int | None = None):
    """The verifiers AgentConfig of one episode: the chat loop on the subprocess runtime, its model the endpoint, at
    most the stage's max_turns requests (verifiers ends the episode there and scores it, as at its own limit)."""
    import verifiers.v1 as vf
    from verifiers.v1.configs.client import EvalClientConfig
    from verifiers.v1.harnesses.null.harness import NullHarnessConfig

    # retries stay 0 (verifiers' default): a failed episode is rlflow's to count, once, by name
    return vf.AgentConfig(model="rlflow-policy", harness=NullHarnessConfig(id="null"), runtime=vf.SubprocessConfig(),
                          client=EvalClientConfig(base_url=base_url, api_key_var="RLFLOW_AGENT_KEY"),
                          max_turns=max_turns)


def local_chat_harness(config):
    """verifiers' null harness, its chat program run by this interpreter (the module docstring says why)."""
    from verifiers.v1.harnesses.null.harness import NullHarness

    class LocalChatHarness(NullHarness):
        async def setup(self, runtime) -> None:
            pass  # nothing to install: the program's imports are this environment's

        async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
            return await super().launch(ctx, trace, _ThisInterpreter(runtime), endpoint, secret, mcp_urls, data,
                                        tool_interception_url)

    return LocalChatHarness(config)


class _ThisInterpreter:
    """A verifiers runtime whose PEP 723 scripts run with sys.executable (written once per content, like uv's)."""

    def __init__(self, runtime):
        self._runtime = runtime

    def __getattr__(self, name):
        return getattr(self._runtime, name)

    async def prepare_uv_script(self, script, env=None, *, activate: bool = True) -> list[str]:
        data = script.encode() if isinstance(script, str) else script
        path = Path(tempfile.gettempdir()) / f"rlflow-vf-{hashlib.sha256(data).hexdigest()[:16]}.py"
        if not path.exists():
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            tmp.replace(path)  # atomic: concurrent episodes never read half a program
        return [sys.executable, str(path)]


def _share_import_path() -> None:
    """verifiers starts tool servers as `python -m <module>` in fresh processes: give them this process's import path,
    so a Toolset found beside the pipeline (added to sys.path by rlflow) is found there too."""
    known = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    merged = list(dict.fromkeys([*known, *(p for p in sys.path if p)]))
    if merged != known:
        os.environ["PYTHONPATH"] = os.pathsep.join(merged)


def problems(target: str) -> list[tuple[str, str, str]]:
    """What stops the target's episodes from running here as declared: [(rule, what, way out)] (compile's check)."""
    import verifiers.v1 as vf
    from verifiers.v1.utils.compile import validate_pairing

    missing = [m for m in CHAT_LOOP_NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        return [("missing-package", f"verifiers' chat loop needs {', '.join(missing)}, not installed",
                 f"{INSTALL}, and pip install 'rlflow[agents]'")]
    ts = taskset(target)
    task_cls = type(ts).task_type()
    toolsets = [*task_cls.toolsets(ts.config.task), *type(ts).toolsets(ts.config)]
    out = []
    try:
        validate_pairing(local_chat_harness(agent_config("http://127.0.0.1/v1").harness), task_cls,
                         vf.SubprocessConfig(), tools=toolsets)
    except ValueError as e:
        out.append(("verifiers-needs-install", f"{target}: {e}".split("; use --env")[0],
                    "rlflow runs verifiers episodes in the subprocess runtime, with no container: run this "
                    "environment with verifiers itself (vf eval), or make its Task run without one"))
    for toolset in toolsets:
        name, config = type(toolset).__name__, toolset.config
        if config.url is None and not isinstance(config.runtime, vf.SubprocessConfig):
            out.append(("verifiers-needs-install", f"{target}: its Toolset {name} runs in a {config.runtime.type} "
                        "runtime, where verifiers builds it and installs it with uv at run time",
                        "serve it in the subprocess runtime (its config's default) or give its url"))
        elif config.url is None and not _runs_as_main(type(toolset)):
            out.append(("verifiers-toolset-not-runnable", f"{target}: verifiers starts the Toolset {name} as "
                        f"`python -m {type(toolset).__module__}`, and that module does not run it",
                        f"end the module with: if __name__ == \"__main__\": {name}.run()"))
    return out


def _runs_as_main(cls) -> bool:
    """Whether the class's module has an `if __name__ == "__main__":` block (which is what serves the Toolset)."""
    source = Path(sys.modules[cls.__module__].__file__).read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) and "__name__" in ast.unparse(node.test):
            return True
    return False
