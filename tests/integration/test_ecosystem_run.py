"""Environments, rubrics and data from the ecosystem on the real stack, a few steps each: an OpenEnv environment
stepped between turns through the `openenv:` adapter (pipelines/openenv_calc.yaml), a verifiers taskset as the
prompts and its rubric as the reward (pipelines/verifiers_calc.yaml), and prompts from a `datasets` directory."""

from __future__ import annotations

from pathlib import Path

import pytest
from runs import plan_for, run_plan
from test_run import assert_accounted

pytest.importorskip("openenv")
pytest.importorskip("verifiers")
datasets = pytest.importorskip("datasets")

pytestmark = pytest.mark.integration


def trained_of(run_hooks_list: list):
    """RunHooks that record every trajectory the trainer takes (as dicts, with its reward) into `run_hooks_list`."""
    import ray

    from rlflow.runtime.hooks import RunHooks

    def record(run):
        start = run.sink.start

        def recording(batch, info):
            taken = ray.get(run.store.peek.remote(list(batch.rewards)), timeout=60)
            run_hooks_list.extend(t.as_dict() | {"reward": batch.rewards[t.traj_id]} for t in taken)
            return start(batch, info)
        run.sink.start = recording
    return RunHooks(on_started=record)


def test_an_openenv_environment_steps_between_turns_and_its_rubric_scores(ray_cluster, workdir):
    from rlflow import registry

    trained: list[dict] = []
    run = run_plan(plan_for("openenv_calc", "stages.train.steps=2"), hooks=trained_of(trained))
    assert [h["step"] for h in run.history] == [1, 2]
    assert_accounted(run)
    assert run.counts["episode_turns"] > run.counts["episodes"] > 0  # the OpenEnv step ran between turns
    tool_users = [t for t in trained if len(t["turn_starts"]) > 1]
    assert tool_users and all("</calc>=" in t["completion"] for t in tool_users)  # its Observation, as text
    rubric = registry.resolve("reward", "openenv:rlflow.stages.openenv_calc:CalcEnv")
    for t in trained:  # the reward stage scored with the environment's rubric
        assert t["reward"] == rubric(t["completion"], t["answer"], t["prompt"], t["row"])


def test_a_verifiers_taskset_gives_the_prompts_and_its_rubric_the_rewards(ray_cluster, workdir):
    from rlflow import registry

    source = "verifiers:rlflow.stages.verifiers_calc:load_taskset"
    trained: list[dict] = []
    run = run_plan(plan_for("verifiers_calc", "stages.train.steps=2"), hooks=trained_of(trained))
    assert [h["step"] for h in run.history] == [1, 2]
    assert_accounted(run)
    tasks = {r["prompt"]: r for r in registry.resolve("task", source)(seed=0)}
    assert trained and all(tasks[t["prompt"]]["answer"] == t["answer"] for t in trained)  # the taskset's rows
    rubric = registry.resolve("reward", source)
    for t in trained:  # the verifiers Task's @vf.reward, through the adapter
        assert t["reward"] == rubric(t["completion"], t["answer"], t["prompt"], t["row"])


def test_prompts_from_a_datasets_directory_with_a_split_and_a_column_mapping(ray_cluster, workdir):
    from rlflow import registry
    from rlflow.stages.tasks import calc

    rows = calc(seed=3, count=64)
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"question": r["prompt"], "solution": r["answer"]}
                                                              for r in rows])}).save_to_disk("calc_dir")
    trained: list[dict] = []
    plan = plan_for("verifiers_calc", f"data.source={Path('calc_dir').resolve()}", "data.split=train",
                    "data.prompt_field=question", "data.answer_field=solution", "stages.train.steps=2")
    run = run_plan(plan, hooks=trained_of(trained))
    assert [h["step"] for h in run.history] == [1, 2]
    assert_accounted(run)
    prompts = {r["prompt"] for r in rows}
    assert trained and all(t["prompt"] in prompts and t["row"]["solution"] == t["answer"] for t in trained)
    rubric = registry.resolve("reward", "verifiers:rlflow.stages.verifiers_calc:load_taskset")
    for t in trained:  # the Task is rebuilt from the mapped row: its answer is the `solution` column
        assert t["reward"] == rubric(t["completion"], t["answer"], t["prompt"], t["row"])


def test_chat_rows_from_a_datasets_directory_train_with_the_models_chat_template(ray_cluster, workdir):
    import shutil

    from rlflow.prompt_rows import encode_prompt
    from rlflow.stages.tasks import arith
    from rlflow.stages.tiny_model import build_tiny_llama

    model = workdir / "chat_model"  # the tiny model, given a chat template of its own (it has none)
    shutil.copytree(build_tiny_llama("arith", progress=lambda line: None), model)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    chats = [[{"role": "system", "content": "Add."}, {"role": "user", "content": r["prompt"]},
              {"role": "assistant", "content": r["answer"]}] for r in arith(seed=5, count=64)]
    datasets.Dataset.from_dict({"messages": chats}).save_to_disk("chats")
    plan = plan_for("quickstart", f"model.path={model}", f"data.source={Path('chats').resolve()}",
                    "data.prompt_format=messages", "data.prompt_field=messages", "data.answer_field=messages",
                    "stages.score.fn=exact_match", "stages.train.steps=2", "edges.2.policy.filter=null")
    trained: list[dict] = []
    run = run_plan(plan, hooks=trained_of(trained))
    assert [h["step"] for h in run.history] == [1, 2]
    assert_accounted(run)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    answers = {c[1]["content"]: c[2]["content"] for c in chats}
    for t in trained:  # the prompt: the chat up to its last assistant message, rendered by the template
        assert t["answer"] == answers[t["prompt"]]
        chat = next(c for c in chats if c[1]["content"] == t["prompt"])
        assert t["prompt_ids"] == encode_prompt(tok, chat[:2], "messages")
