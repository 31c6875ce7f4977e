"""Hooks on a run: the way tests and tools observe or perturb a `Run` (driver.py) without subclassing it.

    run = Run(plan, out_dir=out, hooks=RunHooks(on_step=lambda run, row: print(row["step"])))

Each hook is optional and is called in the driver's own thread, at one point of the run:

- on_started(run): set-up is done (run_setup.start): the actors are ready, the first weights published, the reward
  streams started; nothing is generated yet. The place to wrap a fleet's or the sink's methods.
- on_event(run, event): after the loop handled one event (None when a coordinator cycle came due instead).
- on_consumed(run): after the buffer gave a batch to the trainer (run.sink.ref is the step in flight).
- on_step(run, row): after a train step finished (checkpoint included, when one was due); `row` is its history row.
- before_export(run): before the final export of the weights (finished, or stopped by Ctrl-C / SIGTERM).

An exception a hook raises goes where one from the driver at that point would: out of `run()`, after the shutdown.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RunHooks:
    on_started: Callable[[Any], None] | None = None
    on_event: Callable[[Any, Any], None] | None = None
    on_consumed: Callable[[Any], None] | None = None
    on_step: Callable[[Any, dict], None] | None = None
    before_export: Callable[[Any], None] | None = None

    def call(self, name: str, *args) -> None:
        """Call the hook `name` with `args`, if set."""
        hook = getattr(self, name)
        if hook is not None:
            hook(*args)
