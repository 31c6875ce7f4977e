"""The parts of multi-node runs that need no cluster: shipping the model directory (a fake object store),
placement rules (compile and run start), the user modules shipped with py_modules, where data is read."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from rlflow import placement
from rlflow.compiler import compile_pipeline
from rlflow.errors import PipelineInvalid
from rlflow.plan_model import Plan
from rlflow.runtime import model_shipping
from rlflow.runtime.launch import user_modules
from rlflow.runtime.prompt_source import on_this_node

REPO = Path(__file__).resolve().parents[3]


class FakeStore:
    """ray.put / ray.get / the runtime context, in memory, counting gets."""

    def __init__(self):
        self.objects, self.gets = {}, 0

    def put(self, value):
        ref = f"ref-{len(self.objects)}"
        self.objects[ref] = value
        return ref

    def get(self, ref):
        self.gets += 1
        return self.objects[ref]

    def get_runtime_context(self):
        class Ctx:
            def get_job_id(self):
                return "01000000"

            def get_node_id(self):
                return "abcdef0123456789"

        return Ctx()


@pytest.fixture
def store(monkeypatch, tmp_path):
    fake = FakeStore()
    monkeypatch.setattr(model_shipping, "ray", fake)
    monkeypatch.setattr(model_shipping, "_SHIPPED", {})
    monkeypatch.setenv("RLFLOW_CACHE", str(tmp_path / "node-cache"))
    return fake


def a_model(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "llama"}')
    (root / "model.safetensors").write_bytes(bytes(range(256)) * 100)
    (root / "sub" / "tokenizer.json").write_text("{}")
    (root / "empty.txt").write_bytes(b"")
    return root


def test_model_is_materialised_from_the_store_once_per_node(store, tmp_path):
    src = a_model(tmp_path / "driver" / "tiny")
    shipped = model_shipping.ship_model(src)
    assert {rel for rel, _, _ in shipped.files} == {"config.json", "model.safetensors", "sub/tokenizer.json", "empty.txt"}
    assert model_shipping.ship_model(src) is shipped  # once per directory: no second put
    lines = []
    local = Path(model_shipping.local_model_dir(shipped, log=lines.append))
    assert local.parent == tmp_path / "node-cache" / "shipped" and local.name == f"tiny-{shipped.digest[:16]}"
    for f in src.rglob("*"):
        if f.is_file():
            assert (local / f.relative_to(src)).read_bytes() == f.read_bytes()
    assert "materialised 4 files" in lines[0] and "from the object store" in lines[0]
    gets = store.gets
    assert model_shipping.local_model_dir(shipped, log=lines.append) == str(local)  # a second actor reuses it
    assert store.gets == gets and "reusing" in lines[1]
    assert not [p for p in local.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left behind


def test_changed_files_ship_again_under_another_hash(store, tmp_path):
    src = a_model(tmp_path / "tiny")
    first = model_shipping.ship_model(src)
    (src / "config.json").write_text('{"model_type": "llama", "x": 1}')
    second = model_shipping.ship_model(src)
    assert second.digest != first.digest


def test_concurrent_actors_on_one_node_end_with_one_whole_copy(store, tmp_path):
    shipped = model_shipping.ship_model(a_model(tmp_path / "tiny"))
    results, errors = [], []

    def actor():
        try:
            results.append(model_shipping.local_model_dir(shipped, log=lambda *_: None))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=actor) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert [p.name for p in (tmp_path / "node-cache" / "shipped").iterdir()] == [Path(results[0]).name]


def test_a_path_passes_through(store):
    assert model_shipping.local_model_dir("/some/dir") == "/some/dir"


def placed_plan(*overrides: str) -> Plan:
    return Plan.of(compile_pipeline(REPO / "pipelines" / "synchronous.yaml", list(overrides)))


def test_stage_resources_are_lowered_into_the_plan():
    plan = placed_plan("stages.rollout.resources.worker_node=1", "stages.rollout.replicas=2",
                       "stages.train.resources={head_node: 1}", "stages.score.resources.worker_node=0.5")
    rollout = [a for a in plan["actors"] if a["role"] == "rollout"]
    assert [a["resources"] for a in rollout] == [{"worker_node": 1.0}] * 2
    assert next(a for a in plan["actors"] if a["role"] == "trainer")["resources"] == {"head_node": 1.0}
    assert next(o for o in plan["data_operators"] if o["kind"] == "reward")["resources"] == {"worker_node": 0.5}
    assert placement.embedded_resources(plan) == {"worker_node": 2.5, "head_node": 1.0}


def node(**resources):
    return {"Alive": True, "Resources": {"CPU": 2.0, "memory": 1e9, "node:127.0.0.1": 1.0, **resources}}


def test_a_cluster_that_lost_a_node_is_unplaceable_at_once():
    """--resume after losing a node: the alive nodes hold fewer CPUs than the plan's actors need (2.45 here), so
    the run fails at once by name instead of waiting for a placement the cluster can never give."""
    plan = placed_plan()
    placement.check_cluster(plan, [node(), node()], "the cluster")  # 4 CPUs: fits
    with pytest.raises(PipelineInvalid) as err:
        placement.check_cluster(plan, [node(), {**node(), "Alive": False}], "the cluster")
    (p,) = err.value.problems
    assert p.rule == "unplaceable" and p.loc == ("resources", "num_cpus")
    assert "the cluster offers 2 CPU(s) on its 1 alive node(s), but the plan's actors need 2.45 at once" in p.message
    assert "(a node lost?)" in p.message and "0.45 more CPU(s)" in p.fix


def test_cluster_without_the_resource_fails_naming_the_stage():
    plan = placed_plan("stages.rollout.resources.worker_node=1", "stages.train.resources.head_node=1")
    placement.check_cluster(plan, [node(head_node=1), node(worker_node=1)], "the cluster")  # fits
    with pytest.raises(PipelineInvalid) as err:
        placement.check_cluster(plan, [node(head_node=1), {"Alive": False, "Resources": {"worker_node": 1}}], "the cluster")
    text = str(err.value)
    assert "stages.rollout.resources.worker_node: no node of the cluster offers 1 'worker_node'" in text
    assert "custom resources there: head_node" in text and "[unplaceable]" in text
    assert "ray start --address HEAD:PORT --resources '{\"worker_node\": 1}'" in text


def test_cluster_with_too_little_of_the_resource_in_all_fails():
    plan = placed_plan("stages.rollout.resources.worker_node=1", "stages.rollout.replicas=2")
    with pytest.raises(PipelineInvalid, match=r"offers 1 'worker_node' in all, but the plan's actors need 2"):
        placement.check_cluster(plan, [node(worker_node=1), node()], "the cluster")


def test_user_modules_are_what_pythonpath_would_import(tmp_path):
    (tmp_path / "myrewards.py").write_text("def score(c, a): return 0.0\n")
    (tmp_path / "_helpers.py").write_text("")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "not_a_package").mkdir()
    (tmp_path / "notes.txt").write_text("")
    (tmp_path / "rlflow.py").write_text("")  # installed: never shadowed on the workers
    (tmp_path / ".hidden.py").write_text("")
    names = sorted(Path(m).name for m in user_modules([str(tmp_path)]))
    assert names == ["_helpers.py", "myrewards.py", "pkg"]


def test_data_files_are_read_on_the_drivers_node(monkeypatch):
    import ray

    class Ctx:
        def get_node_id(self):
            return "driver-node"

    monkeypatch.setattr(ray, "get_runtime_context", lambda: Ctx())
    assert on_this_node() == {"ray.io/node-id": "driver-node"}
