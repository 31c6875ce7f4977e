"""One reward stage as a live Ray Data stream: payload store -> reward and group filter -> the driver's queue.

The source is a custom Datasource with one read task that pulls complete groups from the store until the store
ends the stage: no tick budget, so start-up does not depend on the number of training steps. Back-pressure is
credit-based: the store hands out at most IN_FLIGHT_PER_ACTOR x concurrency groups that the driver has not yet
received (Ray Data's own back-pressure counts object-store bytes, and small bundles never reach it), so the
rest wait in the store.

Rows: one row is one pull, a bundle of whole groups (column `groups`, a list of group structs); a tick is a row
with no groups (see TICK_S), which flows through and is dropped at the output. The group filter
needs whole groups and the reward is per trajectory; bundling keeps per-block overhead off each group (a block
per group measured ~18 groups/s here, a block per pull ~230 groups/s).

Where it runs: a StreamHost actor holds the Dataset and iterates it, so Ray Data's streaming executor runs in that
actor's process, not the driver's; the driver's RewardStream forwards the host's events with a long poll.
Output: `start(out)` puts a messages.Rewarded(stage, ScoredBatch) per bundle, one row per trajectory, whole
groups only: group_id, traj_id, task, reward (float; nan when it failed), reward_error ("" or why it failed), kept
(the group filter's verdict for the member's group), v_min and v_max (the member's version span, passed through
from the store for the ledger). A batch Ray Data scores twice (its
worker died and the batch was retried) is recorded once: the buffer ignores a group's second reward.
On failure, or if the stream ends while not closed, it puts a messages.StreamFailed(stage, RuntimeError naming
the stage).

How a single reward call is made safe (timeouts, non-numbers, the failure rate) is reward_call.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import sys
import threading
import time
import warnings

import pyarrow as pa
import ray
from ray.data import ActorPoolStrategy, DataContext
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from rlflow import registry
from rlflow.runtime import hop_trace
from rlflow.runtime.messages import Rewarded, ScoredBatch, StreamFailed
from rlflow.runtime.ray_data_quiet import quiet_ray_data
from rlflow.runtime.reward_call import (
    REWARD_TIMEOUT_S,
    TIMEOUTS_IN_A_ROW,
    USER_CODE_ERROR,
    FailureRate,
    RewardTimeout,
    excerpt,
    filter_verdict,
    stage_stop,
)
from rlflow.runtime.reward_pool import ScorerPool, stage_name
from rlflow.runtime.reward_process import RewardDied, RewardFailed, RewardProcess, RewardUnloadable

PULL_TIMEOUT_S = 2.0  # one store call waits this long for a group; the read task loops until the stage ends
#: TICK_S after each bundle, if nothing new came, the source yields one tick (a row with no groups). Ray Data 2.60's
#: scheduling loop waits, each turn, until every running task has output or 0.1 s passed, and the live source
#: always runs: without the tick a bundle scored in less than 0.1 s sat until that timeout before moving on, once per
#: round of generation (benchmarks/results/step_latency.md). A tick costs one turn of that loop and an empty Score
#: call; ticking every TICK_S while groups were in the stream instead cost the engine more CPU than it saved here.
TICK_S = 0.02
TICK = {"groups": []}
MAX_GROUPS_PER_PULL = 16  # the most groups one bundle (row) holds
IN_FLIGHT_PER_ACTOR = 64  # groups pulled but not yet delivered, per reward actor (the back-pressure window)
CLOSE_TIMEOUT_S = 10.0
# Ray Data restarts a dead operator actor and retries its batch forever by default. A reward that kills its
# process kills only the Score actor's child (reward_process.py), but the actor itself can still be lost (its
# node, the OOM killer): a few restarts survive that, then the stream fails.
# Passed as map_batches(**ray_remote_args), the way Ray 2.60 documents; deprecated for 2.64 (Ray is pinned).
RESTARTS = {"max_restarts": 2, "max_task_retries": 2}
SPAN = ("v_min", "v_max")  # each member's version span, from the store to the driver's ledger (passed through)


class GroupSource(Datasource):
    """The live source: one read task that yields a bundle per pull of complete groups until the stage ends."""

    def __init__(self, store, stage: str, max_in_flight: int):
        super().__init__()
        self.store, self.stage, self.max_in_flight = store, stage, max_in_flight

    def estimate_inmemory_data_size(self):
        return None

    def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None) -> list[ReadTask]:
        store, stage, max_in_flight = self.store, self.stage, self.max_in_flight

        def pull():
            try:
                if ray.get(store.attach.remote(stage, os.getpid())) > 1:
                    # Ray re-ran this read task after its worker died: the groups the dead one had pulled are
                    # gone. Ray Data 2.60 may swallow this error (the stream then just ends); either way it fails.
                    raise RuntimeError(f"the source of reward stage '{stage}' restarted after its worker died")
                tick_due = False  # one tick after each bundle (TICK_S)
                while True:
                    rows = ray.get(store.next_groups.remote(stage, PULL_TIMEOUT_S, MAX_GROUPS_PER_PULL, max_in_flight,
                                                            TICK_S if tick_due else None))
                    if rows is None:  # the stage was ended: RewardStream.close() or PayloadStore.close()
                        return
                    if rows:  # GroupToScore messages, as Arrow rows from here on
                        hop_trace.mark("pulled", (g.group_id for g in rows))
                        yield pa.Table.from_pylist([{"groups": [g.as_row() for g in rows]}])
                        tick_due = True
                    elif tick_due:  # nothing new since: a tick, so the executor's next turn ends with the bundle's Score
                        yield pa.Table.from_pylist([TICK])
                        tick_due = False
            except ray.exceptions.RayError as e:  # re-raised plainly: Ray's own may not deserialize in the driver
                raise RuntimeError(f"reward stage '{stage}' lost the payload store: {type(e).__name__}") from None

        return [ReadTask(pull, BlockMetadata(num_rows=None, size_bytes=None, input_files=None, exec_stats=None))]


@contextlib.contextmanager
def one_row_per_block():
    """Datasets created inside pass every row downstream as its own block, the moment it is yielded.

    A read task's yields are merged up to `target_max_block_size` before they move on, so a live source would
    deliver nothing until it ended (PLATFORM-NOTES, "Ray Data as a live stream", 1). A 1-byte target makes the
    read side cut after every row, and a row is a whole bundle of groups. Public API only, no Ray internal: each
    Dataset captures a copy of DataContext.get_current() when created (its docstring shows this per-dataset
    use), and the setting is restored for everything else. Guarded by
    tests/integration/test_streams.py::test_group_flows_while_stream_open.
    """
    ctx = DataContext.get_current()
    saved = (ctx.target_max_block_size, ctx.enable_progress_bars, ctx.print_on_execution_start,
             ctx.issue_detectors_config.detectors)
    ctx.target_max_block_size, ctx.enable_progress_bars, ctx.print_on_execution_start = 1, False, False
    ctx.issue_detectors_config.detectors = []  # no "uses 108 MiB per worker" advice every 30 s (#15)
    try:
        yield
    finally:
        (ctx.target_max_block_size, ctx.enable_progress_bars, ctx.print_on_execution_start,
         ctx.issue_detectors_config.detectors) = saved


def _each_group(bundles: pa.Table):
    return (g for bundle in bundles.column("groups").to_pylist() for g in bundle)


class Score:
    """Ray Data actor: reward per trajectory, each call in this actor's child process (reward_process.py); a
    failing call marks that trajectory failed, not the stream. A group carries `stage_error` ("" or why the stage
    must stop: TIMEOUTS_IN_A_ROW timeouts in a row, or a new reward process that cannot import the reward) and its
    `stage_rule` (reward-hangs, user-code-error), which StreamRunner turns into the stage's error, and `kept`,
    the group filter's verdict on its rewards.

    The filter runs here, on the group just scored, rather than as a second operator: every hand-off between
    Ray Data operators waits for a turn of the streaming executor's scheduling loop (up to 0.1 s each in Ray
    2.60), and a synchronous step pays it once per round of generation (benchmarks/results/step_latency.md)."""

    def __init__(self, fn_ref: str, timeout_s: float = REWARD_TIMEOUT_S, filter_fn: str | None = None,
                 scorers: list[dict] | None = None, batch_size: int = 16):
        self.fn_ref, self.timeout_s = fn_ref, timeout_s
        self.filter = registry.resolve("filter", filter_fn) if filter_fn else None
        self.process = RewardProcess(fn_ref, timeout_s)  # a function stage's (spawned at its first call)
        self.timeouts_in_row = 0  # across bundles: a hang on every row stops the stage in a few timeouts
        self.hung = ""  # why this stage must stop, once TIMEOUTS_IN_A_ROW calls in a row timed out (or see stop_rule)
        self.stop_rule = "reward-hangs"  # or USER_CODE_ERROR: a new process could not import the reward
        # a stage with model / judge / http / scorers: loaded once here, in the actor (reward_pool.py)
        self.pool = ScorerPool(scorers, batch_size, lambda ref: Score(ref, timeout_s)) if scorers else None

    def __del__(self):
        """Ray Data deletes its actors' UDF when the stream shuts down gracefully (MapWorker.__ray_shutdown__): a vLLM
        judge's engine closes then, instead of its engine-core process dying under it (an error trace at every
        run's end)."""
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.close()

    def __call__(self, bundles: pa.Table) -> pa.Table:
        scored = [self.score_pool(bundle) if self.pool else [self.score(g) for g in bundle]
                  for bundle in bundles.column("groups").to_pylist()]
        for g in (g for bundle in scored for g in bundle):
            g["kept"] = filter_verdict(self.filter, g["reward"], g["reward_error"])
        hop_trace.mark("scored", (g["group_id"] for bundle in scored for g in bundle))
        return pa.Table.from_pydict({"groups": scored})

    def score(self, g: dict) -> dict:
        """One group's rewards: its members go to the reward process in one message (reward_process.call_many)."""
        row, n = json.loads(g["row"]), len(g["completion"])
        agents, failed = g.get("agent") or [""] * n, g.get("rollout_error") or [""] * n
        todo = [i for i in range(n) if not failed[i]]  # a member whose rollout failed is not scored: it fails as is
        calls = [(str(g["completion"][i]), g["answer"], g["prompt"], row | {"agent": json.loads(agents[i])}
                  if agents[i] else row) for i in todo]
        wheres = [f"trajectory {g['traj_id'][i]} of task '{g['task']}' (prompt {excerpt(g['prompt'])})" for i in todo]
        scored: list[tuple[float, str]] = []
        while len(scored) < len(calls):  # call_many stops after a call that timed out or ended the process
            i = len(scored)
            if self.hung:
                scored.append(self._not_called())
                continue
            scored += [self._judge(outcome, calls[i + k], wheres[i + k])
                       for k, outcome in enumerate(self.process.call_many(calls[i:]))]
        results = [(float("nan"), f"rollout failed: {failed[i]}") for i in range(n)]
        for i, r in zip(todo, scored, strict=True):
            results[i] = r
        return {"group_id": g["group_id"], "task": g["task"], "traj_id": g["traj_id"],
                "reward": [r for r, _ in results], "reward_error": [e for _, e in results], "stage_error": self.hung,
                "stage_rule": self.stop_rule if self.hung else "", **{k: g[k] for k in SPAN if k in g}}

    def score_pool(self, groups: list[dict]) -> list[dict]:
        """A bundle's rewards from the stage's scorers (reward_pool.py): a model or judge sees the bundle at once."""
        out = [{"group_id": g["group_id"], "task": g["task"], "traj_id": g["traj_id"], **r, **{k: g[k] for k in SPAN if k in g}}
               for g, r in zip(groups, self.pool.score(groups), strict=True)]
        for g, r in zip(groups, out):  # a member whose rollout failed (an agent's) fails as is, whatever it scored
            for i, why in enumerate(g.get("rollout_error") or []):
                if why:
                    r["reward"][i], r["reward_error"][i] = float("nan"), f"rollout failed: {why}"
        return out

    def score_one(self, completion: str, answer: str, prompt: str, row: dict, where: str = "a row") -> tuple[float, str]:
        """(reward, "") or (nan, why it failed): raised, not a finite number, timed out, or killed its process
        twice on this row (`where` names the row in the message)."""
        if self.hung:
            return self._not_called()
        call = (completion, answer, prompt, row)
        return self._judge(self.process.call_many([call])[0], call, where)

    def _not_called(self) -> tuple[float, str]:
        if self.stop_rule == USER_CODE_ERROR:
            return float("nan"), f"{self.fn_ref} not called: it no longer loads"
        return float("nan"), (f"{self.fn_ref} not called: its last {self.timeouts_in_row} calls timed out "
                              f"after {self.timeout_s:g} s")

    def _judge(self, outcome: float | Exception, call: tuple, where: str) -> tuple[float, str]:
        """A call's outcome as (reward, "") or (nan, why); a process that died on it gets the row once more."""
        if isinstance(outcome, RewardDied) and not isinstance(outcome, RewardUnloadable):
            outcome = self.process.call_many([call])[0]  # once may be the OOM killer or a kill from outside
        if isinstance(outcome, RewardUnloadable):  # its module was edited since the run started: the stage stops
            self.hung = self.hung or f"{self.fn_ref} no longer loads in a new reward process: {outcome.why}"
            self.stop_rule = USER_CODE_ERROR
            return float("nan"), f"{self.fn_ref} {outcome.how}"
        if isinstance(outcome, RewardTimeout):
            self.timeouts_in_row += 1
            if self.timeouts_in_row >= TIMEOUTS_IN_A_ROW:
                self.hung = (f"{self.fn_ref} timed out on {self.timeouts_in_row} calls in a row ({self.timeout_s:g} s "
                             f"each; the last on {where})")
            return float("nan"), f"{self.fn_ref} timed out after {self.timeout_s:g} s"
        self.timeouts_in_row = 0
        if isinstance(outcome, RewardDied):
            why = (f"{self.fn_ref} killed its process ({outcome.how}) on {where}, twice; this trajectory fails, the "
                   "stage goes on")
            print(f"rlflow: reward {why}", file=sys.stderr, flush=True)  # the actor's log
            return float("nan"), why
        if isinstance(outcome, RewardFailed):
            return float("nan"), f"{self.fn_ref} {outcome}"
        return outcome, ""


def per_trajectory(bundles: pa.Table) -> dict:
    """Bundles of judged groups -> the output batch, one entry per trajectory (with v_min, v_max when the groups
    carry the store's version spans)."""
    out = {k: [] for k in ("group_id", "traj_id", "task", "reward", "reward_error", "kept")}
    for g in _each_group(bundles):
        for i, (tid, r, err) in enumerate(zip(g["traj_id"], g["reward"], g["reward_error"], strict=True)):
            for k, v in (("group_id", g["group_id"]), ("traj_id", tid), ("task", g["task"]), ("reward", r),
                         ("reward_error", err), ("kept", g["kept"])):
                out[k].append(v)
            for k in SPAN:
                if g.get(k) is not None:
                    out.setdefault(k, []).append(g[k][i])
    return out


class StreamRunner:
    """The Ray Data stream of one reward stage, iterated in the process that holds it (StreamHost's, see below)."""

    def __init__(self, store, *, stage: str, reward_fn: str, filter_fn: str | None, concurrency: int, num_cpus: float,
                 source: str = "the pipeline", resources: dict | None = None, reward_timeout_s: float = REWARD_TIMEOUT_S,
                 scorers: list[dict] | None = None, batch_size: int = 16, num_gpus: float = 0):
        quiet_ray_data()  # the run prints its own progress
        self.store, self.stage, self.reward_fn, self.source = store, stage, reward_fn, source
        self.reward_timeout_s = reward_timeout_s
        self.failures = FailureRate(stage)
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        with one_row_per_block(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")  # see RESTARTS
            # the read task holds its CPU for the stream's life: give it a sliver (PLATFORM-NOTES 2)
            self.dataset = (
                ray.data.read_datasource(GroupSource(store, stage, IN_FLIGHT_PER_ACTOR * concurrency),
                                         override_num_blocks=1, num_cpus=0.01)
                .map_batches(Score, fn_constructor_args=(reward_fn, reward_timeout_s, filter_fn, scorers, batch_size),
                             batch_size=None, batch_format="pyarrow", compute=ActorPoolStrategy(size=concurrency),
                             num_cpus=num_cpus, **({"num_gpus": num_gpus} if num_gpus else {}),  # stages.<reward>.num_gpus
                             **RESTARTS, **({"resources": resources} if resources else {}))  # stages.<reward>.resources
            )

    def start(self, out: queue.Queue) -> None:
        """Run the stream in a daemon thread that puts its events on `out` (see the module docstring)."""
        self._thread = threading.Thread(target=self._run, args=(out,), name=f"reward-stream-{self.stage}", daemon=True)
        self._thread.start()

    def _run(self, out: queue.Queue) -> None:
        try:  # batch_size=None, prefetch_batches=0: each bundle as soon as it exists (PLATFORM-NOTES 3)
            for bundles in self.dataset.iter_batches(batch_size=None, prefetch_batches=0, batch_format="pyarrow"):
                batch = per_trajectory(bundles)
                stop = next((g for g in _each_group(bundles) if g.get("stage_error")), None)
                if stop and not self._closing.is_set():
                    rule = stop.get("stage_rule") or "reward-hangs"
                    out.put(StreamFailed(self.stage, stage_stop(self.source, self.stage, self.reward_fn, rule,
                                                                stop["stage_error"], self.reward_timeout_s)))
                    return
                if batch["traj_id"]:
                    hop_trace.mark("streamed", (gid for gid in batch["group_id"]))
                    out.put(Rewarded(self.stage, ScoredBatch.from_columns(batch)))
                    self.store.delivered.remote(self.stage, len(set(batch["group_id"])))  # credit back
                    self.failures.add(batch["reward_error"], batch["group_id"])
                    if self.failures.too_high() and not self._closing.is_set():
                        out.put(StreamFailed(self.stage, self.failures.error(self.source, self.reward_fn)))
                        return
            if not self._closing.is_set():
                raise RuntimeError(self._why_ended())
        except Exception as e:  # noqa: BLE001 - whatever stopped it, the driver hears of it
            if not self._closing.is_set():
                err = RuntimeError(f"reward stream '{self.stage}' stopped: {type(e).__name__}: {e}")
                out.put(StreamFailed(self.stage, err))

    def _why_ended(self) -> str:
        try:
            readers = ray.get(self.store.readers.remote(self.stage), timeout=CLOSE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - a dead or stuck store is the answer
            return f"its source ended and the payload store does not answer ({type(e).__name__})"
        if len(readers) > 1:
            return f"its source's worker (pid {readers[0]}) died; Ray re-ran it, and the groups it held may be lost"
        return "its source ended although the stream was not closed (the payload store was closed)"

    def close(self) -> None:
        """End the stream: the store ends this stage's source, Ray Data finishes, the thread exits."""
        self._closing.set()
        with contextlib.suppress(Exception):  # a dead store ends the source too
            ray.get(self.store.end_stage.remote(self.stage), timeout=CLOSE_TIMEOUT_S)
        if self._thread is not None:
            self._thread.join(CLOSE_TIMEOUT_S)


@ray.remote(num_cpus=0, max_concurrency=4)
class StreamHost:
    """Holds a StreamRunner, so Ray Data's streaming executor (a 0.1 s scheduling loop and a 10 ms output poll,
    about 15-20% of a core here, #15) runs in this actor's process instead of the driver's. The driver takes
    the events with `next`, a long poll: one call per batch, or one per NEXT_WAIT_S when nothing happens."""

    def __init__(self, store, kwargs: dict):
        self.started = (time.monotonic(), time.process_time())
        self.events: queue.Queue = queue.Queue()
        self.runner = StreamRunner(store, **kwargs)
        self.runner.start(self.events)

    def next(self, wait_s: float) -> list:
        """The events so far, waiting up to `wait_s` for the first; [] when none came."""
        try:
            got = [self.events.get(timeout=wait_s)]
        except queue.Empty:
            return []
        while True:
            try:
                got.append(self.events.get_nowait())
            except queue.Empty:
                return got

    def cpu_share(self) -> float:
        """This process's CPU time (Ray Data's executor and its threads) over its life, in cores."""
        return (time.process_time() - self.started[1]) / max(time.monotonic() - self.started[0], 1e-9)

    def block_sizes(self) -> tuple[int, int | None]:
        """(the stream dataset's target_max_block_size, this process's default): 1 and not 1 (one_row_per_block)."""
        return self.runner.dataset.context.target_max_block_size, DataContext.get_current().target_max_block_size

    def close(self) -> None:
        self.runner.close()


NEXT_WAIT_S = 2.0  # the driver's long poll on StreamHost.next
#: the host's process only (Ray Data reads it at import): the streaming executor emits each finished block in the
#: scheduling-loop turn that sees it, instead of handing its metadata to a background thread and emitting it a turn
#: later. A turn waits up to 0.1 s while the live source has nothing, so the deferral cost each hand-off (the source
#: to Score, Score to the output) about that much per round of generation (benchmarks/results/step_latency.md);
#: the metadata of these one-bundle blocks is small, so fetching it inline does not hold the loop up.
HOST_ENV = {"RAY_DATA_METADATA_PREFETCH_ON_THREAD": "0"}


class RewardStream:
    """Reward stage `stage` as Ray Data operators over the store's queue for it, run by a StreamHost actor;
    `start(out)` forwards its batches and errors to the driver's queue `out`."""

    def __init__(self, store, *, stage: str, reward_fn: str | None, filter_fn: str | None, concurrency: int,
                 num_cpus: float, source: str = "the pipeline", resources: dict | None = None,
                 scorers: list[dict] | None = None, batch_size: int = 16, num_gpus: float = 0):
        """`scorers` (a stage with model / judge / http / scorers, built-in models already prepared): scored by
        reward_pool.py in the actors, and `reward_fn` only names the stage's reward in messages."""
        for ref in [s["fn"] for s in scorers or [] if s.get("fn")] or ([] if scorers else [reward_fn]):
            registry.resolve("reward", ref)  # a bad reference fails here, in the driver, not in an actor
        reward_fn = stage_name(scorers) if scorers else reward_fn
        if filter_fn:
            registry.resolve("filter", filter_fn)
        self.stage = stage
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._cpu_share: float | None = None  # read from the host when it closes
        self.host = StreamHost.options(runtime_env={"env_vars": HOST_ENV}).remote(store, {
            "stage": stage, "reward_fn": reward_fn, "filter_fn": filter_fn, "concurrency": concurrency,
            "num_cpus": num_cpus, "source": source, "resources": resources, "scorers": scorers, "batch_size": batch_size,
            "num_gpus": num_gpus, "reward_timeout_s": REWARD_TIMEOUT_S})  # read here, in the driver, where a test may have changed it

    def start(self, out: queue.Queue) -> None:
        self._thread = threading.Thread(target=self._forward, args=(out,), name=f"reward-stream-{self.stage}", daemon=True)
        self._thread.start()

    def _forward(self, out: queue.Queue) -> None:
        while not self._closing.is_set():
            try:
                events = ray.get(self.host.next.remote(NEXT_WAIT_S), timeout=NEXT_WAIT_S + CLOSE_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - a dead or stuck host ends the stream; the driver hears of it
                if not self._closing.is_set():
                    out.put(StreamFailed(self.stage, RuntimeError(
                        f"reward stream '{self.stage}' stopped: its host actor failed ({type(e).__name__})")))
                return
            for event in events:
                out.put(event)

    def cpu_share(self) -> float | None:
        """The host's CPU use over its life, in cores (None if it cannot say): the stream's control-plane cost."""
        if self._cpu_share is None:
            with contextlib.suppress(Exception):
                self._cpu_share = ray.get(self.host.cpu_share.remote(), timeout=CLOSE_TIMEOUT_S)
        return self._cpu_share

    def close(self) -> None:
        """End the stream (the store ends this stage's source, Ray Data finishes), then the host actor."""
        self.cpu_share()
        self._closing.set()
        with contextlib.suppress(Exception):  # a dead host has nothing left to end
            ray.get(self.host.close.remote(), timeout=2 * CLOSE_TIMEOUT_S)
        if self._thread is not None:
            self._thread.join(NEXT_WAIT_S + CLOSE_TIMEOUT_S)
        with contextlib.suppress(Exception):
            ray.kill(self.host)  # its Ray Data actors go with it (they are the host's own)
