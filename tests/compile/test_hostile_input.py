"""Hostile and bad pipeline files exit 2 quickly with one line each (issue 12, item 5), and user code
beside the pipeline or in the working directory is found without PYTHONPATH and recorded in the plan."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlflow import user_code
from rlflow.cli import main
from rlflow.compiler import compile_pipeline

REPO = Path(__file__).resolve().parents[2]
ZERO1 = REPO / "configs" / "deepspeed" / "zero1.json"
HANG_GUARD_S = 60  # a subprocess that runs this long is hung; the budget asserted is far smaller
FAST_S = 1.5  # in-process, on a loaded 2-core machine: a bound or a hang, nothing in between

PIPELINE = f"""name: user-code
data: {{source: "builtin:arith"}}
stages:
  rollout: {{kind: rollout, group_size: 4, max_new_tokens: 16}}
  score:   {{kind: reward, fn: "{{fn}}"}}
  buffer:  {{kind: buffer, batch_groups: 8}}
  train:   {{kind: train, deepspeed: "{ZERO1}"}}
edges:
  - {{from: data,    to: rollout, policy: {{kind: streaming}}}}
  - {{from: rollout, to: score,   policy: {{kind: streaming}}}}
  - {{from: score,   to: buffer,  policy: {{kind: streaming}}}}
  - {{from: buffer,  to: train,   policy: {{kind: staleness_bound, eta: 2}}}}
  - {{from: train,   to: rollout, policy: {{kind: weight_sync}}}}
"""

BOMB = "".join(f"{c}: &{c} [{', '.join([f'*{p}'] * 9) if p else ', '.join(['lol'] * 9)}]\n"
               for p, c in zip([None, *"abcdefgh"], "abcdefghi"))
HOSTILE = {
    "alias_bomb": (BOMB, "yaml-too-many-values"),
    "deep_flow_sequences": ("name: " + "[" * 3000 + "]" * 3000 + "\n", "yaml-too-deep"),
    "deep_flow_mappings": ("name: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n", "yaml-too-deep"),
    "deep_block_sequences": ("- " * 3000 + "1\n", "yaml-too-deep"),
    "many_values": ("name: [" + ", ".join(["1"] * 20_000) + "]\n", "yaml-too-many-values"),
    "huge_file": ("name: x\n" + "# padding\n" * 20_000, "file-too-large"),
    "python_object_tag": ("name: !!python/object/apply:os.system ['echo hi']\n", "unknown-tag"),
    "recursive_alias": ("name: &n [1, *n]\n", "yaml-recursive-alias"),
    "tag_on_mapping": ("name: x\ndata: !custom {source: 'builtin:arith'}\n", "unknown-tag"),
    "list_as_key": ("? [a, b]\n: 1\n", "bad-key"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_yaml_exits_2_with_one_line_quickly(name, tmp_path, capsys):
    text, rule = HOSTILE[name]
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    start = time.perf_counter()
    rc = main(["validate", str(path)])
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    assert err.splitlines()[0] == f"{path}: 1 error" and f"[{rule}]" in err and len(err.splitlines()) == 2, err
    assert elapsed < FAST_S, f"{name} took {elapsed:.2f}s"


@pytest.mark.parametrize("name", ["alias_bomb", "deep_flow_sequences", "python_object_tag"])
def test_without_libyaml_the_same_bounds_hold(name, tmp_path, capsys, monkeypatch):
    import yaml

    monkeypatch.delattr(yaml, "CSafeLoader", raising=False)  # the pure-Python parser: slower, same answers
    path = tmp_path / f"{name}.yaml"
    path.write_text(HOSTILE[name][0])
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"[{HOSTILE[name][1]}]" in err and len(err.splitlines()) == 2, err


@pytest.mark.parametrize("name", ["alias_bomb", "deep_flow_sequences"])
def test_hostile_yaml_from_the_console_script(name, tmp_path):
    path = tmp_path / f"{name}.yaml"
    path.write_text(HOSTILE[name][0])
    proc = subprocess.run([sys.executable, "-m", "rlflow.cli", "compile", str(path), "-o", str(tmp_path / "p.json")],
                          check=False, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 2, proc.stderr
    assert not (tmp_path / "p.json").exists()


def test_anchors_aliases_and_merge_keys_still_work(tmp_path):
    text = PIPELINE.replace('fn: "{fn}"', "fn: exact_match")
    text = text.replace("to: rollout, policy: {kind: streaming}}", "to: rollout, policy: &stream {kind: streaming}}")
    text = text.replace("to: score,   policy: {kind: streaming}}", "to: score,   policy: *stream}")
    text = text.replace("to: buffer,  policy: {kind: streaming}}", "to: buffer,  policy: {<<: *stream}}")
    path = tmp_path / "anchors.yaml"
    path.write_text(text)
    plan = compile_pipeline(path)
    assert [e["policy"]["kind"] for e in plan["graph"]["edges"][:3]] == ["streaming"] * 3
    from rlflow.loader import parse

    doc = parse("base: &b {x: 1, y: 2}\nother:\n  <<: *b\n  y: 3\n", "s")
    assert doc.data["other"] == {"y": 3, "x": 1}


# --------------------------------------------------------------------------- user code: where it is found


def _pipeline(where: Path, fn: str) -> Path:
    path = where / "pipeline.yaml"
    path.write_text(PIPELINE.replace("{fn}", fn))
    return path


def test_module_beside_the_pipeline_is_found_and_recorded(tmp_path, monkeypatch):
    (tmp_path / "beside_rewards_a.py").write_text("def score(completion, answer):\n    return 1.0\n")
    monkeypatch.chdir(REPO)
    path_before = list(sys.path)
    plan = compile_pipeline(_pipeline(tmp_path, "beside_rewards_a:score"))
    assert plan["python_path"] == [str(tmp_path.resolve())]
    assert sys.path == path_before  # the import check leaves sys.path as it was


def test_module_in_the_working_directory_is_found_and_recorded(tmp_path, monkeypatch):
    work, pipes = tmp_path / "work", tmp_path / "pipes"
    work.mkdir(), pipes.mkdir()
    (work / "cwd_rewards_b.py").write_text("def score(completion, answer, *, prompt=None, **kw):\n    return 1.0\n")
    monkeypatch.chdir(work)
    plan = compile_pipeline(_pipeline(pipes, "cwd_rewards_b:score"))
    assert plan["python_path"] == [str(work.resolve())]


def test_installed_module_needs_no_python_path(tmp_path):
    plan = compile_pipeline(_pipeline(tmp_path, "rlflow.stages.rewards:exact_match"))
    assert plan["python_path"] == []


def test_compile_finds_a_module_beside_the_pipeline_without_pythonpath(tmp_path):
    (tmp_path / "beside_rewards_c.py").write_text("def score(completion, answer):\n    return 0.0\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = subprocess.run([sys.executable, "-m", "rlflow.cli", "compile", str(_pipeline(tmp_path, "beside_rewards_c:score")),
                           "-o", str(tmp_path / "plan.json")], check=False, capture_output=True, text=True, cwd=elsewhere, env=env,
                          timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "plan.json").read_text())["python_path"] == [str(tmp_path.resolve())]


def test_a_module_whose_own_import_fails_is_its_authors_bug_not_a_missing_module(tmp_path, capsys):
    (tmp_path / "needs_dep_d.py").write_text("import nosuchdependency_zz\n\ndef score(completion, answer):\n    return 1.0\n")
    assert main(["validate", str(_pipeline(tmp_path, "needs_dep_d:score"))]) == 2
    err = capsys.readouterr().err
    assert "importing 'needs_dep_d' failed: No module named 'nosuchdependency_zz'" in err and "[import-failed]" in err


# --------------------------------------------------------------------------- schema and graph problems together


def test_graph_rules_do_not_echo_a_value_the_schema_rejected(tmp_path, capsys):
    """A bad max_model_len is replaced by its default for the graph rules; no-room-for-prompt would judge that
    stand-in, so it is not reported, while the unknown reward is."""
    text = PIPELINE.replace('fn: "{fn}"', "fn: exact_mach").replace("max_new_tokens: 16", "max_new_tokens: 600")
    path = tmp_path / "p.yaml"
    path.write_text(text.replace("data: {", "model: {max_model_len: huge}\ndata: {"))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0].endswith("2 errors"), err
    assert "[not-an-integer]" in err and "[unknown-reward]" in err and "no-room-for-prompt" not in err


# --------------------------------------------------------------------------- user code: what fits


def _fits(category: str, obj) -> str | None:
    return user_code.misfit(category, f"tests:{getattr(obj, '__name__', 'obj')}", obj)


class _Callable:
    def __call__(self, completion, answer):
        return 1.0


class _Ranker:
    def predict(self, prompts):
        return [0.0 for _ in prompts]

    def observe(self, prompts, lengths):
        pass


@pytest.mark.parametrize("fn", [
    lambda completion, answer: 1.0,
    lambda completion, answer, prompt=None, row=None: 1.0,
    lambda completion, answer, prompt: 1.0,  # the runtime passes prompt= to a reward that names it
    lambda completion, answer, *, row: 1.0,
    lambda completion, answer, **kwargs: 1.0,
    lambda *args: 1.0,
    _Callable(),
], ids=["two", "optional-extras", "required-prompt", "keyword-row", "kwargs", "varargs", "callable-object"])
def test_rewards_the_runtime_can_call_are_accepted(fn):
    assert _fits("reward", fn) is None


def test_filters_and_rankers_that_fit_are_accepted():
    assert _fits("filter", lambda rewards: True) is None
    assert _fits("ranker", _Ranker) is None
    assert _fits("ranker", lambda: _Ranker()) is None


def test_reward_rule_matches_the_runtime_caller():
    """user_code's reward rule passes the same keywords as the runtime's reward_caller."""
    reward_stream = pytest.importorskip("rlflow.runtime.reward_call")
    seen = {}

    def record(completion, answer, prompt, *, row=None):
        seen.update(prompt=prompt, row=row)
        return 1.0

    assert _fits("reward", record) is None
    reward_stream.reward_caller(record)("c", "a", "p", {"r": 1})
    assert seen == {"prompt": "p", "row": {"r": 1}}
