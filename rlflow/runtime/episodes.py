"""Multi-turn episodes inside a rollout instance: between turns, a trajectory goes to its environment.

A turn is one generation segment on the engine. When it ends at one of the stage's stop strings (a tool
call) and the episode has turns left, the worker hands the trajectory here instead of reporting it: its
environment's `step` runs on a thread pool while the engine generates other trajectories (verl's AgentLoop
and Laminar's long-tail argument: environment latency is where asynchrony pays). The observation comes back
as an environment segment of completion_ids (loss mask 0, behaviour log-prob 0), the next turn begins, and
the trajectory goes back to the engine as a continuation: the partial-rollout resume path (prompt plus
completion so far, re-prefilled). The driver hears of the trajectory once, when its episode is over, so the
buffer, ledger and staleness bound see one trajectory as for single-turn rollouts; V_traj is the oldest
version over all its turns (RolloutEngine.begin_segment stamps every segment).

The environment contract is in stages/environment.py. A stage with `tools:` runs the same loop in chat form
(runtime/chat_episodes.py ChatForm): the parser decides which turns are calls, and observations arrive as the chat
template's token ids rather than text.
"""

from __future__ import annotations

import base64
import pickle
import time
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from rlflow.stages.engine import cut_at_stop
from rlflow.stages.environment import Environment, EnvStep
from rlflow.stages.tool_parsers import turn_text
from rlflow.stages.trajectory import Trajectory

#: longest wait for one environment step when the worker has nothing else to do, or is asked for the trajectory
ENV_STEP_TIMEOUT_S = 120.0
MAX_ENV_THREADS = 64
MAX_AGENT_THREADS = 1024
AGENT_COALESCE_S = 0.02  # see Episodes.ready


class Episodes:
    """The environments of one rollout instance's open episodes, and the trajectories waiting on them."""

    def __init__(self, env_cls, env_kwargs: dict, *, max_turns: int, tokenizer, max_new_tokens: int,
                 stop: tuple[str, ...], threads: int = 8, form=None):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.env_cls, self.env_kwargs = env_cls, dict(env_kwargs)
        self.max_turns, self.tokenizer, self.max_new_tokens, self.stop = max_turns, tokenizer, max_new_tokens, stop
        self.envs: dict[str, Environment] = {}  # traj id -> its episode's environment (open episodes here)
        self.waiting: dict[str, tuple[Trajectory, Future, float]] = {}  # on their environment: (traj, step, since)
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="env")
        # chat form (runtime/chat_episodes.py ChatForm), agent form (runtime/agent_episodes.py AgentForm); None: raw
        # text, tool calls by stop strings
        self.form = form
        self.deferred = bool(getattr(form, "deferred", False))  # agents: the turn budget is theirs to end

    # ------------------------------------------------------------------ routing
    def begin(self, traj: Trajectory) -> bool:
        """A trajectory routed here: a fresh one starts its episode (reset); one resumed mid-episode brings its
        environment along (env_state). True: start it on the engine now; False: it waits here first (an agent
        episode: for its agent's first request, runtime/agent_episodes.py)."""
        tid = traj.traj_id
        if traj.env_state:
            self.envs[tid] = pickle.loads(base64.b64decode(traj.env_state))
            traj.env_state = ""
        elif not traj.completion_ids:
            traj.turn_starts, traj.loss_mask, traj.env_reward, traj.env_s = [], [], 0.0, 0.0
            if self.deferred:
                link = self.envs[tid] = self.form.link(traj)
                self.waiting[tid] = (traj, self.pool.submit(self.form.first, link, traj), time.monotonic())
                return False
            if self.form:
                self.form.begin(traj)
            env = self.env_cls(**self.env_kwargs)
            self.envs[tid] = env
            self._append(traj, env.reset(traj.row | {"prompt": traj.prompt, "answer": traj.answer}))
            traj.turn_starts.append(len(traj.completion_ids))
        elif tid not in self.envs:
            raise ValueError(f"trajectory {tid} resumes an episode without its environment (env_state is empty)")
        return True

    def turn_ended(self, traj: Trajectory) -> bool:
        """A turn finished on the engine. True: it went to its environment (a tool call with turns left);
        False: the episode is over and the trajectory is final."""
        action = turn_text(self.tokenizer, traj.completion_ids[traj.turn_start:], getattr(self.form, "parser", None))
        env = self.envs.get(traj.traj_id)
        if env is None or not self._is_call(traj, action) or (len(traj.turn_starts) >= self.max_turns
                                                              and not self.deferred):
            self._close(traj)
            return False
        turn = list(traj.completion_ids[traj.turn_start:])
        self.waiting[traj.traj_id] = (traj, self.pool.submit(self._step, env, action, turn, traj), time.monotonic())
        return True

    def _is_call(self, traj: Trajectory, action: str) -> bool:
        """Whether a finished turn is a tool call: it ended at one of the stop strings (chat form: the parser's)."""
        if self.form:
            return self.form.is_call(traj, action)
        return traj.finish_reason == "stop" and any(s in action for s in self.stop)

    def _step(self, env: Environment, action: str, turn_ids: list[int], traj: Trajectory) -> EnvStep:
        """The environment's step for a turn (on the thread pool): text, or token ids in chat form; an agent's next
        request (the form answers the turn from the trajectory)."""
        if self.deferred:
            return self.form.step(env, action, turn_ids, traj)
        return self.form.step(env, action, turn_ids) if self.form else env.step(action)

    def ready(self, wait_s: float = 0.0) -> list[Trajectory]:
        """Trajectories whose environment step is done, each with its observation appended and its next turn
        begun, ready to go back to the engine; plus (finish_reason set) any whose episode the step ended. Waits up
        to `wait_s` for the first when none is done yet."""
        if not self.waiting:
            return []
        if wait_s > 0:
            done, pending = wait([f for _, f, _ in self.waiting.values()], timeout=wait_s, return_when=FIRST_COMPLETED)
            if self.deferred and done and pending:
                # agents answer over HTTP, one after another on their shared loop: a turn that went back at the same
                # time as this one is a few ms behind it; the idle engine waits that long so they decode together
                # rather than one engine step each
                wait(pending, timeout=AGENT_COALESCE_S, return_when=ALL_COMPLETED)
        out = []
        for tid in [t for t, (_, f, _) in self.waiting.items() if f.done()]:
            out.append(self._resolve(tid))
        return out

    def ended(self) -> list[Trajectory]:
        """Episodes whose environment step is done and ended them, final now; steps that go on to a next turn stay
        for ready(). Asked after an engine step: an agent that returned while the engine decoded (its last turn
        answered, runtime/agent_episodes.py) goes out with this step's report rather than the next one's, so its
        slot on the instance is not held for one more step and the driver's round trip."""
        out = []
        for tid in [t for t, (_, f, _) in self.waiting.items() if f.done() and _outcome(f).done]:
            out.append(self._resolve(tid))
        return out

    def finished(self, turns: list[Trajectory]) -> list[Trajectory]:
        """Of the turns an engine step finished, the trajectories whose episode is over (the others went to their
        environment)."""
        return [t for t in turns if not self.turn_ended(t)]

    def returned(self, engine, wait_s: float = 0.0) -> list[Trajectory]:
        """Environment steps that came back (waiting up to `wait_s` for the first): next turns go back to `engine`
        as continuations; returns the episodes the environment ended."""
        ended = []
        for traj in self.ready(wait_s):
            if traj.finish_reason:
                ended.append(traj)
            else:
                engine.start(traj)
        return ended

    def take(self, tid: str) -> Trajectory | None:
        """Hand back a trajectory waiting on its environment (an interrupt: migration, a weight sync): its step
        is awaited and applied, and the environment travels inside the trajectory. None if not waiting here."""
        return self._resolve(tid, timeout_s=ENV_STEP_TIMEOUT_S) if tid in self.waiting else None

    def leave(self, traj: Trajectory) -> None:
        """The trajectory leaves this instance mid-episode (interrupted on the engine): pack its environment."""
        env = self.envs.pop(traj.traj_id, None)
        if env is not None:
            traj.env_state = base64.b64encode(pickle.dumps(env)).decode()

    def drop(self, tid: str) -> bool:
        """Abort: forget the episode (a running step finishes in its thread and is ignored)."""
        env = self.envs.pop(tid, None)
        if self.deferred:
            self.form.close(env)
        return self.waiting.pop(tid, None) is not None

    def waiting_ids(self) -> list[str]:
        return list(self.waiting)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ internals
    def _resolve(self, tid: str, timeout_s: float | None = None) -> Trajectory:
        traj, future, since = self.waiting.pop(tid)
        result = _outcome(future, timeout_s)
        traj.env_s += time.monotonic() - since
        traj.env_reward += float(result.reward)
        if result.done:
            self._close(traj)
            traj.finish_reason = traj.finish_reason or "stop"
            return traj
        if not self._append(traj, result.observation):
            self._close(traj)
            traj.finish_reason = "length"  # the observation filled the episode's token budget
            return traj
        traj.turn_starts.append(len(traj.completion_ids))
        traj.finish_reason = ""
        return traj

    def _append(self, traj: Trajectory, text: str | list[int]) -> bool:
        """Append `text` as an environment segment; False when it did not fit in max_new_tokens (cut to fit).
        A list is token ids already (chat-form episodes: the template's tokens, runtime/chat_episodes.py)."""
        generated = len(traj.completion_ids) - len(traj.loss_mask)
        traj.loss_mask.extend([1] * generated)  # the turn just generated
        ids = list(text) if isinstance(text, list) else self.tokenizer.encode(text, add_special_tokens=False) if text else []
        room = self.max_new_tokens - len(traj.completion_ids)
        fits = len(ids) < room  # at least one token left for the next turn
        ids = ids[:max(0, room)]
        traj.completion_ids.extend(ids)
        traj.behaviour_logprobs.extend([0.0] * len(ids))
        traj.loss_mask.extend([0] * len(ids))
        return fits

    def _close(self, traj: Trajectory) -> None:
        """The episode is over: the mask covers every token, and the text is the whole transcript."""
        env = self.envs.pop(traj.traj_id, None)
        if self.deferred:
            self.form.close(env)
        traj.loss_mask.extend([1] * (len(traj.completion_ids) - len(traj.loss_mask)))
        traj.completion = self.tokenizer.decode(traj.completion_ids, skip_special_tokens=True)
        if traj.finish_reason == "stop" and traj.turn_start < len(traj.completion_ids):
            head = self.tokenizer.decode(traj.completion_ids[:traj.turn_start], skip_special_tokens=True)
            turn = self.tokenizer.decode(traj.completion_ids[traj.turn_start:], skip_special_tokens=True)
            traj.completion = head + cut_at_stop(turn, self.stop)[0]


def _outcome(future: Future, timeout_s: float | None = None) -> EnvStep:
    """An environment step's result; one that broke the step's contract, raised, or did not come within timeout_s
    ends the episode."""
    try:
        result = future.result(timeout=timeout_s)
        if not isinstance(result, tuple) or len(result) != 3:
            raise TypeError(f"step() returned {type(result).__name__}, not EnvStep(observation, reward, done)")
        return EnvStep(*result)
    except TimeoutError:  # asked for it (an interrupt) and it did not come: the episode ends here, complete
        return EnvStep(f"environment timed out after {timeout_s:.0f} s", 0.0, True)
    except Exception as e:  # noqa: BLE001 - the environment broke its contract (stages/environment.py): end the episode
        return EnvStep(f"environment error: {type(e).__name__}", 0.0, True)


def episodes_for(episode: dict | None, model_dir, engine_kwargs: dict) -> Episodes | None:
    """The Episodes of an actor whose plan entry has an `episode` (plan.py `_episode`); None for single-turn."""
    if not episode:
        return None
    from transformers import AutoTokenizer

    from rlflow import registry

    tokenizer, form = AutoTokenizer.from_pretrained(model_dir), None
    if episode.get("agent"):  # an agent program drives the conversation through the endpoint
        import ray

        from rlflow.runtime.agent_episodes import AgentForm
        from rlflow.runtime.agent_gateway import GatewayClient

        client = GatewayClient(ray.get_actor(episode["gateway"]))
        form = AgentForm(episode, tokenizer, client, engine_kwargs["max_new_tokens"])
        # a thread per episode on the instance, not per running slot: an episode waiting for its agent holds its
        # thread (blocked on the endpoint, no CPU) for as long as the agent thinks, and more episodes than max_running
        # can be on an instance (the engine's queue)
        return Episodes(None, {}, max_turns=episode["max_turns"], tokenizer=tokenizer, form=form,
                        max_new_tokens=engine_kwargs["max_new_tokens"], stop=(), threads=MAX_AGENT_THREADS)
    if episode.get("tools"):  # chat form: tool calls parsed, observations in the chat template's tokens
        from rlflow.runtime.chat_episodes import ChatForm

        form = ChatForm(episode, tokenizer)
    return Episodes(form.env_cls if form else registry.resolve("env", episode["env"]),
                    form.env_kwargs if form else episode.get("env_kwargs", {}),
                    max_turns=episode["max_turns"], tokenizer=tokenizer, form=form,
                    max_new_tokens=engine_kwargs["max_new_tokens"], stop=tuple(engine_kwargs.get("stop", ())),
                    # one thread per trajectory the engine may run, so a slow (I/O-bound) tool never queues behind
                    # others; CPU-bound ones (the sandbox) share the cores either way
                    threads=min(MAX_ENV_THREADS, engine_kwargs.get("max_running", 8)))
