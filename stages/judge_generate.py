"""How a generative judge (stages/reward_judge.py) writes its verdicts: greedy text for a batch of prompts, on one of
two engines, each bounded by the judge's timeout.

- `hf`: transformers' `generate` in the reward actor, the batch left-padded, `max_time` as the bound;
- `vllm`: rlflow's vLLM rollout engine (stages/engine_vllm.py: continuous batching, paged KV cache) at temperature 0,
  `batch_size` requests running at once; the requests still running at the deadline are aborted.

Both truncate a prompt on the left (its end, the completion to judge, is kept) to what the model's context leaves
after `max_new_tokens`. A batch past its timeout raises JudgeTimeout: the judge fails those trajectories by name
rather than trusting a cut-off verdict.
"""

from __future__ import annotations

import itertools
import time

#: the context a vLLM judge is given when its model's config says more (its KV cache grows with it)
VLLM_MAX_MODEL_LEN = 4096


class JudgeTimeout(Exception):
    """A batch of verdicts did not finish within the judge's timeout."""


def _context(model_dir: str) -> int:
    """The positions the judge's model has, as compile reads them from its config.json (2048 when it does not say)."""
    import json
    from pathlib import Path

    from rlflow.stages.model_positions import model_positions

    found = model_positions(json.loads((Path(model_dir) / "config.json").read_text()))
    return found[0] if found else 2048


class HFGreedy:
    """Greedy verdicts with transformers' generate, on `device` in `dtype` (a torch dtype)."""

    def __init__(self, model_dir: str, *, max_new_tokens: int, device: str, dtype):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from rlflow.stages.hf_quiet import no_progress_bars

        self.max_new_tokens, self.device = max_new_tokens, device
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = self.tokenizer.truncation_side = "left"  # generation continues on the right
        with no_progress_bars():
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        self.max_prompt = max(min(_context(model_dir) - max_new_tokens, self.tokenizer.model_max_length), 1)

    def __call__(self, prompts: list[str], timeout_s: float) -> list[str]:
        import torch

        started = time.monotonic()
        enc = self.tokenizer(prompts, padding=True, truncation=True, max_length=self.max_prompt,
                             return_tensors="pt").to(self.device)
        with torch.inference_mode():
            ids = self.model.generate(**enc, max_new_tokens=self.max_new_tokens, do_sample=False, max_time=timeout_s,
                                      pad_token_id=self.tokenizer.pad_token_id)
        if time.monotonic() - started >= timeout_s:  # max_time cut it short: no verdict to trust
            raise JudgeTimeout
        return self.tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)


class VLLMGreedy:
    """Greedy verdicts on a VLLMEngine of its own (`dtype`: a torch dtype; the engine takes its name)."""

    def __init__(self, model_dir: str, *, max_new_tokens: int, batch_size: int, dtype,
                 gpu_memory_utilization: float = 0.5):
        from rlflow.stages.engine_vllm import VLLMEngine

        max_model_len = min(_context(model_dir), VLLM_MAX_MODEL_LEN)
        self.engine = VLLMEngine(model_dir, max_running=batch_size, max_new_tokens=max_new_tokens, temperature=0.0,
                                 max_model_len=max_model_len, dtype=str(dtype).removeprefix("torch."),
                                 gpu_memory_utilization=gpu_memory_utilization)
        self.tokenizer = self.engine.tokenizer
        self.max_prompt = max_model_len - max_new_tokens
        self._batches = itertools.count()

    def __call__(self, prompts: list[str], timeout_s: float) -> list[str]:
        from rlflow.stages.trajectory import Trajectory

        deadline = time.monotonic() + timeout_s
        group = f"judge-{next(self._batches)}"
        trajs = []
        for i, prompt in enumerate(prompts):
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"][-self.max_prompt:]
            trajs.append(Trajectory(group_id=group, index=i, prompt=prompt, answer="", prompt_ids=list(ids)))
            self.engine.start(trajs[-1])
        done: dict = {}
        while len(done) < len(trajs):
            if time.monotonic() >= deadline:
                for t in trajs:
                    if t.traj_id not in done:
                        self.engine.abort(t.traj_id)
                raise JudgeTimeout
            done |= {t.traj_id: t.completion_ids for t in self.engine.step()}
        return [self.tokenizer.decode(done[t.traj_id], skip_special_tokens=True) for t in trajs]

    def close(self) -> None:
        self.engine.close()
