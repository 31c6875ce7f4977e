"""The run's log file, `<run dir>/run.log`: lines known to be harmless, kept off the terminal.

What goes there instead of the terminal:
- Ray's INFO lines on the driver ("Started a local Ray instance") and its token-authentication notice;
- MLflow's INFO lines (creating its database tables, a new experiment);
- the error-level line a Ray Data actor pool's worker prints once per reward stream: "... has constructor arguments
  in the object store and max_restarts > 0". Ray Data always passes a map worker's constructor through the object
  store, and the reward streams want restarts (reward_stream.RESTARTS); the arguments live as long as the stream;
- a worker's "model <name>: reusing <cache dir>" (the node's model cache was hit; nothing to do).
Everything else, errors and warnings included, stays on the terminal. Until the run directory exists the lines are
held in memory; a start that fails before it has one prints them (they may explain the failure).
"""

from __future__ import annotations

import logging
import re
import sys
from datetime import UTC, datetime
from pathlib import Path

LOG_FILE = "run.log"

#: (logger, highest level, texts): its records up to that level whose message contains one of the texts (None: any)
HARMLESS_RECORDS: tuple[tuple[str, int, tuple[str, ...] | None], ...] = (
    ("ray", logging.INFO, None),
    ("ray", logging.WARNING, ("Token authentication is enabled",)),
    ("mlflow", logging.INFO, None),
)
#: lines of Ray workers' output (log_to_driver) that match one of these
HARMLESS_WORKER_LINES = (re.compile(r"core_worker\.cc:\d+: .* has constructor arguments in the object store and max_restarts > 0"),
                         re.compile(r"^model \S+: reusing \S+ \(node \w+\)$"))


def harmless_record(record: logging.LogRecord) -> bool:
    return any((record.name == name or record.name.startswith(name + ".")) and record.levelno <= level
               and (texts is None or any(t in record.getMessage() for t in texts))
               for name, level, texts in HARMLESS_RECORDS)


def harmless_worker_line(line: str) -> bool:
    return any(p.search(line) for p in HARMLESS_WORKER_LINES)


class _Divert(logging.Filter):
    """On a handler of Ray's or MLflow's logger: a harmless record goes to the run log instead."""

    def __init__(self, run_log: RunLog):
        super().__init__()
        self.run_log = run_log

    def filter(self, record: logging.LogRecord) -> bool:
        if not harmless_record(record):
            return True
        self.run_log.write(f"{record.levelname} {record.name}: {record.getMessage()}")
        return False


class RunLog:
    """Lines kept off the terminal: held until `attach(run_dir)`, then appended to its run.log."""

    def __init__(self):
        self.held: list[str] = []
        self.path: Path | None = None
        self._undo: list = []

    def write(self, line: str) -> None:
        stamped = f"{datetime.now(UTC).strftime('%H:%M:%S')} {line.rstrip()}"
        if self.path is None:
            self.held.append(stamped)
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(stamped + "\n")

    def attach(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOG_FILE
        with open(self.path, "a", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in self.held)
        self.held = []

    def divert_logging(self, *names: str) -> None:
        """Harmless records of these loggers (their handlers as configured now) go here; call again for a logger
        configured later (MLflow sets its handler when imported)."""
        for name in names:
            for handler in logging.getLogger(name).handlers:
                if not any(isinstance(f, _Divert) for f in handler.filters):
                    divert = _Divert(self)
                    handler.addFilter(divert)
                    self._undo.append(lambda h=handler, d=divert: h.removeFilter(d))

    def divert_worker_output(self) -> None:
        """Harmless lines of the workers' output Ray prints on the driver (ray.init(log_to_driver=True)) go here.
        Ray's dispatcher of worker output is internal (Ray is pinned, pyproject.toml); without it nothing changes."""
        try:
            from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
        except ImportError:
            return
        printing = [h for name, h in getattr(dispatcher, "handlers", []) if name == "ray_print_logs"]
        if not printing:  # log_to_driver=False: nothing is printed
            return
        original = printing[0]

        def filtered(data: dict):
            lines = data.get("lines") or []
            keep = [line for line in lines if not harmless_worker_line(line)]
            for line in lines:
                if harmless_worker_line(line):
                    self.write(f"({data.get('actor_name') or data.get('task_name') or ''} pid={data.get('pid')}) {line}")
            if keep:
                original({**data, "lines": keep})

        dispatcher.remove_handler("ray_print_logs")
        dispatcher.add_handler("ray_print_logs", filtered)

        def undo():
            if any(h is filtered for _, h in dispatcher.handlers):
                dispatcher.remove_handler("ray_print_logs")
                dispatcher.add_handler("ray_print_logs", original)
        self._undo.append(undo)

    def close(self) -> None:
        """Restore the handlers; lines still held (no run directory came) go to stderr."""
        for undo in reversed(self._undo):
            undo()
        self._undo = []
        if self.held:
            sys.stderr.writelines(line + "\n" for line in self.held)
            self.held = []
