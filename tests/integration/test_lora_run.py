"""A train.lora run on the real stack: only the adapters travel from trainer to engines, the engines apply them, and
`rlflow export` writes the adapter (and, with --merged, the merged model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from runs import plan_for, run_plan

pytestmark = pytest.mark.integration

LORA = ["stages.train.lora.rank=4", "stages.train.lora.target_modules=[q_proj,v_proj]", "stages.train.lr=0.02",
        "stages.train.steps=2"]


def test_a_lora_run_publishes_only_the_adapters_and_exports_them(ray_cluster, workdir, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlflow.cli import main
    from rlflow.runtime.export import ADAPTER_WEIGHTS
    from rlflow.runtime.hooks import RunHooks
    from rlflow.runtime.parameter_server import fetch_state
    from rlflow.stages import lora
    from rlflow.stages.engine_hf import HFEngine
    from rlflow.stages.trajectory import Trajectory

    plan = plan_for("quickstart", *LORA)
    settings = next(a for a in plan["actors"] if a["role"] == "trainer")["trainer_kwargs"]["lora"]
    assert all(a["engine_kwargs"]["lora"] == settings for a in plan["actors"] if a["role"] == "rollout")
    published: dict = {}
    run = run_plan(plan, hooks=RunHooks(before_export=lambda run: published.update(fetch_state(run.weights.ref))))
    assert [h["step"] for h in run.history] == [1, 2]  # every pull was checked: each engine loaded the published checksum

    # adapter-only bytes on the wire: every published tensor is an adapter, and a version is their bytes alone
    model_dir = run.model_dir
    model = lora.inject(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), settings)
    adapter, base = lora.adapter_bytes(model)
    version = run.weights.ref
    names = [n for layout in version.layouts for n in layout.names]
    assert sorted(names) == sorted(lora.adapter_state(model)) and sorted(published) == sorted(names)
    assert sum(s.nbytes for layout in version.layouts for s in layout.slots) == adapter
    assert version.nbytes < (adapter + base) / 20
    assert [h["published_bytes"] for h in run.history] == [adapter, adapter]  # each step's metric says so too
    measured = f"bytes per version: adapter {version.nbytes}, the whole model {base}"

    # the engine applies the trained adapter in place: its greedy completions change
    engine = HFEngine(model_dir, lora=settings, max_new_tokens=12, temperature=0.0, max_model_len=128)
    prompts = [engine.tokenizer.encode(p) for p in ("repeat: abc ->", "repeat: hello ->", "repeat: 7 8 9 ->")]

    def greedy(tag: str) -> list[list[int]]:
        out = []
        for i, ids in enumerate(prompts):
            engine.start(Trajectory(group_id=tag, index=i, prompt="", answer="", prompt_ids=list(ids)))
        while len(out) < len(prompts):
            out += engine.step()
        return [t.completion_ids for t in sorted(out, key=lambda t: t.index)]

    before = greedy("before")
    engine.load_weights(published, run.weights.version)
    assert greedy("after") != before

    # the run's export is peft's adapter directory; `rlflow export --merged` rebuilds it from the checkpoint
    out = run.out_dir / "export"
    assert (out / ADAPTER_WEIGHTS).is_file() and json.loads((out / "adapter_config.json").read_text())["r"] == 4
    assert main(["export", str(run.out_dir), "-o", "from_checkpoint", "--merged"]) == 0
    assert "LoRA adapter (rank 4)" in capsys.readouterr().out
    with capsys.disabled():
        print(measured)  # docs/guides/lora.md's table
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                            str(Path("from_checkpoint"))).eval()(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained("from_checkpoint/merged", dtype=torch.float32)(input_ids=ids).logits
        exported = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                             str(out)).eval()(input_ids=ids).logits
    assert torch.allclose(adapted, merged, atol=1e-4) and torch.allclose(adapted, exported, atol=1e-4)


@pytest.mark.slow  # the trainer's checkpoint of adapters and their optimizer state: tests/unit/stages/test_lora.py
def test_a_lora_run_resumes_from_its_checkpoint(ray_cluster, workdir):
    base = [*LORA, "stages.train.checkpoint_every=1"]
    first = run_plan(plan_for("quickstart", *base, "stages.train.steps=1"))
    assert [h["step"] for h in first.history] == [1]
    said: list[str] = []
    second = run_plan(plan_for("quickstart", *base, "stages.train.steps=2"), resume=True,
                      log=lambda *a, **k: said.append(" ".join(map(str, a))))
    assert any(m.startswith("resuming at step 1") for m in said), said
    assert [h["step"] for h in second.history] == [1, 2]  # the engines loaded each published adapter (checked)
    assert all(".lora_" in n for layout in second.weights.ref.layouts for n in layout.names)
