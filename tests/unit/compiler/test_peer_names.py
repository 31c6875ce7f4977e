"""Did-you-mean knows the names users of TRL, verl and OpenRLHF bring (rlflow/peer_names.py), says under which stage
rlflow's field belongs, and a problem a `--set` caused points at that override rather than a line of the file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlflow import loader
from rlflow.cli import main
from rlflow.errors import PipelineInvalid
from rlflow.peer_names import PEER_NAMES, PLACES
from rlflow.validate import validate_partial

REPO = Path(__file__).resolve().parents[3]
QUICKSTART = REPO / "pipelines" / "quickstart.yaml"
PIPELINE = {
    "name": "peers",
    "model": {"path": "builtin:tiny-llama", "max_model_len": 128},
    "data": {"source": "builtin:arith"},
    "stages": {"gen": {"kind": "rollout", "group_size": 4, "max_new_tokens": 16},
               "score": {"kind": "reward", "fn": "exact_match"},
               "buf": {"kind": "buffer", "batch_groups": 8},
               "learner": {"kind": "train", "deepspeed": "configs/deepspeed/zero1.json"}},
    "edges": [{"from": "data", "to": "gen", "policy": {"kind": "streaming"}},
              {"from": "gen", "to": "score", "policy": {"kind": "streaming"}},
              {"from": "score", "to": "buf", "policy": {"kind": "streaming"}},
              {"from": "buf", "to": "learner", "policy": {"kind": "staleness_bound", "eta": 1}},
              {"from": "learner", "to": "gen", "policy": {"kind": "weight_sync"}}],
}
WHERE = {"rollout": ("stages", "gen"), "reward": ("stages", "score"), "buffer": ("stages", "buf"),
         "train": ("stages", "learner"), "model": ("model",), "data": ("data",), "pipeline": ()}


@pytest.mark.parametrize("name", sorted(PEER_NAMES))
def test_every_target_is_a_real_field_of_its_place(name):
    """The table cannot rot: a renamed or removed field fails here, naming the peer name that points at it."""
    entry = PEER_NAMES[name]
    assert entry.place in PLACES, f"{name}: no place {entry.place!r}"
    cls = PLACES[entry.place]
    fields = {f.alias or n for n, f in cls.model_fields.items()}
    assert entry.field in fields, f"{name} -> {entry.place}.{entry.field}, which `rlflow schema` does not have"
    assert set(entry.only_in) <= set(PLACES)
    assert name == name.lower() and "-" not in name  # looked up lowercased, dashes read as underscores
    assert name not in fields or name == entry.field  # rlflow's own name for another field of its place: confusing


def unknown_field(place: str, name: str) -> str:
    """The problem line for `name: 1` written at `place` of PIPELINE."""
    data = yaml.safe_load(yaml.safe_dump(PIPELINE))
    node = data
    for part in WHERE[place]:
        node = node[part]
    node[name] = 1
    doc = loader.parse(yaml.safe_dump(data, sort_keys=False), "p.yaml")
    _, problems, _ = validate_partial(doc)
    (problem,) = [p for p in problems if p.rule == "unknown-field"]
    return problem.render()


@pytest.mark.parametrize("place, name, expected", [
    ("train", "learning_rate", "(did you mean 'lr'? TRL's 'learning_rate' is rlflow's 'lr')"),
    ("train", "actor_learning_rate", "(did you mean 'lr'? OpenRLHF's 'actor_learning_rate' is rlflow's 'lr')"),
    ("rollout", "num_generations", "(did you mean 'group_size'? TRL's 'num_generations' is rlflow's 'group_size' (completions per prompt))"),
    ("rollout", "n_samples_per_prompt", "did you mean 'group_size'?"),
    ("rollout", "n", "(did you mean 'group_size'? verl's 'rollout.n' is rlflow's 'group_size'"),
    ("train", "num_generations", "which belongs under a rollout stage; set stages.gen.group_size instead"),
    ("buffer", "per_device_train_batch_size", "did you mean 'batch_groups'?"),
    ("pipeline", "rollout_batch_size", "OpenRLHF's 'rollout_batch_size' is rlflow's 'batch_groups' (prompts per step), which "
                                       "belongs under a buffer stage; set stages.buf.batch_groups instead"),
    ("data", "train_batch_size", "set stages.buf.batch_groups instead"),
    ("rollout", "max_completion_length", "did you mean 'max_new_tokens'?"),
    ("rollout", "generate_max_len", "did you mean 'max_new_tokens'?"),
    ("train", "response_length", "set stages.gen.max_new_tokens instead"),
    ("rollout", "max_prompt_length", "is rlflow's 'max_model_len' (rlflow bounds prompt + completion together"),
    ("train", "beta", "(did you mean 'kl_coef'? TRL's 'beta' is rlflow's 'kl_coef'"),
    ("train", "init_kl_coef", "did you mean 'kl_coef'?"),
    ("train", "eps_clip", "did you mean 'clip_low'?"),
    ("train", "clip_ratio", "did you mean 'clip_low'?"),
    ("train", "num_iterations", "did you mean 'epochs'?"),
    ("train", "ppo_epochs", "did you mean 'epochs'?"),
    ("train", "warmup_ratio", "did you mean 'lr_warmup_steps'?"),
    ("train", "lr_scheduler_type", "did you mean 'lr_schedule'?"),
    ("train", "loss_type", "did you mean 'loss_agg'?"),
    ("train", "temperature", "'temperature' belongs under a rollout stage"),
    ("pipeline", "model_name_or_path", "set model.path instead"),
    ("train", "pretrain", "set model.path instead"),
    ("data", "prompt_data", "did you mean 'source'?"),
    ("pipeline", "dataset_name", "set data.source instead"),
    ("rollout", "kl_coef", "'kl_coef' belongs under a train stage; set stages.learner.kl_coef instead"),  # rlflow's own name
    ("train", "lerning_rate", "did you mean 'lr'?"),  # close to a peer's name of a field allowed here
    ("rollout", "replica", "(did you mean 'replicas'?)"),  # string similarity, as before
])
def test_a_peer_name_points_at_rlflows_field(place, name, expected):
    assert expected in unknown_field(place, name)


def test_learning_rate_no_longer_suggests_lr_min_ratio():
    assert "did you mean 'lr_min_ratio'" not in unknown_field("train", "learning_rate")


def test_validate_suggests_lr_for_learning_rate_exit_2_without_traceback(tmp_path):
    data = yaml.safe_load(yaml.safe_dump(PIPELINE))
    data["stages"]["learner"]["learning_rate"] = 1e-5
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    proc = subprocess.run([sys.executable, "-m", "rlflow.cli", "validate", str(path)], capture_output=True, text=True,
                          cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "stages.learner.learning_rate (line " in proc.stderr
    assert "unknown field 'learning_rate' (did you mean 'lr'? TRL's 'learning_rate' is rlflow's 'lr')" in proc.stderr


def problem_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("  ")]


@pytest.mark.parametrize("command", ["validate", "compile"])
def test_a_set_typo_names_the_override_not_a_line(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rc = main([command, str(QUICKSTART), "--set", "stages.train.learning_rate=1e-5"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    (line,) = problem_lines(err)
    assert line.startswith("  stages.train.learning_rate (--set stages.train.learning_rate=1e-5): unknown field "
                           "'learning_rate' (did you mean 'lr'?"), line
    assert "(line " not in line
    assert list(tmp_path.iterdir()) == []


def test_a_bad_value_from_set_names_the_override_though_the_file_sets_it_too(capsys):
    # quickstart's line 11 sets lr: the --set replaced it, so that line is not where the bad value is
    assert main(["validate", str(QUICKSTART), "stages.train.lr=fast"]) == 2
    (line,) = problem_lines(capsys.readouterr().err)
    assert line.startswith("  stages.train.lr (--set stages.train.lr=fast): 'lr' must be a number, got 'fast'"), line


def test_a_graph_problem_from_set_names_the_override(capsys):
    assert main(["validate", str(QUICKSTART), "--set", "edges.3.to=trian"]) == 2
    (line,) = problem_lines(capsys.readouterr().err)
    assert line.startswith("  edges[3].to (--set edges.3.to=trian): unknown stage 'trian' (did you mean 'train'?)"), line


def test_run_with_a_set_typo_names_the_override(tmp_path, monkeypatch, capsys):
    from rlflow.runtime import launch

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("a run of an invalid plan started"))
    assert main(["compile", str(QUICKSTART)]) == 0
    capsys.readouterr()
    assert main(["run", "--set", "stages.rollout.num_generations=4"]) == 2
    (line,) = problem_lines(capsys.readouterr().err)
    assert line.startswith("  stages.rollout.num_generations (--set stages.rollout.num_generations=4): unknown field "
                           "'num_generations' (did you mean 'group_size'?"), line


def test_problems_of_the_file_keep_their_lines_beside_an_override():
    doc = loader.load(QUICKSTART)
    loader.apply_overrides(doc, ["stages.trian.lr=1", "stages.train.steps=0"])
    _, problems, _ = validate_partial(doc)
    rendered = PipelineInvalid(doc.source, problems).render()
    assert "stages.trian (--set stages.trian.lr=1): this stage has no 'kind'" in rendered  # a mapping the --set made
    assert "stages.train.steps (--set stages.train.steps=0): 'steps' must be >= 1" in rendered


def test_a_later_override_of_a_parent_takes_the_blame():
    doc = loader.load(QUICKSTART)
    loader.apply_overrides(doc, ["stages.train.lr=1", "stages.train={kind: train, lr: x}"])
    assert doc.override_of(("stages", "train", "lr")) == "stages.train={kind: train, lr: x}"
    assert doc.override_of(("stages", "rollout", "group_size")) is None
