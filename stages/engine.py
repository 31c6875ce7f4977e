"""The rollout-engine interface: what the Ray runtime (and the simulator's fake) drive.

One engine instance holds a waiting list and a running set of trajectories. The runtime calls
`start` to route work here, `step` in a loop to advance generation, `interrupt`/`abort` to take
work away, `load_weights` to pull a new policy version, and `snapshot` for the coordinator.

Behaviour log-prob convention (the trainer must match it): log-softmax of logits / temperature,
the distribution actually sampled from, at the sampled token. With top_p == 1 that is exact;
with top_p < 1 the token is drawn from the nucleus but the recorded log-prob is still that of
the untruncated tempered distribution. temperature == 0 means greedy; its log-probs are then
those of the untempered distribution (log-softmax of the raw logits).

Completion ids include the eos token when the trajectory stops on it (with its log-prob); the
decoded `completion` text does not.

Stop strings (`stop`) follow the same rule, on both engines: a trajectory ends (finish_reason "stop") at the
token whose decoding first makes the completion text contain a stop string. That token, and every token before
it, stays in completion_ids with its log-prob (the policy is trained on ending there, as on eos); nothing after
it is generated. The `completion` text ends just before the stop string (vLLM's include_stop_str_in_output=False):
it is decode(completion_ids) cut at the first occurrence of a stop string. Text is decoded with special tokens
skipped, so a stop string never matches a special token (use eos for those).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from rlflow.stages.trajectory import Trajectory

FINISH_REASONS = ("stop", "length", "abort", "interrupt")


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """What an instance holds between two steps (StaleFlow §5.2, Figure 11: the coordinator's view of it):
    `RolloutEngine.snapshot` -> rollout_worker -> the rollout fleet and its coordinator, inside a StepReport."""

    instance: int
    version: int  # the weights version it generates from
    kv_cache: int  # KV tokens of the running trajectories
    run_trajs: list[str]  # traj ids generating
    wait_trajs: list[str]  # traj ids routed here, not started
    complete_trajs: int  # trajectories it completed so far
    max_running: int  # how many it runs at once
    env_trajs: list[str] = field(default_factory=list)  # multi-turn: between turns, on their environment (the worker's)
    scheduler: dict[str, float] | None = None  # vLLM's own view: running, waiting, kv_cache_usage (fraction)
    # cumulative since the engine started, for the in-run cost model (runtime/sim_inputs.py): decode iterations of
    # the whole batch, and tokens they produced (one per running row per iteration); 0 where an engine cannot count
    decode_steps: int = 0
    decoded_tokens: int = 0


@dataclass(frozen=True, slots=True)
class WeightsLoaded:
    """An engine's report of a weights load: `RolloutEngine.load_weights` -> the driver, which checks it
    (parameter_server.verify_loaded) against what was published."""

    version: int
    checksum: str  # stages/checksum.py over the tensors as the engine holds them (or as handed over, see vLLM's)
    missing: list[str] = field(default_factory=list)  # parameters the engine knows it did not load


def cut_at_stop(text: str, stop) -> tuple[str, bool]:
    """(text before the first of the `stop` strings, True) if `text` contains one, else (text, False)."""
    found = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[: min(found)], True) if found else (text, False)


def weight_buckets(state: Mapping[str, Any] | Iterable[Mapping[str, Any]]) -> Iterator[Mapping[str, Any]]:
    """What `load_weights` is given, as buckets: one name -> array mapping is a single bucket."""
    if isinstance(state, Mapping):
        yield state
    else:
        yield from state


class EngineDied(RuntimeError):
    """The engine can no longer generate (e.g. vLLM's engine-core process died). The Ray worker exits on it,
    so the driver treats the instance as dead and re-routes its trajectories (fault isolation)."""


class RolloutEngine(abc.ABC):
    """A rollout instance: waiting list + running set, advanced by `step`, pulled to new weights."""

    def __init__(
        self,
        model_dir: str,
        *,
        instance_id: int = 0,
        max_running: int = 64,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int = 0,
        dtype: str = "float32",
        max_model_len: int = 512,
        stop: list[str] | tuple[str, ...] = (),
        max_turn_tokens: int | None = None,
    ):
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if max_new_tokens >= max_model_len:
            raise ValueError(
                f"max_new_tokens ({max_new_tokens}) leaves no room for a prompt within max_model_len "
                f"({max_model_len}); raise max_model_len or lower max_new_tokens"
            )
        self.model_dir = str(model_dir)
        self.instance_id = instance_id
        self.max_running = max_running
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.seed = seed
        self.dtype = dtype
        self.max_model_len = max_model_len
        if any(not isinstance(x, str) or not x for x in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        self.stop = tuple(stop)
        if max_turn_tokens is not None and max_turn_tokens < 1:
            raise ValueError(f"max_turn_tokens must be >= 1 (or None: no per-turn limit), got {max_turn_tokens}")
        self.max_turn_tokens = max_turn_tokens
        self._version = 0

    @property
    def version(self) -> int:
        """The weights version this instance generates with now."""
        return self._version

    @property
    @abc.abstractmethod
    def idle(self) -> bool:
        """True when nothing is running or waiting."""

    @abc.abstractmethod
    def start(self, traj: Trajectory) -> None:
        """Route a trajectory here (queued); a non-empty completion_ids is a partial one to resume."""

    @abc.abstractmethod
    def step(self) -> list[Trajectory]:
        """Admit waiting work, advance generation one chunk, return the trajectories that finished."""

    @abc.abstractmethod
    def interrupt(self, traj_id: str) -> Trajectory | None:
        """Stop a trajectory and return it partial (finish_reason "interrupt"), or None if unknown."""

    @abc.abstractmethod
    def abort(self, traj_id: str) -> bool:
        """Drop a trajectory and free its slot; False if it was not here."""

    @abc.abstractmethod
    def load_weights(self, state: Mapping[str, Any] | Iterable[Mapping[str, Any]], version: int) -> WeightsLoaded:
        """Pull new weights in place: name -> numpy array or torch tensor, or an iterable of such buckets
        (`weight_buckets`; each bucket's tensors may be read-only views valid only until the next bucket is
        asked for, so copy them as they come); later tokens come from `version`. Returns what was loaded
        (WeightsLoaded): the checksum (stages/checksum.py) over the same names, computed from the engine's own copy read back after
        the load wherever the engine can, so the driver catches a tensor skipped or corrupted on the way. An
        engine that can only check names reports in `missing` the parameters it knows were not loaded."""

    @abc.abstractmethod
    def snapshot(self) -> EngineSnapshot:
        """The coordinator's view of this instance."""

    # -- colocation: sleep during a train step, wake after (runtime/rollout_worker.py) -------------------------

    #: whether `sleep` / `wake_up` are implemented (compile rule sleep-unsupported checks it)
    supports_sleep = False
    #: sleep levels, as vLLM's: 1 keeps the weights (off the device where there is one), drops the KV cache; 2 drops
    #: both, so the next version must be loaded before generating again
    SLEEP_LEVELS = (1, 2)

    @property
    def asleep(self) -> int:
        """The level this engine sleeps at (0: awake)."""
        return getattr(self, "_asleep", 0)

    def sleep(self, level: int) -> int:
        """Release the engine's memory while a trainer sharing its device steps: its KV cache, and at level 2 its
        weights. Running requests keep their tokens and are re-prefilled after waking. Returns the bytes freed."""
        raise NotImplementedError(f"{type(self).__name__} cannot sleep; set the rollout stage's sleep_during_train: false")

    def wake_up(self) -> None:
        """Take the memory back. After level 2 the weights are not there yet: `load_weights` must come before the
        next `step` (the rollout worker always pulls the current version on waking)."""
        raise NotImplementedError(f"{type(self).__name__} cannot sleep; set the rollout stage's sleep_during_train: false")

    def check_awake(self) -> None:
        """RuntimeError unless the engine can generate: awake, and (after waking from level 2) a version loaded."""
        if self.asleep or getattr(self, "_weights_missing", False):
            raise RuntimeError(f"instance {self.instance_id} cannot generate: it is asleep, or woke from level 2 and "
                               "has not loaded a version since (the rollout worker pulls one on waking)")

    def held_bytes(self) -> dict[str, int]:
        """Bytes this engine holds in tensors now: {"weights", "kv_cache"} (what sleep frees); {} if unknown."""
        return {}

    def check_fits(self, traj: Trajectory) -> None:
        """Raise ValueError unless the prompt plus max_new_tokens fits in max_model_len."""
        if not traj.prompt_ids:
            raise ValueError(f"trajectory {traj.traj_id} has no prompt_ids; tokenize the prompt before routing it")
        need = len(traj.prompt_ids) + self.max_new_tokens
        if need > self.max_model_len:
            raise ValueError(
                f"trajectory {traj.traj_id}: prompt of {len(traj.prompt_ids)} tokens + max_new_tokens "
                f"{self.max_new_tokens} = {need} exceeds max_model_len {self.max_model_len}; shorten the prompt, "
                f"lower max_new_tokens or raise max_model_len"
            )

    def tokens_left(self, traj: Trajectory) -> int:
        """Tokens `traj` may still generate: what is left of max_new_tokens (environment segments of a multi-turn
        episode count against it too) and, with max_turn_tokens, of the current turn's budget."""
        left = self.max_new_tokens - len(traj.completion_ids)
        if self.max_turn_tokens is not None:
            left = min(left, self.max_turn_tokens - (len(traj.completion_ids) - traj.turn_start))
        return left

    def completion_text(self, traj: Trajectory, stopped: bool) -> str:
        """The completion's text: earlier turns and environment segments whole, the current turn cut before its stop
        string when it ended on one (single-turn: decode(completion_ids) cut at the first stop string)."""
        start = traj.turn_start
        turn = self._decode(traj.completion_ids[start:])
        if stopped and self.stop:
            turn = self.cut_at_stop(turn)[0]
        return (self._decode(traj.completion_ids[:start]) if start else "") + turn

    @abc.abstractmethod
    def _decode(self, ids: list[int]) -> str:
        """Text of token ids, special tokens skipped."""

    def cut_at_stop(self, text: str) -> tuple[str, bool]:
        """(text before the first stop string, True) if `text` contains one, else (text, False)."""
        return cut_at_stop(text, self.stop)

    def begin_segment(self, traj: Trajectory) -> None:
        """Stamp versions on a trajectory about to generate: V_traj on a fresh one, versions_seen always."""
        if not traj.completion_ids:
            traj.version = self._version
            traj.versions_seen = []
        else:
            traj.version = min(traj.version, self._version)  # V_traj is the oldest version that produced a token
        if not traj.versions_seen or traj.versions_seen[-1] != self._version:
            traj.versions_seen.append(self._version)
