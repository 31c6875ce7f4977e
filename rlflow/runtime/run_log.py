"""The run's log file, `<run dir>/run.log`: lines known to be harmless, kept off the terminal.

What goes there instead of the terminal:
- Ray's INFO lines on the driver ("Started a local Ray instance") and its token-authentication notice;
- MLflow's INFO lines (creating its database tables, a new experiment);
- the error-level line a Ray Data actor pool's worker prints once per reward stream: "... has constructor arguments
  in the object store and max_restarts > 0". Ray Data always passes a map worker's constructor through the object
  store, and the reward streams want restarts (reward_stream.RESTARTS); the arguments live as long as the stream;
- a worker's "model <name>: reusing <cache dir>" (the node's model cache was hit; nothing to do) and "model <name>:
  materialised N files ... into <cache dir>" (the node's cache was filled from the object store, as it should be);
- DeepSpeed's "Setting accelerator to CPU" WARNING, which its import logs on a machine without a GPU (the run's
  export imports it, through MLflow's transformers flavor); in a process without a run log (`rlflow export` of a
  run directory writes to that run's, see `attach`; the Python API, `rlflow eval`) it is dropped: `quiet_deepspeed`,
  installed when rlflow is imported, filters DeepSpeed's logger before DeepSpeed exists;
- the progress lines DeepSpeed's zero_to_fp32 prints while `rlflow export` joins a ZeRO checkpoint (`printed_here`).
Everything else, errors and warnings included, stays on the terminal. Until the run directory exists the lines are
held in memory; a start that fails before it has one prints them (they may explain the failure).
"""

from __future__ import annotations

import contextlib
import io
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
                         re.compile(r"^model \S+: reusing \S+ \(node \w+\)$"),
                         re.compile(r"^model \S+: materialised \d+ files \(.*\) from the object store into \S+ in "
                                    r"[\d.]+ s \(node \w+\)$"),
                         re.compile(r"^model \S+: another actor on this node materialised \S+ first; using it$"),
                         re.compile(r"\[WARNING\] \[real_accelerator\.py:\d+:get_accelerator\] Setting accelerator to CPU\."))
#: DeepSpeed's logger (its own stdout handler, propagate off: Python's logging config does not reach it)
DEEPSPEED_LOGGER = "DeepSpeed"
#: its records that say nothing to act on: with no GPU visible DeepSpeed picks the CPU, as rlflow wants there
HARMLESS_DEEPSPEED = ("Setting accelerator to CPU",)


_active: RunLog | None = None  # this process's run log (the newest RunLog not closed), if any


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


class _DeepSpeedQuiet(logging.Filter):
    """On DeepSpeed's logger itself (a logger's filters outlive DeepSpeed's LoggerFactory, which adds its handler and
    sets the level when DeepSpeed is imported): a harmless record goes to this process's run log, if it has one."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not any(t in record.getMessage() for t in HARMLESS_DEEPSPEED):
            return True
        if _active is not None:
            _active.write(f"{record.levelname} {record.name}: {record.getMessage()}")
        return False


def quiet_deepspeed() -> None:
    """Install the filter on DeepSpeed's logger (once; DeepSpeed need not be imported yet, and is not imported)."""
    ds = logging.getLogger(DEEPSPEED_LOGGER)
    if not any(isinstance(f, _DeepSpeedQuiet) for f in ds.filters):
        ds.addFilter(_DeepSpeedQuiet())


@contextlib.contextmanager
def printed_here(run_log: RunLog | None = None):
    """What is printed to stdout inside the block (a library's progress prints: DeepSpeed's zero_to_fp32) goes to
    `run_log`, else this process's run log, else nowhere."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            yield
    finally:
        target = run_log or _active
        if target is not None:
            for line in out.getvalue().splitlines():
                if line.strip():
                    target.write(line)


class RunLog:
    """Lines kept off the terminal: held until `attach(run_dir)`, then appended to its run.log. The newest RunLog of
    the process not yet closed is its run log: DeepSpeed's harmless lines go there (quiet_deepspeed)."""

    def __init__(self):
        global _active
        self.held: list[str] = []
        self.path: Path | None = None
        self._undo: list = []
        _active = self

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
        global _active
        if _active is self:
            _active = None
        for undo in reversed(self._undo):
            undo()
        self._undo = []
        if self.held:
            sys.stderr.writelines(line + "\n" for line in self.held)
            self.held = []
