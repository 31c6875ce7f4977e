"""The messages that cross a hop of the runtime, each a small frozen dataclass: who sends it to whom, what it holds.

A trajectory's path, with the message on each hop (sender -> receiver: message):

  prompt_source.PromptSource.next -> rollout_fleet: Prompt (the ledger keeps it as JSON, to replay it on resume)
  rollout_fleet -> trajectory_server: one Trajectory (stages/trajectory.py) per member of the prompt's group
  rollout_fleet -> rollout_worker: the routed Trajectory objects, in the step call with the commands (abort and
      interrupt ids, a pull)
  rollout_worker -> payload_store: the finished Trajectory objects (the store keeps them until they are trained
      or dropped; the buffer peeks at them for the ledger, which keeps them as JSON)
  rollout_worker -> rollout_fleet: StepReport (a FinishedMeta per finished trajectory; interrupted Trajectory objects;
      the engine's EngineSnapshot and, after a pull, its WeightsLoaded: stages/engine.py)
  payload_store -> reward_stream: GroupToScore per complete group; inside Ray Data it travels as an Arrow row
      (`as_row`: the stream's own business)
  reward_stream -> driver -> buffer: ScoredBatch (a ScoredTrajectory per member of whole groups)
  buffer.consume -> driver -> train_sink: TrainBatch
  train_sink -> trainer_worker: TrainStep (ids, rewards, version); rank 0 takes the Trajectory objects from the store
      and answers with a StepResult
  evaluation (driver) -> Evaluator actor: EvalTask per task (its EvalPrompt rows, tokenized in the driver)

The driver's loop (driver.Run._handle) receives one union of run events, RunEvent, on one queue: StepDone,
Joined, Trained and Evaluated when a call a component started ends (the component returns it as Started, the
driver puts it on the queue with the call's future), Rewarded and StreamFailed from the reward streams.

Plain data (lists, not tensors) with slots: they pickle small across Ray's object store.
"""

from __future__ import annotations

import json
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field

from rlflow.stages.engine import EngineSnapshot, WeightsLoaded
from rlflow.stages.trajectory import Trajectory


@dataclass(frozen=True, slots=True)
class Prompt:
    """One drawn prompt: prompt_source.PromptSource.next -> rollout_fleet (a group of its members), and the ledger,
    which stores it as JSON (`to_json`) and gives it back on resume (`from_json`) to generate it again."""

    task: str  # the task type (plan["tasks"]) it was drawn from
    n: int  # its draw number within the task (0, 1, ...): the group id is f"{task}-{n}"
    prompt: str  # the prompt text (the row's prompt field)
    answer: str = ""  # the reference answer (the row's answer field), for the reward function
    prompt_ids: list[int] = field(default_factory=list)  # the prompt as token ids (formatted as the task says)
    row: dict = field(default_factory=dict)  # the whole data row, its original columns, for reward functions

    @property
    def group_id(self) -> str:
        return f"{self.task}-{self.n}"

    def to_json(self) -> dict:
        """The ledger's JSON object: {"task", "n", "prompt", "answer", "prompt_ids", "row"}."""
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> Prompt:
        return cls(**{k: obj[k] for k in cls.__dataclass_fields__ if k in obj})


@dataclass(frozen=True, slots=True)
class FinishedMeta:
    """A trajectory an instance finished, as the driver hears of it (its payload went to the payload store first):
    rollout_worker -> rollout_fleet, inside a StepReport."""

    group_id: str
    index: int  # member index within the group
    version: int  # V_traj: the oldest weights version that generated any of its tokens
    finish_reason: str  # "stop" | "length" | "abort" | "interrupt"
    tokens: int  # completion tokens (environment segments included)
    turns: int = 1  # generated turns (multi-turn episodes; 1 otherwise)
    env_tokens: int = 0  # completion tokens the environment wrote (loss mask 0)
    env_s: float = 0.0  # seconds the episode waited on its environment


@dataclass(frozen=True, slots=True)
class StepReport:
    """What one step call returns: rollout_worker.RolloutWorker.step -> rollout_fleet.RolloutFleet.on_step."""

    instance: int  # the instance's index in its stage
    finished: list[FinishedMeta]  # trajectories finished in this step, payloads already in the store
    interrupted: list[Trajectory]  # partial trajectories handed back, to go back to the TS
    snapshot: EngineSnapshot  # the engine's snapshot (StaleFlow §5.2): version, run_trajs, complete_trajs, ...
    busy_s: float  # seconds in engine.step (decoding)
    pull_s: float  # seconds loading weights
    idle: bool  # nothing left to generate (and no episode waiting on its environment)
    loaded: WeightsLoaded | None = None  # after a pull: the engine's report of what it loaded
    asleep: int = 0  # the level the engine sleeps at after this step (0: awake)
    slept_freed: int = 0  # bytes the engine freed when it went to sleep in this step
    held: dict | None = None  # the engine's held_bytes() before it slept, when it slept in this step


@dataclass(frozen=True, slots=True)
class GroupToScore:
    """A complete group, light fields only (no token ids): payload_store.PayloadStore.next_groups -> the reward
    stream's read task, which hands it to Ray Data as one Arrow row (`as_row`)."""

    group_id: str
    task: str
    prompt: str
    answer: str
    row: dict  # the prompt's data row, for reward functions
    traj_id: list[str]  # the members, in order
    completion: list[str]  # each member's decoded completion
    v_min: list[int]  # each member's version span (Trajectory.version_span), passed through to the driver's ledger
    v_max: list[int]
    agent: list[str]  # each member's agent result as JSON ("" when none): the reward function's row["agent"]
    rollout_error: list[str]  # each member's rollout failure by name ("" when none): it is then not scored

    @classmethod
    def of(cls, members: list[Trajectory]) -> GroupToScore:
        first, spans = members[0], [m.version_span() for m in members]
        return cls(first.group_id, first.task, first.prompt, str(first.answer), first.row or {},
                   [m.traj_id for m in members], [m.completion for m in members],
                   [lo for lo, _ in spans], [hi for _, hi in spans], [m.agent_result for m in members],
                   [m.rollout_error for m in members])

    def as_row(self) -> dict:
        """The Arrow row: the data row as JSON (its columns differ from task to task, Arrow wants one schema)."""
        return {**asdict(self), "row": json.dumps(self.row, default=str)}


@dataclass(frozen=True, slots=True)
class ScoredTrajectory:
    """One trajectory of a scored group, inside a ScoredBatch."""

    traj_id: str
    group_id: str
    task: str
    reward: float  # nan when the reward function failed on it
    reward_error: str  # "" or why its reward failed (the trajectory is then failed)
    kept: bool  # the group filter's verdict on its group (False: filtered, e.g. uniform rewards)
    v_min: int | None = None  # its version span (the payload store's record), for the ledger; None when not carried
    v_max: int | None = None


@dataclass(frozen=True, slots=True)
class ScoredBatch:
    """Whole scored groups, one row per trajectory: reward_stream (the Ray Data stream's output, converted at its
    edge by `from_columns`) -> the driver, inside a Rewarded event -> buffer.Buffer.rewarded_batch."""

    rows: list[ScoredTrajectory]

    @classmethod
    def from_columns(cls, columns: dict[str, list]) -> ScoredBatch:
        """From the stream's columnar batch (reward_stream.per_trajectory): equal-length lists per field."""
        names = [f for f in ScoredTrajectory.__dataclass_fields__ if f in columns]
        return cls([ScoredTrajectory(**dict(zip(names, values, strict=True)))
                    for values in zip(*(columns[f] for f in names), strict=True)])

    def group_ids(self) -> set[str]:
        return {r.group_id for r in self.rows}


@dataclass(frozen=True, slots=True)
class TrainBatch:
    """The groups of one train step: buffer.Buffer.consume -> the driver, which records it in the ledger ->
    train_sink.TrainSink.start, which sends its ids, rewards and version to the trainer's rank 0."""

    policy_batch: object  # the staleness policy's batch (operators/policy.py): version, entries, staleness()
    rewards: dict[str, float]  # traj_id -> reward, for every trajectory trained
    groups: dict[str, list[str]]  # gid -> its member traj ids

    @property
    def version(self) -> int:
        """The trainer version this batch trains (its staleness counts from it)."""
        return self.policy_batch.version


@dataclass(frozen=True, slots=True)
class TrainStep:
    """One step's order: train_sink.TrainSink.start -> trainer_worker.TrainerWorker.train (rank 0), which takes the
    members' payloads from the payload store and publishes version + 1."""

    rewards: dict[str, float]  # traj_id -> reward, for every trajectory trained (its keys: what to take)
    group_size: int  # members per group (the batch is checked against it)
    version: int  # the version the batch trains; the step publishes version + 1

    @property
    def traj_ids(self) -> list[str]:
        return list(self.rewards)


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one train step reports: trainer_worker.TrainerWorker.train -> train_sink.TrainSink."""

    metrics: dict[str, float]  # loss, kl, grad_norm, tokens, ... (stages/trainer.py; merged over the ranks)
    nonfinite: str  # the worst rank's verdict: "" | "skipped" | "poisoned" (stages/step_checks.py NONFINITE_ORDER)
    sync_s: float  # seconds publishing the new weights (0 when poisoned: never published)
    ranks: int  # data-parallel ranks that trained it


@dataclass(frozen=True, slots=True)
class EvalPrompt:
    """One held-out prompt, tokenized in the driver (evaluation.encode), scored by the Evaluator actor."""

    prompt: str
    answer: str
    row: dict  # the whole data row, for reward functions
    prompt_ids: list[int]
    answer_tokens: int  # the reference answer's length in tokens (its bucket in the metrics)


@dataclass(frozen=True, slots=True)
class EvalTask:
    """One task's held-out set and settings: evaluation.prepare (driver) -> the Evaluator actor."""

    rows: list[EvalPrompt]
    reward_fn: object  # a registry name or module:function (the actor resolves it), or the function itself
    temperature: float
    max_new_tokens: int


# ---------------------------------------------------------------- run events: the driver's queue (driver.Run._handle)
# The first four end a Ray call; `future` is that call's outcome (result() or exception()), set by the driver
# (Run._submit) when the call completes: the component that started the call leaves it None.


@dataclass(frozen=True, slots=True)
class StepDone:
    """A rollout instance's step call ended: rollout_fleet.RolloutFleet.send -> driver -> RolloutFleet.on_step."""

    fleet: object  # rollout_fleet.RolloutFleet
    inst: object  # rollout_fleet.RolloutInstance whose step it was
    future: Future | None = None  # a StepReport, or what killed the instance


@dataclass(frozen=True, slots=True)
class Joined:
    """An added rollout instance's actor is ready, or failed to start: rollout_fleet.RolloutFleet.scale_to -> driver
    -> RolloutFleet.on_joined."""

    fleet: object  # rollout_fleet.RolloutFleet
    inst: object  # rollout_fleet.RolloutInstance that was starting
    future: Future | None = None  # its ready() call: exception() is why it did not start


@dataclass(frozen=True, slots=True)
class Trained:
    """A train step ended: train_sink.TrainSink.start -> driver -> Run._on_trained (a StepResult)."""

    future: Future | None = None  # a StepResult, or what killed the trainer


@dataclass(frozen=True, slots=True)
class Evaluated:
    """An evaluation of the weights of `step` ended: evaluation.Evaluations.submit -> driver -> Evaluations.result."""

    step: int
    future: Future | None = None  # its metrics, or why the evaluator failed


@dataclass(frozen=True, slots=True)
class Rewarded:
    """Whole groups scored: reward_stream (its stage's stream) -> driver -> buffer.Buffer.rewarded_batch."""

    stage: str  # the reward stage that scored them
    batch: ScoredBatch


@dataclass(frozen=True, slots=True)
class StreamFailed:
    """A reward stream stopped (its reward failing too often, a hung scorer, a dead host): reward_stream -> driver,
    which stops the run naming the stage."""

    stage: str
    error: Exception  # one line saying why, shown after "reward stage '<stage>' failed: "


#: what the driver's loop receives (None: a coordinator cycle came due instead)
RunEvent = StepDone | Joined | Trained | Evaluated | Rewarded | StreamFailed


@dataclass(frozen=True, slots=True)
class Started:
    """A Ray call a component started and the event that will say it ended: rollout_fleet / train_sink / evaluation
    -> driver, which puts `done`, with the call's future, on its queue when `ref` completes (Run._submit)."""

    ref: object  # the call's ray.ObjectRef
    done: StepDone | Joined | Trained | Evaluated
