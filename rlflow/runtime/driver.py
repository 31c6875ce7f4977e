"""`rlflow run`: the loop that executes a compiled plan on Ray (docs/internals/architecture.md).

Everything it creates comes from the plan: the rollout fleets and the trainer from `actors`, the prompt
source and reward streams from `data_operators` and `tasks`, the staleness policy and the coordinators
from `control`. A trajectory's path, one module per hop:

  prompt_source -> trajectory_server -> rollout_fleet (rollout_coordinator routes, rollout_worker generates)
  -> payload_store -> reward_stream (its task's reward stage) -> buffer -> train_sink -> trainer_worker
  -> parameter_server -> back to rollout_fleet;  checkpoint and metrics on the side.

Set-up from the plan is run_setup.py (resume: run_resume.py); this module is the loop, the step's end, the
checkpoint and the shutdown.

The loop waits on one queue of events (messages.RunEvent) — finished step calls (Ray futures), scored groups from
the reward streams, stream failures — with a timeout: it never polls, and a run in which nothing happens
for the watchdog's limit (watchdog.py) stops with a checkpoint and a message saying what it was waiting for.
"""

from __future__ import annotations

import queue
import signal
import time
from dataclasses import replace
from pathlib import Path

import ray

from rlflow.errors import RunFailed
from rlflow.plan_model import Plan
from rlflow.runtime import checkpoint, disk_space, hop_trace, prediction, run_setup
from rlflow.runtime.disk_space import DiskFull
from rlflow.runtime.hooks import RunHooks
from rlflow.runtime.messages import (
    Evaluated,
    Joined,
    Rewarded,
    RunEvent,
    ScoredBatch,
    Started,
    StepDone,
    StepResult,
    StreamFailed,
    Trained,
)
from rlflow.runtime.metrics import Metrics
from rlflow.runtime.run_clock import RunClock
from rlflow.runtime.stop_signal import Grace, StoppedAgain
from rlflow.runtime.watchdog import (
    CALL_TIMEOUT_S,
    NO_PROGRESS_BATCHES,
    STALL_FACTOR,
    WARN_BATCHES,
    ProgressCheck,
    Watchdog,
    get_within,
)

HEARTBEAT_S = 5.0
EVAL_WAIT_S = 900  # the end of a run waits this long for the evaluations still in flight


#: what a call on an actor raises when the actor, or the node it ran on, is gone
LOST = (ray.exceptions.RayActorError, ray.exceptions.NodeDiedError, ray.exceptions.ObjectLostError)

RESUME_HINT = ("rlflow run --resume continues from the last checkpoint; the ledger puts buffered groups back and "
               "generates again every other group that was not trained into it")


class Run:
    """Executes one plan; `run()` returns the per-step history.

    `hooks` (hooks.py RunHooks) is how tests and tools observe or perturb a run — at set-up's end, after each event,
    batch handed to the trainer and step, and before the final export — instead of subclassing Run."""

    def __init__(self, plan: dict | Plan, *, out_dir: Path, resume: bool = False, log=print, clock: RunClock | None = None,
                 hooks: RunHooks | None = None):
        # absolute: actors (the trainer writes the checkpoint) need not share the driver's working directory
        plan = Plan.of(plan)  # typed once: every part of the run reads this one
        self.plan, self.out_dir, self.resume, self.log = plan, Path(out_dir).absolute(), resume, log
        self.control = plan.staleness.model_dump(exclude_unset=True)  # the buffer's policy arguments
        self.stop_requested = False
        self.ending = False  # _shutdown started: a step finished now routes no new work
        self.exported = False  # the final export is written (what a second stop signal leaves out)
        self.stop_signal: int | None = None  # the signal that stopped the run (rlflow run exits 128 + it)
        self.grace: Grace | None = None  # after SIGTERM: the bound on the stop (stop_signal.py)
        self.saved_step: int | None = None  # the step of the last checkpoint this process wrote
        self.pruned: list[str] = []  # checkpoint tags this process deleted past keep_checkpoints
        self.step = 0
        self.counts: dict = {}
        self.events: queue.Queue = queue.Queue()
        self.tracker_run_id = None
        self.clock = clock or RunClock()  # start-up timeline and the loop's own cost (run_clock.py)
        self.metrics = Metrics(plan, log=log, t0=self.clock.t0)  # one clock: `elapsed` counts from the same origin
        self.log = self.metrics.log  # on a terminal, messages print above the progress line
        self.hooks = hooks or RunHooks()
        self.trainer_dead = False
        self.restored: list[str] = []  # buffered groups a resume put back (not generated again)
        self.ledger_before: dict = {}  # the ledger's counts when a resume found it

    # ------------------------------------------------------------------ setup, from the plan (run_setup.py)
    def _start(self) -> None:
        run_setup.start(self)  # resuming, when self.resume, through run_resume.restore
        self.hooks.call("on_started", self)

    _get = staticmethod(get_within)

    def _submit(self, *started: Started) -> None:
        """Calls components started (messages.Started): when one completes, its event arrives on the queue, with
        the call's future in it."""
        for s in started:
            s.ref.future().add_done_callback(lambda fut, done=s.done: self.events.put(replace(done, future=fut)))

    def _abort_group(self, gid: str) -> None:
        if not any(f.abort_group(gid) for f in self.fleets):
            raise RuntimeError(f"the buffer evicted group {gid}, which no rollout fleet is generating")

    # ------------------------------------------------------------------ the loop
    def run(self) -> list[dict]:
        # the simulator's forecast of this plan, before anything starts (it costs the run no contention)
        self.forecast, forecast_line = prediction.forecast(self.plan)
        self.prediction: dict | None = None  # the forecast beside the measured figures, at the end (summary)
        try:
            self._start()
        except BaseException:
            if getattr(self, "tracker", None) is not None:
                self.tracker.end("FAILED")
            self._end_actors()  # a failed start (a bad data file, an engine that cannot load) leaves nothing behind
            raise
        # SIGTERM is what Slurm, Kubernetes and `docker stop` send: stop as on Ctrl-C (finish the step, checkpoint)
        previous = {sig: signal.signal(sig, self._on_stop_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        for f in self.fleets:
            self.log(f"{f.stage}: {f.coordination.describe()}" + (f"; {f.dispatch.describe()}" if f.dispatch else ""))
        if self.elastic.fleets:
            self.log(self.elastic.describe())
        self.log(f"run '{self.plan.name}': {self.metrics.steps} steps of {self.control['batch_size']} groups; "
                 f"tasks {', '.join(self.plan.tasks)}; MLflow run {self.tracker.run_id} at {self.tracker.uri}")
        self.log(forecast_line)
        status = "FAILED"
        self.last_step_t = time.monotonic()
        self.metrics.start(sum(f.instance_s() for f in self.fleets))
        trainer = self.plan.trainer
        self.watchdog = Watchdog(lambda: len(self.metrics.history), factor=trainer.get("stall_factor", STALL_FACTOR))
        self.on_nonfinite = trainer.get("on_nonfinite", "stop")
        self.progress = ProgressCheck(trainer.get("no_progress_groups") or NO_PROGRESS_BATCHES * self.control["batch_size"],
                                      self.plan.filters(), warn_at=WARN_BATCHES * self.control["batch_size"], log=self.log)
        try:
            while self.step < self.metrics.steps and not self.stop_requested:
                t0 = time.perf_counter()
                self.elastic.tick(self._submit)
                self._coordinate()
                if self.sink.ref is None and self.buffer.ready():
                    self._consume()
                t1 = time.perf_counter()
                event = self._next_event()
                t2 = time.perf_counter()
                self._handle(event)
                self.hooks.call("on_event", self, event)
                self.clock.busy((t1 - t0) + (time.perf_counter() - t2))  # all but the wait for the event
            status = "FINISHED" if not self.stop_requested else "KILLED"
        except RunFailed as err:
            self.log(f"run stopped: {err}")
            err.announced = True  # said here, where the run's log has it too: `rlflow run` does not say it again
            if not self.trainer_dead and not isinstance(err, DiskFull):
                status = "KILLED"  # the trainer is alive: save a checkpoint to resume from, then fail
            raise
        except Exception as err:  # a ledger, MLflow or export write on a full disk: a named stop, not a bug
            if not disk_space.disk_full(err, self.out_dir):
                raise
            full = DiskFull("a write of the run", self.out_dir, None, err)
            self.log(f"run stopped: {full}")
            full.announced = True
            raise full from err
        finally:
            try:  # rlflow's handler stays through the final writes: a second signal there quits saying what is left
                self._shutdown(status)
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
                if self.grace is not None:
                    self.grace.cancel()
                self.metrics.close()  # a progress line still drawn (the run stopped early) ends here
        return self.metrics.history

    def _next_event(self) -> RunEvent | None:
        """The next event; waits at most until a fleet's next coordinator cycle is due."""
        while True:
            now = time.monotonic()
            waits = [f.coordination.next_cycle - now for f in self.fleets if not f.coordination.holding]
            timeout = max(0.005, min(waits, default=HEARTBEAT_S))
            try:
                return self.events.get(timeout=min(timeout, HEARTBEAT_S))
            except queue.Empty:
                self.watchdog.check(self._waiting_for)
                if waits:
                    return None  # a coordinator cycle is due

    def _waiting_for(self) -> str:
        what = [w for f in self.fleets for w in f.outstanding()]
        if self.sink.ref is not None:
            what.append(f"train step {self.step + 1}")
        what.append(f"reward stages {', '.join(s.stage for s in self.streams)} "
                    f"({len(self.buffer.group_version)} generated groups not yet scored)")
        c = self.buffer.counters
        what.append(f"the staleness policy (ready: {self.buffer.ready()}, in flight {c.in_flight}, pending {c.pending})")
        return "; ".join(what)

    def _handle(self, event: RunEvent | None) -> None:
        """One event of the queue (messages.RunEvent). Evaluations and joining instances are not training
        progress: only the other events feed the watchdog."""
        match event:
            case None:  # a coordinator cycle came due
                return
            case Evaluated(step, future):
                self._on_eval(step, self.evals.result(step, future))
                return
            case Joined(fleet, inst, future):  # an added rollout instance is ready (or failed to start)
                fleet.on_joined(inst, future.exception())
                return
            case StreamFailed(stage, error):
                raise RunFailed(f"reward stage '{stage}' failed: {error}; {RESUME_HINT}")
            case Rewarded(stage, batch):
                self.watchdog.fed()
                self._on_rewarded(stage, batch)
                self.progress.scored_batch(stage, batch)  # busy but training nothing stops the run (NoProgress)
                self._poke()
            case StepDone(fleet, inst, future):
                self.watchdog.fed()
                try:
                    fleet.on_step(inst, future.result())
                except LOST as err:
                    fleet.on_death(inst, err)
            case Trained(future):
                self.watchdog.fed()
                try:
                    trained = future.result()
                except LOST as err:
                    self.sink.ref, self.trainer_dead = None, True  # its state is lost: nothing to checkpoint
                    raise RunFailed(f"the trainer died during step {self.step + 1} ({type(err).__name__}); "
                                    f"{RESUME_HINT}") from None
                self._on_trained(trained)  # its _finish_step pokes the coordinators and sends the new version
            case _:
                raise TypeError(f"the driver has no handler for the event {event!r} (messages.RunEvent lists them)")
        self.ledger.flush()

    def _coordinate(self) -> None:
        """Each fleet's coordinator cycle, when one is due, and the commands it queued sent to the instances."""
        for f in self.fleets:
            f.coordinate(self.weights.version, self.weights.ref)
            self._submit(*f.send())

    def _poke(self) -> None:
        """The staleness policy may admit more now, or a version is new: an idle instance need not wait for its
        coordinator's next periodic cycle (rollout_coordinator.py)."""
        for f in self.fleets:
            f.coordination.poke()

    def _on_rewarded(self, stage: str, batch: ScoredBatch) -> None:
        """Scored trajectories of whole groups (one row per trajectory) from a reward stream."""
        self.clock.mark("first_scored")
        hop_trace.mark("received", (r.group_id for r in batch.rows))
        for gid in dict.fromkeys(str(r.group_id) for r in batch.rows):
            self.measured.group_scored(gid)
        for task, scored in self.buffer.rewarded_batch(batch):
            self.metrics.rewarded(task, scored)

    def _consume(self) -> None:
        batch = self.buffer.consume()
        self.measured.consumed()
        hop_trace.mark("consumed", iter(batch.groups))
        rewards = batch.rewards
        staleness = {e.gid: batch.version - e.version for e in batch.policy_batch.entries}
        self.ledger.trained(self.step + 1, staleness, list(rewards))
        lengths = {t: next((f.lengths.pop(t) for f in self.fleets if t in f.lengths), 0) for t in rewards}
        self._submit(self.sink.start(batch, Metrics.batch_info(rewards, batch.groups, staleness, lengths)))
        for f in self.fleets:  # colocated with the trainer (the plan's sleep_level): the step gets the memory
            self._submit(*f.sleep_idle())
        self.hooks.call("on_consumed", self)

    def _on_trained(self, trained: StepResult) -> None:
        """A train step's result: finish it, unless its loss, gradient or update was not finite (trainer.py
        nonfinite_verdict): poisoned weights stop the run unsaved (the last checkpoint stays the good one); a
        skipped step (nothing applied) stops it, checkpointed, or goes on with train.on_nonfinite skip."""
        verdict, m = trained.nonfinite, trained.metrics
        if verdict:
            self.counts["nonfinite_steps"] = self.counts.get("nonfinite_steps", 0) + 1
            what = (f"train step {self.step + 1} was not finite (loss {m.get('loss', float('nan')):g}, "
                    f"grad norm {m.get('grad_norm', float('nan')):g}, lr {m.get('lr', float('nan')):g})")
            last = (f"the last checkpoint (step {self.saved_step}) is the one to resume from" if self.saved_step is not None
                    else "rlflow run --resume continues from the last checkpoint saved, if any")
        if verdict == "poisoned":
            self.sink.ref, self.trainer_dead = None, True  # its weights are not finite: never saved nor published
            raise RunFailed(f"{what}: the update made the weights non-finite, so they were neither published nor "
                            f"saved; lower the train stage's lr (or add gradient_clipping to the DeepSpeed config); {last}")
        self._finish_step(trained)
        if verdict == "skipped":
            self.log(f"{what}: not applied (the weights are as before)")
            if self.on_nonfinite == "stop":
                raise RunFailed(f"{what}: it was not applied, and the run stops with a checkpoint of the weights before "
                                "it (train.on_nonfinite: stop). Look for a reward or advantage that is NaN or inf, lower "
                                "lr, or set stages.<train>.on_nonfinite: skip to drop such batches and go on")

    def _finish_step(self, trained: StepResult) -> None:
        self.sink.ref = None
        self.step += 1
        self.progress.trained()
        self.weights.refresh()
        hop_trace.mark("trained", self.weights.version)  # the version this step published
        # the new version goes to the idle instances before the step's bookkeeping (metrics, MLflow, evaluation,
        # checkpoint): a synchronous step's generation waits on it (benchmarks/results/step_latency.md). Not after
        # the last step, nor while stopping: no new work is routed then
        if self.step < self.metrics.steps and not (self.stop_requested or self.ending):
            self._poke()
            self._coordinate()
        now = time.monotonic()
        wall = max(now - self.last_step_t, 1e-9)
        self.last_step_t = now
        row = self.metrics.step_row(self.step, self.weights.version, self.sink.batch_info, trained, wall,
                                    sum(f.busy_s() for f in self.fleets), sum(f.instance_s() for f in self.fleets),
                                    self.buffer.counters, self.counts, self._recall())
        # cumulative counts from the durable ledger, so they never go backwards across resumes (the policy's
        # own counters start from zero in each process); in_flight and pending stay the policy's
        ledger = self.ledger.counts()
        row.update({f"ledger_{k}": v for k, v in ledger.items()})
        row.update(consumed=ledger.get("trained", 0), filtered=ledger.get("filtered", 0), dropped=ledger.get("dropped", 0),
                   aborted=ledger.get("aborted", 0), admitted=sum(v for k, v in ledger.items() if k != "drawn"))
        row.update(self.clock.steady())  # control_share, driver_cpu_share (from step 2 on)
        row["rollout_instances"] = sum(f.serving_count() for f in self.fleets)
        self.tracker.log_metrics(row, self.step)
        if self.plan.pipeline["tracking"]["progress"]:
            self.metrics.progress(row)
        if self.clock.marks.get("first_step") is None:
            self.clock.first_step_done()
            self.log(self.clock.describe())
            self.tracker.log_metrics({f"startup/{k}_s": v for k, v in self.clock.marks.items()}, 0)
        if self.evals.due(self.step):
            self._submit(self.evals.submit(self.step, self.weights.ref))
        self.elastic.stepped(trained.metrics.get("step_time_s", 0.0), self._submit)
        self.exports.step(self.step, self.weights.ref)
        if self.sink.checkpoint_every and self.step % self.sink.checkpoint_every == 0:
            self._checkpoint()
        self.measured.step_done(trained.metrics)
        self.hooks.call("on_step", self, row)

    def _on_eval(self, step: int, result: dict | None) -> None:
        """Held-out metrics of the weights of `step`: MLflow at that step, its history row, the summary."""
        if result is None:
            return
        metrics = {k: v for k, v in result.items() if k.startswith("eval/")}
        self.tracker.log_metrics(metrics, step)
        self.metrics.evaluated(step, metrics, show=self.plan.pipeline["tracking"]["progress"])

    def _recall(self) -> float | None:
        recalls = [f.dispatch.recall() for f in self.fleets if f.dispatch is not None]
        recalls = [r for r in recalls if r is not None]
        return sum(recalls) / len(recalls) if recalls else None

    def _on_stop_signal(self, signum, _frame):
        if self.stop_requested:
            raise StoppedAgain(signum, self._stop_waiting_for())
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        self.log(f"\nstopping on {name}: finishing the current step and saving a checkpoint ({name} again to quit at "
                 "once); rlflow run --resume continues")
        self.stop_requested, self.stop_signal = True, signum
        if signum == signal.SIGTERM:  # nobody at a terminal to press it again: the stop itself is bounded
            self.grace = Grace(signum, self._stop_waiting_for, self.log)

    def _stop_waiting_for(self) -> str:
        if self.sink.ref is not None:
            return f"train step {self.step + 1} to finish, before the checkpoint"
        if self.saved_step != self.step:
            return f"the checkpoint of step {self.step}" + (f" (the last saved: step {self.saved_step})"
                                                            if self.saved_step is not None else "")
        if not self.exported:
            return f"the export of step {self.step} (its checkpoint is saved)"
        return f"the end of the MLflow run and of the actors (step {self.step} is saved and exported)"

    # ------------------------------------------------------------------ checkpoint / shutdown (resume: run_resume.py)
    def _checkpoint(self) -> None:
        self.ledger.flush()
        state = {"step": self.step, "version": self.weights.version, "mlflow_run_id": self.tracker.run_id,
                 "history": self.metrics.history,
                 "staleness_all": self.metrics.staleness_all, "counts": self.counts, "evals": self.metrics.evals,
                 "model_dir": str(self.model_dir)}  # `rlflow export` takes the config and tokenizer from there
        path = checkpoint.save(self.out_dir, self.sink, state, log=self.log)  # one unit, published by one rename
        self.ledger.checkpointed(self.step)  # payloads of groups trained into it are needed no more
        self.saved_step = self.step
        keep = self.plan.trainer.keep_checkpoints
        try:  # published, so no save is in flight: the older tags past keep_checkpoints go (checkpoint.prune)
            pruned = checkpoint.prune(self.out_dir, keep, log=lambda _: None)  # said on the checkpoint's own line
        except OSError as err:  # a full or read-only disk must not lose the run: the checkpoints stay, said so
            self.log(f"checkpoint at step {self.step}: {path}; could not prune older checkpoints ({err}); they are kept")
            return
        self.pruned += pruned
        self.log(checkpoint.saved_line(self.step, path, pruned, keep))

    def _finish_last_step(self, status: str) -> str:
        """The step in flight when the run stops; "FAILED" (nothing to save) when the trainer died meanwhile (a lost
        node) or the step made its weights non-finite."""
        try:
            trained = self._get(self.sink.ref, CALL_TIMEOUT_S, f"train step {self.step + 1} to finish")
        except LOST as err:
            self.sink.ref, self.trainer_dead = None, True
            self.log(f"the trainer died while finishing step {self.step + 1} ({type(err).__name__}): no checkpoint")
            return "FAILED"
        if trained.nonfinite == "poisoned":
            self.sink.ref, self.trainer_dead = None, True
            self.log(f"train step {self.step + 1} made the weights non-finite: not saved")
            return "FAILED"
        self._finish_step(trained)
        return status

    def _shutdown(self, status: str) -> None:
        self.ending = True
        try:
            if self.sink.ref is not None and status != "FAILED":  # finish the step in flight: a consistent checkpoint
                status = self._finish_last_step(status)
            if status != "FAILED" and self.saved_step != self.step:  # checkpoint_every may have just saved it
                self._checkpoint()
            if status == "FINISHED" or (status == "KILLED" and self.stop_requested):  # finished, or Ctrl-C
                self._export()
            if status == "FINISHED":
                if self.evals.due(self.step, final=True):
                    self.evals.submit(self.step, self.weights.ref)  # its result is waited for just below
                for step, result in self.evals.wait(EVAL_WAIT_S).items():
                    self._on_eval(step, result)
                self.ledger.check(self.step, self.control["batch_size"])
                self.measured.write(self.out_dir, self.buffer.counts.get("filtered_groups", 0))
                if self.forecast is not None:
                    self.prediction, lines = prediction.report(self.forecast, self.metrics.history)
                    for line in lines:
                        self.log(line)
                    if self.prediction is not None:
                        self.tracker.log_metrics(prediction.mlflow_metrics(self.prediction), self.step)
                pred = self.plan.prediction
                self.tracker.log_figures(self.metrics.history, self.metrics.staleness_all,
                                         [p for f in self.fleets for p in f.timeline], self.control["eta"],
                                         pred["mean"] if pred.get("available") else None)
                self.tracker.log_json("summary.json", self.summary())
        finally:
            try:
                self.tracker.end(status)
            except Exception as err:  # MLflow's store on a full disk: the stop already says so; the actors still end
                if not disk_space.disk_full(err, self.out_dir):
                    raise
                self.log(f"MLflow could not record the run's end ({err}): the disk is full")
            finally:
                self._end_actors()

    def _export(self) -> None:
        """The last published weights as a Hugging Face directory in <run dir>/export/, logged as the MLflow model."""
        self.hooks.call("before_export", self)
        t0 = time.perf_counter()
        path = self.exports.final(self.step, self.weights.ref)
        uri = self.tracker.log_model(path, step=self.step, info={"pipeline": self.plan.name, "step": self.step,
                                                                 "version": self.weights.version})
        self.exported = True
        self.log(f"exported the policy (step {self.step}) to {path} in {time.perf_counter() - t0:.1f} s; MLflow model {uri}")

    def _end_actors(self) -> None:
        """Close the streams and end the actors this run started, by handle (a shared cluster outlives the run)."""
        for s in getattr(self, "streams", []):
            s.close()
        handles = [i.handle for f in getattr(self, "fleets", []) for i in f.instances]
        handles += [getattr(self, "store", None), getattr(self, "weights", None) and self.weights.server,
                    getattr(self, "evals", None) and self.evals.actor]
        for handle in filter(None, handles):
            ray.kill(handle)
        if getattr(self, "sink", None) is not None:
            self.sink.close()  # every trainer rank, and their placement group
        if getattr(self, "prompts", None) is not None:
            self.prompts.close()
        if getattr(self, "exports", None) is not None:
            self.exports.close()
        if getattr(self, "ledger", None) is not None:
            self.ledger.close()

    @property
    def history(self) -> list[dict]:
        return self.metrics.history

    @property
    def staleness_all(self) -> list[int]:
        return self.metrics.staleness_all

    def summary(self) -> dict:
        return self.metrics.summary(self.buffer.counters, self.counts, self.tracker.run_id, self._recall()) | {
            "startup_s": dict(self.clock.marks), **self.clock.steady(),
            # Ray Data's executor runs in the reward streams' host actors, not the driver (reward_stream.py)
            "reward_stream_cpu_share": sum(filter(None, (s.cpu_share() for s in getattr(self, "streams", [])))) or None,
            "engine_tokens_per_s": self._decode_rate(), "prediction": getattr(self, "prediction", None),
            "checkpoints": checkpoint.inventory(self.out_dir) | {"pruned": len(self.pruned)}}

    def _decode_rate(self) -> float | None:
        """Completion tokens per second of engine.step, per instance (instances decode side by side)."""
        rates = [f.decode_rate() for f in getattr(self, "fleets", [])]
        tokens, seconds = sum(r[0] for r in rates), sum(r[1] for r in rates)
        return tokens / seconds if seconds > 0 else None
