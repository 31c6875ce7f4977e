"""OpenEnv environments as rlflow environments, and their rubrics as rewards: `openenv:package.module:EnvClass`.

An OpenEnv environment (openenv-core) is a server-side class with Gym's API: `reset(**kwargs) -> Observation`,
`step(Action) -> Observation`, the reward and `done` carried on the observation, and an optional `rubric(action,
observation)` that computes the reward. The adapter runs the class in-process, one instance per episode (no HTTP
server, no container), and translates text both ways:

- the turn's text becomes the Action: its one required text field (`CalcAction(text=...)`); the Action class is
  the first type argument of `Environment[Action, Observation, State]`, else the annotation of step's `action`;
- the observation becomes the text appended (not trained): its fields other than done / reward / metadata, one
  text field as is, several as JSON; its reward adds to the trajectory's env_reward, its `done` ends the episode;
- `reset` gets the row's columns that it names as parameters (`answer`, `prompt`, ...), and its observation's text
  goes before turn 1.

As a reward (`fn: "openenv:..."`), a fresh instance is reset for the row and stepped once with the whole completion
(the transcript, for multi-turn stages): the reward its step reports, else its rubric's score.

Instances travel inside trajectories between rollout instances (stages/environment.py), so the OpenEnv class must
be picklable; one holding a connection or a container is run behind its own server instead.
"""

from __future__ import annotations

import functools
import inspect
import json
import typing

from rlflow.stages.environment import Environment, EnvStep

INSTALL = "pip install openenv-core (or rlflow's `ecosystem` extra: pip install 'rlflow[ecosystem]')"
RESET_OWN = ("self", "seed", "episode_id")  # reset parameters an episode never fills from the row
NOT_TEXT = ("done", "reward", "metadata")  # Observation fields that are not the observation's text


def adapt(category: str, target: str):
    """The env factory or reward function for an `openenv:` reference (registry.ADAPTERS); ComponentError when the
    target is not an OpenEnv Environment that takes text."""
    from rlflow.registry import ComponentError

    if category == "task":
        raise ComponentError(f"'openenv:{target}' has no prompts to read: an OpenEnv environment is stepped, not read; "
                             "give data.source a builtin task or a file, and the environment to the rollout stage's "
                             "env", "openenv-has-no-rows")
    env_class(target)  # imports and checks it now: compile names the problem
    return functools.partial(OpenEnvEpisode, target) if category == "env" else OpenEnvReward(target)


@functools.cache
def env_class(target: str) -> tuple[type, type, str]:
    """(the Environment class, its Action class, the Action's text field) of a target, checked."""
    from rlflow.registry import ComponentError, _import

    try:
        from openenv.core.env_server.interfaces import Environment as OpenEnvEnvironment
        from openenv.core.env_server.types import Action
    except ImportError:
        raise ComponentError(f"'openenv:{target}' needs openenv-core, which is not installed; {INSTALL}",
                             "missing-package") from None
    cls = _import(target)
    if not (inspect.isclass(cls) and issubclass(cls, OpenEnvEnvironment)) or inspect.isabstract(cls):
        raise ComponentError(f"'{target}' is not a concrete OpenEnv Environment class; point at a class that "
                             "subclasses openenv.core.env_server.interfaces.Environment and implements reset, step and "
                             "state", "not-an-env")
    action = _action_class(cls, OpenEnvEnvironment, Action)
    if action is None:
        raise ComponentError(f"cannot tell the Action class of '{target}'; declare it: class "
                             f"{cls.__name__}(Environment[MyAction, MyObservation, State]), or annotate "
                             "step(self, action: MyAction)", "not-an-env")
    texts = [name for name, f in action.model_fields.items()
             if name != "metadata" and f.annotation is str and f.is_required()]
    if len(texts) != 1:
        raise ComponentError(f"'{target}' takes {action.__name__} actions, with {len(texts)} required text fields "
                             f"({', '.join(texts) or 'none'}); rlflow passes the turn's text as the one required str "
                             "field: wrap the environment with an Action of one text field", "not-an-env")
    return cls, action, texts[0]


def _action_class(cls: type, base: type, action: type) -> type | None:
    for klass in cls.__mro__:
        for orig in getattr(klass, "__orig_bases__", ()):
            origin, args = typing.get_origin(orig), typing.get_args(orig)
            if inspect.isclass(origin) and issubclass(origin, base) and args and inspect.isclass(args[0]) \
                    and issubclass(args[0], action):
                return args[0]
    try:
        hinted = typing.get_type_hints(cls.step).get("action")
    except Exception:  # noqa: BLE001 - unresolvable annotations: no hint
        hinted = None
    return hinted if inspect.isclass(hinted) and issubclass(hinted, action) else None


def reset_kwargs(cls: type, row: dict) -> dict:
    """The row's columns that the class's reset names as parameters."""
    params = inspect.signature(cls.reset).parameters
    named = [n for n, p in params.items() if n not in RESET_OWN and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return {n: row[n] for n in named if n in row}


def observation_text(observation) -> str:
    """An Observation as the text appended: its fields other than done / reward / metadata."""
    fields = observation.model_dump(exclude=set(NOT_TEXT))
    if not fields:
        return ""
    if len(fields) == 1 and isinstance(next(iter(fields.values())), str):
        return next(iter(fields.values()))
    return json.dumps(fields, default=str)


class OpenEnvEpisode(Environment):
    """One episode of an OpenEnv environment, as rlflow's Environment (env_kwargs go to the class's constructor)."""

    def __init__(self, target: str, **env_kwargs):
        self.target = target
        self.env = env_class(target)[0](**env_kwargs)

    def reset(self, row: dict) -> str:
        return observation_text(self.env.reset(**reset_kwargs(type(self.env), row)))

    def step(self, action: str) -> EnvStep:
        _, action_cls, field = env_class(self.target)
        observation = self.env.step(action_cls(**{field: action}))
        return EnvStep(observation_text(observation), float(observation.reward or 0.0), bool(observation.done))


class OpenEnvReward:
    """fn(completion, answer, prompt, row) -> the environment's reward for the completion as one action."""

    def __init__(self, target: str):
        self.target = target
        self.__name__ = f"openenv:{target}"

    def __call__(self, completion: str, answer: str, prompt: str, row: dict) -> float:
        cls, action_cls, field = env_class(self.target)
        env = cls()
        env.reset(**reset_kwargs(cls, (row or {}) | {"prompt": prompt, "answer": answer}))
        action = action_cls(**{field: completion})
        observation = env.step(action)
        reward = observation.reward
        if reward is None and env.rubric is not None:
            reward = env.rubric(action, observation)
        if reward is None or inspect.isawaitable(reward):
            raise ValueError(f"{cls.__name__}.step reported no reward and it has no synchronous rubric")
        return float(reward)
