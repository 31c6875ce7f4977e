"""What `rlflow run` keeps off the terminal (run_log.py) and the summary it ends with (run_summary.py)."""

from __future__ import annotations

import json
import logging

from rlflow.runtime import run_log, run_summary
from rlflow.runtime.run_log import RunLog, harmless_record, harmless_worker_line


def record(name: str, level: int, message: str) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, message, None, None)


def test_only_known_harmless_records_and_worker_lines_leave_the_terminal():
    assert harmless_record(record("ray._private.worker", logging.INFO, "Started a local Ray instance."))
    assert harmless_record(record("ray._private.authentication.authentication_token_setup", logging.WARNING,
                                  "Token authentication is enabled for this Ray cluster."))
    assert harmless_record(record("mlflow.store.db.utils", logging.INFO, "Creating initial MLflow database tables..."))
    assert not harmless_record(record("ray._private.worker", logging.WARNING, "A worker died or was killed"))
    assert not harmless_record(record("mlflow.tracking", logging.WARNING, "could not log"))
    assert not harmless_record(record("ray", logging.ERROR, "Started a local Ray instance."))
    assert not harmless_record(record("rayish", logging.INFO, "x"))
    assert harmless_worker_line("[2026-11-26 03:07:22,565 E 27881 27951] core_worker.cc:2465: Actor with class name: "
                                "'MapWorker(MapBatches(Score))' and ID: 'dee0' has constructor arguments in the object "
                                "store and max_restarts > 0. If the arguments ...")
    assert harmless_worker_line("model tiny-llama-repeat-seed0-3161: reusing /root/.cache/rlflow/shipped/x (node 25011a4a)")
    assert not harmless_worker_line("[2026-11-26 03:07:22,565 E 27881 27951] core_worker.cc:100: task failed")
    assert not harmless_worker_line("Traceback (most recent call last):")


def test_lines_are_held_until_the_run_directory_then_appended_and_handlers_restored(tmp_path, capsys):
    logger = logging.getLogger("mlflow.test_run_output")
    parent = logging.getLogger("mlflow")
    handler, level = logging.StreamHandler(), parent.level
    parent.addHandler(handler)
    parent.setLevel(logging.INFO)
    try:
        log = RunLog()
        log.divert_logging("mlflow")
        logger.warning("kept on the terminal")
        logger.info("Creating initial MLflow database tables...")
        assert log.held and log.held[0].endswith("INFO mlflow.test_run_output: Creating initial MLflow database tables...")
        log.attach(tmp_path)
        logger.info("Updating database tables")
        log.close()
        assert handler.filters == []
        text = (tmp_path / run_log.LOG_FILE).read_text()
        assert "Creating initial" in text and "Updating database tables" in text and "kept on" not in text
        assert "kept on the terminal" in capsys.readouterr().err
    finally:
        parent.removeHandler(handler)
        parent.setLevel(level)


def test_a_start_that_fails_before_its_run_directory_prints_the_held_lines(capsys):
    log = RunLog()
    log.write("INFO ray._private.worker: Started a local Ray instance.")
    log.close()
    assert "Started a local Ray instance." in capsys.readouterr().err


def test_worker_output_is_filtered_through_rays_dispatcher():
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    printed = []
    dispatcher.add_handler("ray_print_logs", printed.append)
    try:
        log = RunLog()
        log.divert_worker_output()
        dispatcher.emit({"pid": 7, "actor_name": "StreamHost", "is_err": True,
                         "lines": ["x core_worker.cc:2465: Actor ... has constructor arguments in the object store and "
                                   "max_restarts > 0. ...", "a real error"]})
        dispatcher.emit({"pid": 8, "lines": ["model m: reusing /c/m (node 1234abcd)"]})
        assert printed == [{"pid": 7, "actor_name": "StreamHost", "is_err": True, "lines": ["a real error"]}]
        assert len(log.held) == 2 and "(StreamHost pid=7)" in log.held[0]
        log.held = []
        log.close()
        assert [h for name, h in dispatcher.handlers if name == "ray_print_logs"] == [printed.append]
    finally:
        dispatcher.remove_handler("ray_print_logs")


def test_the_summary_is_a_few_lines_and_the_json_goes_to_the_run_directory(tmp_path):
    (tmp_path / "export").mkdir()
    summary = {"steps": 5, "reward_first": 0.247, "reward_last": 0.292, "window": 1, "elapsed_s": 62.4,
               "mlflow_run_id": "ffe4", "mlflow_uri": "sqlite:///m.db", "run_dir": str(tmp_path), "stopped": False,
               "stopped_by": None, "counters": {"consumed": 80}}
    lines = run_summary.describe(summary, 5)
    assert lines == [
        "done: 5 steps in 1 m 02 s; reward(all) 0.247 -> 0.292",
        f"run directory: {tmp_path} (summary.json, run.log, checkpoint/, export/)",
        f"the policy: {tmp_path / 'export'} (transformers.AutoModelForCausalLM.from_pretrained loads it)",
        "MLflow run ffe4: mlflow ui --backend-store-uri sqlite:///m.db",
        f"next: rlflow eval {tmp_path}   rlflow export {tmp_path} -o DIR"]
    stopped = run_summary.describe(summary | {"steps": 3, "stopped": True, "stopped_by": "SIGINT"}, 5)
    assert stopped[0].startswith("stopped (SIGINT): 3 of 5 steps in 1 m 02 s")
    assert any(line.startswith(f"resume with: rlflow run --resume (the newest run), or --resume {tmp_path.name}")
               for line in stopped)
    assert json.loads(run_summary.write(summary, tmp_path).read_text()) == summary


def test_the_progress_line_is_drawn_though_ray_replaced_builtins_print(monkeypatch):
    """Ray's tqdm_ray replaces builtins.print on a driver at a terminal; launch's `log=print` is still Python's own."""
    import builtins

    from rlflow.runtime.metrics import _is_print

    # Python's own print, even where an earlier test in this process already let Ray replace it
    own = builtins.print if builtins.print.__module__ == "builtins" else __import__("ray.experimental.tqdm_ray",
                                                                                    fromlist=["_print"])._print
    monkeypatch.setattr(builtins, "print", lambda *a, **k: None)
    assert _is_print(own) and not _is_print(lambda *a: None)
