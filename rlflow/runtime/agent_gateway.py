"""The OpenAI-compatible endpoint an agent program rolls out through (issue 48), and the agents it runs.

An agent is a program written against the OpenAI client: `agent: module:fn` (an async function given the task row, an
OpenAI `base_url` and an episode id, returning what the reward function needs) or `agent: {command: [...]}` (a
subprocess given the same in its environment: OPENAI_BASE_URL, RLFLOW_EPISODE_ID, RLFLOW_TASK as JSON; its last line
of stdout, JSON, is its result). Every episode gets its own base URL, `http://127.0.0.1:PORT/episodes/<id>/v1`, so
the agent needs nothing rlflow-specific: the episode id is in the path the plain `openai` client keeps.

The hub holds the protocol only: each episode's numbered events (a request, or the agent's end) and the HTTP
requests waiting for their answer. It has no tokenizer and no engine. The rollout worker that holds the episode's
trajectory asks for the next event (`next_event(eid, seq)`), renders it into token ids, generates the turn on its
engine and answers it (`reply(eid, seq, body)`; the worker makes the answer and the wait for the next event one call,
`reply_and_wait`): runtime/agent_episodes.py. So a turn interrupted by a weight sync or
migrated to another instance is answered from wherever it finishes, and the coordinator's admission, staleness bound,
interruption and migration apply to agent turns as to any other. The events are numbered and kept until the episode
ends, so asking again for event `seq` (a trajectory that moved) gets the same one.

What the hub refuses, by name, with an OpenAI-style error body (the agent sees an `openai.APIStatusError`):
- 404 `agent-episode-ended`: a call for an episode that is over (or never began here);
- 409 `agent-concurrent-request`: a second request of one episode while one is being answered;
- 400 `agent-malformed-request`: a body that is not a chat/completions request this endpoint serves (n > 1 among them);
- 400 `agent-history-rewritten`: a request whose history differs from what was sent and answered before (the trained
  ids must be the ones sampled: an agent that edits or drops earlier turns cannot be trained token-exact);
- and what the worker refuses (the turn or token budget spent: 400 `agent-budget-spent`).

An agent that raises, or runs past `timeout_s`, ends its episode with error `agent-raised` / `agent-timeout`: that
trajectory fails by name and the run goes on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import threading
import time
from dataclasses import dataclass, field

from fastapi import Request  # at module level: the routes' annotations are resolved from this module's names

# seconds an HTTP request waits for its turn to be generated: a turn waits behind the coordinator's admission and
# weight syncs, but one that never comes is a dead instance, and the agent should hear of it
REQUEST_TIMEOUT_S = 600.0


class AgentError(Exception):
    """A request the endpoint refuses: HTTP status, the rule, and what was wrong."""

    def __init__(self, status: int, rule: str, message: str):
        super().__init__(message)
        self.status, self.rule, self.message = status, rule, message

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": "invalid_request_error", "code": self.rule}}


@dataclass
class _Episode:
    eid: str
    row: dict
    events: list[dict] = field(default_factory=list)  # numbered by position: requests, then one end event
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    pending: dict[int, asyncio.Future] = field(default_factory=dict)  # seq -> the HTTP request's answer
    messages: list[dict] | None = None  # chat: the conversation so far, our answers included (normalised)
    text: str | None = None  # completions: the prompt and completions so far
    task: asyncio.Task | None = None

    def push(self, event: dict) -> int:
        event["seq"] = len(self.events)
        self.events.append(event)
        self.changed.set()
        self.changed = asyncio.Event()
        return event["seq"]


def normalised(message: dict) -> dict:
    """A chat message as compared for history: what the template renders (role, content, tool calls' names and
    arguments as values, tool_call_id / name), whatever the client re-serialised (None vs "", argument JSON)."""
    calls = []
    for c in message.get("tool_calls") or []:
        f = c.get("function", c)
        args = f.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        calls.append({"name": f.get("name"), "arguments": args})
    out = {"role": message.get("role"), "content": message.get("content") or ""}
    if calls:
        out["tool_calls"] = calls
    for k in ("tool_call_id", "name"):
        if message.get(k):
            out[k] = message[k]
    return out


class AgentHub:
    """The endpoint and the agents of one agent rollout stage, on one asyncio loop. `agent`: the plan's entry
    ({"fn": "module:fn"} or {"command": [...]}, "timeout_s"), with the stage's "max_turns" (for an agent that
    takes it)."""

    def __init__(self, agent: dict, model: str = "rlflow-policy", host: str = "127.0.0.1", port: int = 0):
        self.agent, self.model, self.host, self.port = dict(agent), model, host, port
        self.timeout_s = float(agent.get("timeout_s", 600))
        self.episodes: dict[str, _Episode] = {}  # open episodes; one that ended is gone (its calls get 404)
        self.server = None
        self._fn = None

    # -- serving --------------------------------------------------------------------------------------------------
    async def start(self) -> str:
        """Serve on host:port (0: a free port); returns the root URL (an episode's base URL: base_url())."""
        import socket

        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app(), log_level="warning", access_log=False, lifespan="off")
        self.server = uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: None  # not the main thread (a Ray actor, a test's loop)
        self.serving = asyncio.get_running_loop().create_task(self.server.serve(sockets=[sock]))
        for _ in range(200):
            if self.server.started:
                break
            await asyncio.sleep(0.01)
        return self.root()

    def root(self) -> str:
        return f"http://{self.host}:{self.port}"

    def base_url(self, eid: str) -> str:
        return f"{self.root()}/episodes/{eid}/v1"

    async def stop(self) -> None:
        for ep in list(self.episodes.values()):
            self.end(ep.eid)
        if self.server is not None:
            self.server.should_exit = True
            try:
                await asyncio.wait_for(self.serving, 5)
            except TimeoutError:
                self.serving.cancel()

    def app(self):
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, StreamingResponse

        app = FastAPI()

        async def serve(eid: str, kind: str, request: Request):
            try:
                body = await request.json()
            except ValueError:
                body = None
            try:
                answer, stream = await self.request(eid, kind, body)
            except AgentError as e:
                return JSONResponse(e.body(), status_code=e.status)
            if stream:
                return StreamingResponse(sse(answer, kind), media_type="text/event-stream")
            return JSONResponse(answer)

        @app.post("/episodes/{eid}/v1/chat/completions")
        async def chat(eid: str, request: Request):
            return await serve(eid, "chat", request)

        @app.post("/episodes/{eid}/v1/completions")
        async def completions(eid: str, request: Request):
            return await serve(eid, "completion", request)

        @app.get("/episodes/{eid}/v1/models")
        async def models(eid: str):
            return {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "rlflow"}]}

        return app

    # -- one request ----------------------------------------------------------------------------------------------
    async def request(self, eid: str, kind: str, body) -> tuple[dict, bool]:
        """An agent's request: checked, handed to the episode's worker as an event, answered when its turn is
        generated. Returns (the answer, whether it is to be streamed)."""
        ep = self.episodes.get(eid)
        if ep is None:
            raise AgentError(404, "agent-episode-ended", f"episode {eid!r} is over (or never began): its agent called "
                             "the endpoint after it returned, or used another episode's URL")
        if ep.pending:
            raise AgentError(409, "agent-concurrent-request", f"episode {eid!r} already has a request being answered; "
                             "an episode's calls are one conversation: await each before the next")
        event = self._event(ep, kind, body)
        # whether to answer with OpenAI's logprobs object: chat asks with `logprobs: true`, completions with a count
        # of alternatives (0 included)
        event["logprobs"] = bool(body.get("logprobs")) if kind == "chat" else body.get("logprobs") is not None
        seq = ep.push(event)
        answer = ep.pending[seq] = asyncio.get_running_loop().create_future()
        try:
            reply = await asyncio.wait_for(answer, REQUEST_TIMEOUT_S)
        except TimeoutError:
            raise AgentError(504, "agent-turn-timeout", f"no rollout instance generated this turn within "
                             f"{REQUEST_TIMEOUT_S:.0f} s") from None
        finally:
            ep.pending.pop(seq, None)
        if "error" in reply:
            e = reply["error"]
            raise AgentError(e.get("status", 400), e["rule"], e["message"])
        if kind == "chat":
            ep.messages = [*event["history"], normalised(reply["choices"][0]["message"])]
        else:
            ep.text = event["text"] + reply["choices"][0]["text"]
        return reply, bool(body.get("stream"))

    def _event(self, ep: _Episode, kind: str, body) -> dict:
        if not isinstance(body, dict):
            raise AgentError(400, "agent-malformed-request", "the request body is not a JSON object")
        if body.get("n", 1) != 1:
            raise AgentError(400, "agent-malformed-request", f"n={body.get('n')}: one completion per request (a group's "
                             "samples are the stage's group_size episodes)")
        if kind == "completion":
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise AgentError(400, "agent-malformed-request", "prompt must be one string")
            if ep.messages is not None:
                raise AgentError(400, "agent-malformed-request", "an episode is chat or completions, not both")
            if ep.text is None:
                return {"kind": "completion", "prompt": prompt, "text": prompt}
            if not prompt.startswith(ep.text):
                raise AgentError(400, "agent-history-rewritten", "the prompt does not extend the previous prompt and "
                                 "its completion: the trained tokens would not be the ones sampled")
            return {"kind": "completion", "prompt": prompt[len(ep.text):], "text": prompt}
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and m.get("role") in ("system", "user", "assistant", "tool") for m in messages):
            raise AgentError(400, "agent-malformed-request", "messages must be a non-empty list of {role, content} with "
                             "role system, user, assistant or tool")
        if ep.text is not None:
            raise AgentError(400, "agent-malformed-request", "an episode is chat or completions, not both")
        history = [normalised(m) for m in messages]
        if ep.messages is None:
            if history[-1]["role"] == "assistant":
                raise AgentError(400, "agent-malformed-request", "the last message is the assistant's: nothing to answer")
            return {"kind": "chat", "messages": history, "tools": body.get("tools") or [], "history": history}
        k = len(ep.messages)
        if history[:k] != ep.messages:
            at = next((i for i, (a, b) in enumerate(zip(history, ep.messages)) if a != b), min(k, len(history)))
            raise AgentError(400, "agent-history-rewritten", f"message {at} differs from what this episode sent and was "
                             "answered before (or was dropped): the trained tokens would not be the ones sampled")
        new = history[k:]
        if not new or any(m["role"] == "assistant" for m in new):
            raise AgentError(400, "agent-malformed-request", "after the last answer, send the new tool or user messages "
                             "(and no assistant message of your own)")
        return {"kind": "chat", "messages": new, "history": history}

    # -- the worker's side ----------------------------------------------------------------------------------------
    def begin(self, eid: str, row: dict) -> None:
        """Start the episode's agent (an episode begun again, e.g. a trajectory restarted, restarts its agent)."""
        if eid in self.episodes:
            self.end(eid)
        ep = self.episodes[eid] = _Episode(eid, dict(row))
        ep.task = asyncio.get_running_loop().create_task(self._run(ep))

    async def next_event(self, eid: str, seq: int, timeout_s: float) -> dict:
        """Event `seq` of the episode, waiting up to timeout_s for it (then {"kind": "wait"}: ask again)."""
        ep = self.episodes.get(eid)
        if ep is None:
            return {"kind": "error", "rule": "agent-episode-ended", "message": f"episode {eid!r} is not open here"}
        deadline = time.monotonic() + timeout_s
        while seq >= len(ep.events):
            left = deadline - time.monotonic()
            if left <= 0:
                return {"kind": "wait", "seq": seq}
            try:
                await asyncio.wait_for(ep.changed.wait(), left)
            except TimeoutError:
                pass
        return ep.events[seq]

    def reply(self, eid: str, seq: int, body: dict) -> bool:
        """Answer request `seq` (a response body, or {"error": {status, rule, message}}); False if nobody waits."""
        ep = self.episodes.get(eid)
        answer = ep.pending.get(seq) if ep else None
        if answer is None or answer.done():
            return False
        answer.set_result(body)
        return True

    # The worker's two calls per turn, each one round trip (a Ray actor call for AgentGateway): starting an episode
    # and answering a request both come back with the agent's next event, as the worker always asks for it next.
    async def begin_and_wait(self, eid: str, row: dict, timeout_s: float) -> dict:
        """begin(), then the agent's first event (next_event(eid, 0, timeout_s))."""
        self.begin(eid, row)
        return await self.next_event(eid, 0, timeout_s)

    async def reply_and_wait(self, eid: str, seq: int, body: dict, timeout_s: float) -> dict:
        """reply() to request `seq`, then the agent's next event (next_event(eid, seq + 1, timeout_s))."""
        self.reply(eid, seq, body)
        return await self.next_event(eid, seq + 1, timeout_s)

    def end(self, eid: str) -> None:
        """The episode is over for the worker: its agent is cancelled if still running, later calls get 404."""
        ep = self.episodes.pop(eid, None)
        if ep is None:
            return
        for answer in ep.pending.values():
            if not answer.done():
                answer.set_result({"error": {"status": 404, "rule": "agent-episode-ended",
                                             "message": f"episode {eid!r} ended before this request was answered"}})
        if ep.task is not None and not ep.task.done():
            ep.task.cancel()

    # -- running the agent ----------------------------------------------------------------------------------------
    async def _run(self, ep: _Episode) -> None:
        try:
            result = await asyncio.wait_for(self._call(ep), self.timeout_s)
            json.dumps(result)  # it travels to the reward function as JSON
            ep.push({"kind": "done", "result": result})
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            ep.push({"kind": "error", "rule": "agent-timeout", "message": f"the agent ran past timeout_s={self.timeout_s:g} s"})
        except Exception as e:  # noqa: BLE001 - the agent is user code: its failure fails its trajectory, by name
            ep.push({"kind": "error", "rule": "agent-raised", "message": f"{type(e).__name__}: {str(e)[:300]}"})

    async def _call(self, ep: _Episode):
        if "command" in self.agent:
            return await self._command(ep)
        if self._fn is None:
            import inspect

            from rlflow import registry

            self._fn = registry.agent_fn(self.agent["fn"])
            # an agent that takes `max_turns` is told the stage's budget (a verifiers Agent stops there and scores)
            takes = inspect.signature(self._fn).parameters
            self._extra = {"max_turns": self.agent["max_turns"]} if "max_turns" in takes and "max_turns" in self.agent \
                else {}
        return await self._fn(ep.row, self.base_url(ep.eid), ep.eid, **self._extra)

    async def _command(self, ep: _Episode):
        env = {**os.environ, "OPENAI_BASE_URL": self.base_url(ep.eid), "OPENAI_API_KEY": "rlflow",
               "RLFLOW_EPISODE_ID": ep.eid, "RLFLOW_TASK": json.dumps(ep.row, default=str)}
        proc = await asyncio.create_subprocess_exec(*self.agent["command"], env=env, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await proc.communicate()
        except asyncio.CancelledError:
            proc.kill()
            raise
        if proc.returncode:
            raise RuntimeError(f"exit code {proc.returncode}: {err.decode(errors='replace').strip()[-300:]}")
        lines = out.decode(errors="replace").strip().splitlines()
        return json.loads(lines[-1]) if lines else None


async def sse(answer: dict, kind: str):
    """A whole answer as an OpenAI stream: the content in one chunk, then the finish, then [DONE] (engines return
    whole turns: a turn is generated before it is answered)."""
    choice = answer["choices"][0]
    base = {k: answer[k] for k in ("id", "created", "model")}
    if kind == "chat":
        msg = choice["message"]
        delta = {"role": "assistant", "content": msg.get("content") or ""}
        if msg.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(msg["tool_calls"])]
        first = {**base, "object": "chat.completion.chunk",
                 "choices": [{"index": 0, "delta": delta, "logprobs": choice.get("logprobs"), "finish_reason": None,
                              "token_ids": choice.get("token_ids"), "token_logprobs": choice.get("token_logprobs")}],
                 "prompt_token_ids": answer.get("prompt_token_ids"), "rlflow": answer.get("rlflow")}
        last = {**base, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}],
                "usage": answer.get("usage")}
    else:
        first = {**base, "object": "text_completion",
                 "choices": [{"index": 0, "text": choice["text"], "logprobs": choice.get("logprobs"),
                              "finish_reason": None, "token_ids": choice.get("token_ids"),
                              "token_logprobs": choice.get("token_logprobs")}],
                 "prompt_token_ids": answer.get("prompt_token_ids"), "rlflow": answer.get("rlflow")}
        last = {**base, "object": "text_completion",
                "choices": [{"index": 0, "text": "", "finish_reason": choice["finish_reason"]}],
                "usage": answer.get("usage")}
    for chunk in (first, last):
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"


class LoopHub:
    """An AgentHub on its own asyncio loop in a thread, called synchronously: what a rollout worker's episode
    threads call (the Ray actor, AgentGateway, does the same across processes)."""

    def __init__(self, agent: dict, model: str = "rlflow-policy"):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="agent-hub", daemon=True)
        self.thread.start()
        self.hub = self._call(_make_hub(agent, model))
        self.url = self._call(self.hub.start())

    def _call(self, coro, timeout_s: float | None = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def begin_and_wait(self, eid: str, row: dict, timeout_s: float) -> dict:
        return self._call(self.hub.begin_and_wait(eid, row, timeout_s), timeout_s + 30)

    def next_event(self, eid: str, seq: int, timeout_s: float) -> dict:
        return self._call(self.hub.next_event(eid, seq, timeout_s), timeout_s + 30)

    def reply_and_wait(self, eid: str, seq: int, body: dict, timeout_s: float) -> dict:
        return self._call(self.hub.reply_and_wait(eid, seq, body, timeout_s), timeout_s + 30)

    def end(self, eid: str) -> None:
        self._call(_sync(self.hub.end, eid))

    def close(self) -> None:
        try:
            self._call(self.hub.stop(), 10)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)


async def _make_hub(agent: dict, model: str) -> AgentHub:
    return AgentHub(agent, model)  # made on the loop: its asyncio objects belong to it


async def _sync(fn, *args):
    return fn(*args)


def start_gateway(episode: dict, stage: str, model: str, timeout_s: float = 120.0):
    """The Ray actor of a run's agent stage, started and serving: (handle, name). An AgentHub in its own process
    (num_cpus=0: it waits on I/O; an agent that computes should be a command, which gets its own process), named so
    the stage's rollout workers find it; it lives as long as the fleet holds the handle."""
    import uuid

    import ray

    name = f"rlflow-agents-{stage}-{uuid.uuid4().hex[:8]}"
    handle = ray.remote(num_cpus=0, max_concurrency=10_000)(AgentGateway).options(name=name).remote(
        {**episode["agent"], "max_turns": episode["max_turns"]}, model)
    try:
        url = ray.get(handle.start.remote(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"agent stage {stage}: its endpoint did not start serving within {timeout_s:.0f} s") from None
    return handle, name, url


class AgentGateway:
    """start_gateway's actor: an AgentHub, its methods awaited on the actor's event loop."""

    def __init__(self, agent: dict, model: str):
        self.agent, self.model, self.hub = agent, model, None

    async def start(self) -> str:
        self.hub = AgentHub(self.agent, self.model)
        return await self.hub.start()

    async def begin_and_wait(self, eid: str, row: dict, timeout_s: float) -> dict:
        return await self.hub.begin_and_wait(eid, row, timeout_s)

    async def next_event(self, eid: str, seq: int, timeout_s: float) -> dict:
        return await self.hub.next_event(eid, seq, timeout_s)

    async def reply_and_wait(self, eid: str, seq: int, body: dict, timeout_s: float) -> dict:
        return await self.hub.reply_and_wait(eid, seq, body, timeout_s)

    async def end(self, eid: str) -> None:
        self.hub.end(eid)


class GatewayClient:
    """The Ray actor, called synchronously from a rollout worker's episode threads (LoopHub's interface)."""

    def __init__(self, handle):
        import ray

        self.handle, self.get = handle, ray.get

    def begin_and_wait(self, eid: str, row: dict, timeout_s: float) -> dict:
        return self.get(self.handle.begin_and_wait.remote(eid, row, timeout_s), timeout=timeout_s + 60)

    def next_event(self, eid: str, seq: int, timeout_s: float) -> dict:
        return self.get(self.handle.next_event.remote(eid, seq, timeout_s), timeout=timeout_s + 30)

    def reply_and_wait(self, eid: str, seq: int, body: dict, timeout_s: float) -> dict:
        return self.get(self.handle.reply_and_wait.remote(eid, seq, body, timeout_s), timeout=timeout_s + 60)

    def end(self, eid: str) -> None:
        self.handle.end.remote(eid)  # fire and forget: nothing waits on an ended episode
