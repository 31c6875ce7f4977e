"""The README's "Your own task" is a working recipe: its three files, taken from the README as written, make data,
compile, and give the tiny model rows to warm-start on (benchmarks/own_task.py runs them to the end and measures)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys


def own_task_files(repo) -> dict[str, str]:
    spec = importlib.util.spec_from_file_location("own_task", repo / "benchmarks" / "own_task.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.own_task_files((repo / "README.md").read_text())


def test_the_readme_recipe_compiles_and_its_reward_scores(repo, tmp_path, monkeypatch):
    from rlflow.compiler import compile_pipeline, model_note
    from rlflow.plan_model import Plan
    from rlflow.runtime.model import warm_start_of

    files = own_task_files(repo)
    assert list(files) == ["make_data.py", "my_rewards.py", "sort.yaml"]
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    subprocess.run([sys.executable, "make_data.py"], cwd=tmp_path, check=True)
    assert len((tmp_path / "digits.jsonl").read_text().splitlines()) == 4000
    monkeypatch.chdir(tmp_path)
    try:
        plan = compile_pipeline(tmp_path / "sort.yaml")
    finally:  # compile imported the README's my_rewards.py: later tests in this process name a module so too
        sys.modules.pop("my_rewards", None)
    assert "warm-started on the training rows of" in model_note(plan)[0]
    what, rows = warm_start_of(Plan.of(plan))
    assert what.endswith("digits.jsonl") and len(rows) > 3000  # 10% held out
    assert all(r["answer"].split() == sorted(r["prompt"].split()[1:-1]) for r in rows[:50])
    spec = importlib.util.spec_from_file_location("readme_my_rewards", tmp_path / "my_rewards.py")
    rewards = importlib.util.module_from_spec(spec)  # not `import my_rewards`: sys.modules would keep it for later tests
    spec.loader.exec_module(rewards)
    sorted_digits = rewards.sorted_digits
    assert sorted_digits(" 1 3 7", "1 3 7") == 1.0 and sorted_digits("3 1 7", "1 3 7") == 0.0
