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
        dispatcher.emit({"pid": 9, "lines": [  # model_shipping.local_model_dir's lines, as it formats them
            "model tiny-llama-x: materialised 6 files (2.4 MB) from the object store into /c/shipped/tiny-llama-x-0466 "
            "in 0.31 s (node 9aad2bf7)", "model m: another actor on this node materialised /c/m first; using it",
            "[2026-12-07 23:53:18,016] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU. "
            "If you have GPU or other accelerator, we were unable to detect it.", "model m: something else"]})
        assert printed == [{"pid": 7, "actor_name": "StreamHost", "is_err": True, "lines": ["a real error"]},
                           {"pid": 9, "lines": ["model m: something else"]}]
        assert len(log.held) == 5 and "(StreamHost pid=7)" in log.held[0]
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


def test_deepspeeds_accelerator_warning_goes_to_the_run_log_not_the_terminal(tmp_path):
    """With no GPU visible DeepSpeed's import logs "Setting accelerator to CPU" as a WARNING on its own stdout handler:
    in a process that imported rlflow first, the line is in the run log and on neither stream. A real import of
    DeepSpeed, in a process of its own (it picks the accelerator once per process)."""
    import os
    import subprocess
    import sys

    code = ("import rlflow\n"
            "from rlflow.runtime.run_log import RunLog\n"
            f"log = RunLog(); log.attach({str(tmp_path)!r})\n"
            "import deepspeed\n"
            "log.close()\n")
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"} | {"CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Setting accelerator" not in done.stdout + done.stderr, done.stdout + done.stderr
    assert "WARNING DeepSpeed: Setting accelerator to CPU" in (tmp_path / run_log.LOG_FILE).read_text()


def test_what_a_block_prints_goes_to_the_run_log(tmp_path, capsys):
    """rlflow export joins a ZeRO checkpoint inside printed_here: zero_to_fp32's progress prints go to the run log."""
    log = RunLog()
    log.attach(tmp_path)
    with run_log.printed_here():
        print("Processing zero checkpoint 'x/step-3'")
        print("Reconstructed fp32 state dict with 12 params 4096 elements")
    log.close()
    assert capsys.readouterr().out == ""
    text = (tmp_path / run_log.LOG_FILE).read_text()
    assert "Processing zero checkpoint 'x/step-3'" in text and "Reconstructed fp32 state dict" in text
    with run_log.printed_here():  # no run log in this process: nowhere
        print("Detected checkpoint of type zero stage 2, world_size: 1")
    assert capsys.readouterr().out == ""


def test_one_evaluation_is_a_value_and_a_drop_while_the_reward_rose_is_pointed_out():
    base = {"steps": 150, "elapsed_s": 600.0, "stopped": False, "stopped_by": None}
    one = base | {"eval_first": {"step": 0, "eval/accuracy": 0.6}, "eval_last": {"step": 0, "eval/accuracy": 0.6},
                  "evals": 1, "reward_first": 0.2, "reward_last": 0.2}
    lines = run_summary.describe(one, 150)
    assert [line for line in lines if line.startswith("held-out")] == ["held-out accuracy 0.600 (step 0)"], lines

    diverged = base | {"eval_first": {"step": 0, "eval/accuracy": 0.6}, "eval_last": {"step": 150, "eval/accuracy": 0.4},
                       "evals": 4, "reward_first": 0.30, "reward_last": 0.55}
    lines = run_summary.describe(diverged, 150)
    assert "held-out accuracy 0.600 (step 0) -> 0.400 (step 150)" in lines
    (note,) = [line for line in lines if line.startswith("note: ")]
    assert "reward rose (0.300 -> 0.550)" in note and "fell (0.600 -> 0.400)" in note
    assert "overfitting the training prompts" in note and "reward hacking" in note and "MLflow" in note
    assert lines.index(note) == lines.index("held-out accuracy 0.600 (step 0) -> 0.400 (step 150)") + 1

    # no note: accuracy within the margin, or the reward did not rise, or both improved
    for first, last, r0, r1 in ((0.6, 0.55, 0.3, 0.55), (0.6, 0.4, 0.3, 0.3), (0.4, 0.6, 0.3, 0.55)):
        calm = base | {"eval_first": {"step": 0, "eval/accuracy": first},
                       "eval_last": {"step": 150, "eval/accuracy": last}, "reward_first": r0, "reward_last": r1}
        assert not [line for line in run_summary.describe(calm, 150) if line.startswith("note: ")], (first, last)
