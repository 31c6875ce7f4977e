"""A run's set-up, from the plan: the model, the payload store, the trainer, the rollout fleets, the reward streams,
the evaluator and the exports, each made from its entry in the plan; then waiting for every actor to be ready and
publishing the first weights. `Run._start` calls `start(run)`; the loop itself is in driver.py.
"""

from __future__ import annotations

import sys
import time

import ray

from rlflow.plan_model import Plan
from rlflow.reward_schema import TINY_JUDGE
from rlflow.runtime import checkpoint
from rlflow.runtime.buffer import Buffer
from rlflow.runtime.evaluation import Evaluations
from rlflow.runtime.export import RunExports
from rlflow.runtime.ledger import Ledger
from rlflow.runtime.parameter_server import ParameterServerHandle
from rlflow.runtime.reward_pool import prepared
from rlflow.runtime.rollout_fleet import RolloutFleet
from rlflow.runtime.run_resume import restore
from rlflow.runtime.scaling import Scaling
from rlflow.runtime.sim_inputs import SimInputs
from rlflow.runtime.train_sink import TrainSink
from rlflow.runtime.watchdog import CALL_TIMEOUT_S, RunStalled, get_within

START_TIMEOUT_S = 900  # actors (engines, DeepSpeed) starting; vLLM on CPU takes about a minute


def start(run) -> None:
    """Build everything `run` drives from its plan (resuming from the last checkpoint when run.resume), wait for the
    actors, publish the first weights and start the reward streams."""
    from transformers import AutoTokenizer

    from rlflow.runtime.chat_episodes import prompt_measures
    from rlflow.runtime.model import prepare_model
    from rlflow.runtime.payload_store import PayloadStore
    from rlflow.runtime.prompt_source import PromptSource, check_prompt_lengths, check_sources
    from rlflow.runtime.reward_stream import RewardStream
    from rlflow.runtime.tracking import Tracker

    plan = Plan.of(run.plan)  # typed once here; a no-op when the run was given a Plan
    for d in reversed(plan.python_path):  # user reward/filter modules beside the pipeline
        if d not in sys.path:
            sys.path.insert(0, d)
    check_sources(plan.tasks, plan.source)  # a bad row in a file's head fails before any actor starts
    model_dir = str(prepare_model(plan, log=run.log))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    max_new = plan.max_new_tokens()
    max_model_len = plan.model["max_model_len"]
    measure = prompt_measures(plan, tokenizer)  # tasks of stages with tools: their prompts as the stage renders them
    check_prompt_lengths(plan.tasks, tokenizer, max_new_tokens=max_new, max_model_len=max_model_len,
                         source=plan.source, measure=measure)  # an over-long prompt in a file's head, before any actor starts
    run.clock.mark("model")
    run.store = PayloadStore.options(num_cpus=plan.payload_store.num_cpus).remote()
    run.weights = ParameterServerHandle(plan.parameter_server, CALL_TIMEOUT_S)
    run.sink = TrainSink(plan, model_dir=model_dir, store=run.store, params=run.weights.server)
    run.ledger = Ledger(run.out_dir, run.control["eta"], fresh=not run.resume)
    run.buffer = Buffer(run.control, run.store, run.ledger, run.counts, run._abort_group, log=run.log)
    rollout_stages = plan.rollout_stages()  # the simulator serves its fleets in the same order
    state, resumed = None, None
    if run.resume:
        state = checkpoint.load(run.out_dir, run.sink, source=plan.source, log=run.log)  # falls back, saying so
        run.ledger_before = run.ledger.counts()
        resumed = run.ledger.resume(state["step"])
    run.prompts = PromptSource(plan.tasks, tokenizer, max_new_tokens=max_new,
                               max_model_len=max_model_len, seed=plan.pipeline["data"]["seed"],
                               source=plan.source, skip=resumed.drawn if resumed else None, measure=measure)
    run.fleets = [RolloutFleet(plan, s, model_dir=model_dir, store=run.store, buffer=run.buffer, prompts=run.prompts,
                               ledger=run.ledger, counts=run.counts, log=run.log) for s in rollout_stages]
    run.measured = SimInputs()
    for fleet in run.fleets:
        fleet.measured = run.measured
    run.elastic = Scaling(run.fleets, run.out_dir, log=run.log)  # `rlflow scale`, and elastic.auto
    filters = plan.filters()
    policy_start = model_dir if plan.model["path"] == TINY_JUDGE else None  # a judge's builtin:tiny-llama
    run.streams = [RewardStream(run.store, stage=op.stage, reward_fn=op.fn, filter_fn=filters.get(op.stage),
                                concurrency=op.concurrency, num_cpus=op.num_cpus,
                                source=plan.source, resources=op.get("resources"),
                                scorers=prepared(op.scorers, policy_start, run.log) if op.scorers else None,
                                batch_size=op.batch_size, num_gpus=op.num_gpus)
                   for op in plan.reward_operators()]
    run.model_dir = model_dir
    run.evals = Evaluations(plan, model_dir, tokenizer)  # held-out scoring on an actor of its own
    run.exports = RunExports(run.out_dir, model_dir, plan, plan.trainer.save_every)  # export/step-<N>/, and export/ at the end
    if state:
        restore(run, state, resumed)
    starting = {"rollout": [r for f in run.fleets for r in f.ready_refs()], "trainer": [run.sink.actor.ready.remote()],
                "evaluator": run.evals.ready_refs()}
    run.clock.mark("actors_created")
    run.tracker = Tracker(run.plan, run_id=run.tracker_run_id)  # MLflow's set-up overlaps the actors' start
    run.clock.mark("tracker")
    await_ready(run.clock, starting)
    get_within(run.sink.actor.publish.remote(run.step), CALL_TIMEOUT_S, "the trainer to publish the initial weights")
    run.clock.mark("publish")
    run.weights.refresh()
    if run.step:
        for f in run.fleets:
            f.start_at(run.weights.version, run.weights.ref)
    elif run.evals.due(0):
        run._submit(run.evals.submit(0, run.weights.ref))  # the starting point of the accuracy curve
    for s in run.streams:
        s.start(run.events)


def await_ready(clock, starting: dict[str, list]) -> None:
    """Wait for every actor's ready() (they start concurrently); note on `clock` when each role's last one was ready."""
    pending = {ref: role for role, refs in starting.items() for ref in refs}
    deadline = time.monotonic() + START_TIMEOUT_S
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            roles = sorted(set(pending.values()))
            raise RunStalled(f"waited {START_TIMEOUT_S:.0f} s for the {' and '.join(roles)} actors to start; "
                             "see the Ray logs above")
        role = pending.pop(ready[0])
        ray.get(ready[0])  # an actor whose constructor failed raises here
        if role not in pending.values():
            clock.mark(role)
