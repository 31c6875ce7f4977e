"""The compiled plan (plan.json) as a typed object: `plan.trainer`, `plan.rollouts()`, `plan.staleness`.

Same JSON on disk: `Plan.model_validate(d).model_dump(mode="json", exclude_unset=True)` is `d`, key for key and in
order (the fields are declared in the order rlflow/plan.py writes them; what a part does not name rides along as
an extra). `read_plan` (rlflow/compiler.py) returns one; `Plan.of` types a freshly compiled dict once where it
enters (`launch`, the simulator, `tune`), and keeps the dict (`plan.raw`: what an export or MLflow copies as written;
`plan["..."]` for code that still reads it by key). Light on purpose: pydantic only.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

Number = int | float  # as written: an int stays an int, so the JSON round-trips byte for byte

__all__ = ["Plan", "PlanOutdated", "RolloutActor", "TrainerActor", "EvaluatorActor", "ServerActor", "ReadOperator", "RewardOperator", "FilterOperator",
           "Staleness", "Task", "ValidationError"]


class _Part(BaseModel):
    """A part of the plan: its declared fields typed, anything else kept as written."""

    model_config = ConfigDict(extra="allow")

    def get(self, key: str, default: Any = None) -> Any:
        """The value written under `key`, else `default` (as dict.get: a field the plan did not write is absent)."""
        return getattr(self, key) if key in self else default

    def __contains__(self, key: str) -> bool:
        return key in self.model_fields_set or key in (self.__pydantic_extra__ or {})

    def __getitem__(self, key: str) -> Any:
        if key not in self:
            raise KeyError(key)
        return getattr(self, key)


class RolloutActor(_Part):
    """One instance of a rollout stage (rlflow/runtime/rollout_worker.py)."""

    name: str
    role: Literal["rollout"]
    stage: str
    index: int
    engine: str
    num_cpus: Number
    num_gpus: Number
    tasks: list[str]
    engine_kwargs: dict[str, Any]
    group_size: int
    group_redundancy: int = 0
    resources: dict[str, Number] = {}
    episode: dict[str, Any] | None = None  # multi-turn stages only (rlflow/runtime/episodes.py)
    elastic: dict[str, Any] | None = None  # elastic stages only (rlflow/runtime/scaling.py)
    sleep_level: int = 0  # sleep during each train step at this level (0: never; rlflow/devices.py sleep_plan)
    sleep_reason: str = ""  # why it sleeps or not, as the plan summary prints it
    threads: int | str = 1  # CPU threads of its engine: a number or "cores" (rlflow/devices.py thread_plan)
    threads_share: int = 1  # "cores": the node's cores divided among this many instances
    threads_reason: str = ""  # why, as the plan summary prints it


class TrainerActor(_Part):
    """The train stage (rlflow/runtime/trainer_worker.py), `replicas` ranks."""

    name: str
    role: Literal["trainer"]
    stage: str
    replicas: int = 1
    num_cpus: Number
    num_gpus: Number
    deepspeed: str | None = None
    trainer_kwargs: dict[str, Any]
    steps: int
    checkpoint_every: int | None = None
    keep_checkpoints: int | None = None  # a plan from before it: keep all
    resources: dict[str, Number] = {}
    stall_factor: Number | None = None
    no_progress_groups: int | None = None
    on_nonfinite: str | None = None
    save_every: int = 0
    weights: dict[str, Any] | None = None  # how versions leave the trainer (plan.weight_transport)
    threads: int | str = 1  # CPU threads of each rank: a number or "cores" (rlflow/devices.py thread_plan)
    threads_share: int = 1  # "cores": the node's cores divided among this many ranks
    threads_reason: str = ""  # why, as the plan summary prints it


class EvaluatorActor(_Part):
    """Held-out scoring on an engine of its own (rlflow/runtime/evaluation.py)."""

    episode: dict[str, Any] | None = None  # written first: the evaluator's episode is the first rollout stage's
    name: str
    role: Literal["evaluator"]
    stage: str
    engine: str
    num_cpus: Number
    num_gpus: Number
    resources: dict[str, Number] = {}
    engine_kwargs: dict[str, Any]
    every: int
    size: int | None = None
    k: int = 1
    seed: int | None = None
    tasks: dict[str, dict[str, Any]]


class ServerActor(_Part):
    """A control-plane server: the payload store (rlflow/runtime/payload_store.py) or the parameter server."""

    name: str
    role: Literal["payload_store", "parameter_server"]
    stage: None = None
    num_cpus: Number
    num_gpus: Number
    resources: dict[str, Number] = {}  # never written: servers take a sliver of a CPU anywhere


Actor = Annotated[RolloutActor | TrainerActor | EvaluatorActor | ServerActor, Field(discriminator="role")]


class Task(_Part):
    """A task type: where its prompts come from, and the rollout, reward and filter it flows through."""

    source: str
    weight: Number | None = None
    limit: int | None = None
    prompt_field: str
    answer_field: str | None = None
    prompt_format: str = "raw"
    system_prompt: str | None = None
    split: str | None = None
    rollout: str
    reward: str
    filter: str | None = None
    holdout: Number | None = None


class ReadOperator(_Part):
    """Reads one task's prompts into its rollout stage (rlflow/runtime/prompt_source.py)."""

    name: str
    kind: Literal["read"]
    task: str
    source: str
    weight: Number | None = None
    limit: int | None = None
    prompt_field: str
    answer_field: str | None = None
    seed: int | None = None
    to: str


class RewardOperator(_Part):
    """A reward stage: scores its tasks' trajectories (rlflow/runtime/reward_stream.py)."""

    name: str
    kind: Literal["reward"]
    stage: str
    fn: str | None  # the stage's function reward (held-out evaluation's too); None: it scores with scorers only
    tasks: list[str]
    concurrency: int = 1
    num_cpus: Number = 1
    resources: dict[str, Number] = {}
    scorers: list[dict[str, Any]] = []  # model / judge / http / weighted parts (rlflow/reward_scorers.py); []: fn alone
    batch_size: int = 16
    num_gpus: Number = 0


class FilterOperator(_Part):
    """A filter on the streaming edge after reward stage `after`."""

    name: str
    kind: Literal["filter"]
    after: str
    fn: str


DataOperator = Annotated[ReadOperator | RewardOperator | FilterOperator, Field(discriminator="kind")]


class Staleness(_Part):
    """The edge policy into train, as operators.policy_kinds.make_policy arguments (batch in groups)."""

    kind: str
    batch_size: int
    eta: int | None = None
    capacity: int | None = None
    batch_redundancy: int | Literal["auto"] = 0  # auto: the runtime buffer adapts it (rlflow/runtime/buffer.py)


class Control(_Part):
    staleness: Staleness
    coordination: dict[str, dict[str, Any]]  # per rollout stage; read through plan_read.stage_coordination


class Resources(_Part):
    num_cpus: Number
    num_gpus: Number
    cluster: dict[str, Any]


class Graph(_Part):
    order: list[str]
    nodes: list[dict[str, Any]]
    edges: list[dict[str, Any]]


class PlanOutdated(ValueError):
    """plan.json is not the shape this rlflow writes: written by an older rlflow, or edited by hand."""


class Plan(_Part):
    """A compiled plan (rlflow/plan.py `lower`)."""

    plan_version: int
    rlflow_version: str
    name: str
    source: str
    source_sha256: str
    overrides: list[str] = []
    pipeline: dict[str, Any]  # the resolved pipeline, every default filled in (rlflow/schema.py's shape)
    graph: Graph
    tasks: dict[str, Task]
    actors: list[Actor]
    data_operators: list[DataOperator]
    control: Control
    prediction: dict[str, Any]
    resources: Resources
    python_path: list[str] = []  # directories user code imports from (rlflow/compiler.py)
    devices: dict[str, Any] | None = None  # where each stage runs (rlflow/devices.py)
    tool_parsers: dict[str, dict[str, str]] = {}  # stage -> the tool_parser compile picked from the chat template

    _raw: dict = PrivateAttr(default_factory=dict)

    @classmethod
    def of(cls, plan: dict | Plan) -> Plan:
        """`plan` typed: validated once, keeping the dict it came from; a Plan as it is."""
        if isinstance(plan, Plan):
            return plan
        typed = cls.model_validate(plan)
        typed._raw = plan
        return typed

    @classmethod
    def checked(cls, plan: Any) -> Plan:
        """`plan` typed, or PlanOutdated naming what is missing or mistyped (the first five)."""
        try:
            return cls.of(plan)
        except ValidationError as e:
            errors = e.errors()
            said = "; ".join(f"{'.'.join(map(str, err['loc'])) or '(top)'}: {err['msg'].lower()}" for err in errors[:5])
            more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
            raise PlanOutdated(f"not the shape of plan this rlflow writes (an older rlflow's?): {said}{more}") from None

    @property
    def raw(self) -> dict:
        """The plan as a dict: the one it was read from, else its JSON."""
        return self._raw or self.model_dump(mode="json", exclude_unset=True)

    def __getitem__(self, key: str) -> Any:  # the dict's value, for code that still reads the plan by key
        return self.raw[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)

    def __contains__(self, key: str) -> bool:
        return key in self.raw

    # ------------------------------------------------------------------ accessors
    @property
    def trainer(self) -> TrainerActor:
        return next(a for a in self.actors if a.role == "trainer")

    @property
    def evaluator(self) -> EvaluatorActor | None:
        return next((a for a in self.actors if a.role == "evaluator"), None)

    @property
    def parameter_server(self) -> ServerActor:
        return next(a for a in self.actors if a.role == "parameter_server")

    @property
    def payload_store(self) -> ServerActor:
        return next(a for a in self.actors if a.role == "payload_store")

    def rollouts(self, stage: str | None = None) -> list[RolloutActor]:
        """The rollout instances, of every stage or of `stage`, in plan order."""
        return [a for a in self.actors if a.role == "rollout" and (stage is None or a.stage == stage)]

    def rollout_stages(self) -> list[str]:
        """The rollout stages in graph order: the order `rlflow run` and the simulator create their fleets in."""
        return [n["name"] for n in self.graph.nodes if n["kind"] == "rollout"]

    def reward_operators(self) -> list[RewardOperator]:
        return [op for op in self.data_operators if op.kind == "reward"]

    def filters(self) -> dict[str, str]:
        """The filter function after each reward stage that has one."""
        return {op.after: op.fn for op in self.data_operators if op.kind == "filter"}

    def max_new_tokens(self) -> dict[str, int]:
        """Each task's max_new_tokens: its rollout stage's."""
        return {t: a.engine_kwargs["max_new_tokens"] for a in self.rollouts() for t in a.tasks}

    @property
    def staleness(self) -> Staleness:
        return self.control.staleness

    @property
    def model(self) -> dict[str, Any]:
        """The pipeline's model block (path, dtype, max_model_len, ...)."""
        return self.pipeline["model"]
