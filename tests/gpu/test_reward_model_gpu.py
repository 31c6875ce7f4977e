"""On a CUDA GPU (skipped without one): a reward model and a judge score on the device what they score on the CPU
(stages/reward_model.py, stages/reward_judge.py; a reward stage's num_gpus puts its actors there)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

ITEMS = [{"prompt": p, "completion": c, "answer": a} for p, c, a in
         [("97+5=", "102", "102"), ("ga*2=", "ga ga", "ga ga"), ("1+1=", "two", "2"), ("x", "", "")]]


def test_tiny_reward_scores_the_same_on_the_gpu(tmp_path):
    from rlflow.stages.reward_model import RewardModel, build_tiny_reward

    path = str(build_tiny_reward(cache_dir=tmp_path, progress=lambda line: None))
    import torch

    on_gpu = RewardModel(path, batch_size=3, device="cuda", dtype="float32")
    assert next(on_gpu.model.parameters()).is_cuda
    cpu = [r for r, _, _ in RewardModel(path, batch_size=3, device="cpu").score(ITEMS)]
    assert [r for r, _, _ in on_gpu.score(ITEMS)] == pytest.approx(cpu, abs=1e-3)
    auto = RewardModel(path, batch_size=3, device="cuda")  # dtype auto: bfloat16 on a GPU that has it
    assert next(auto.model.parameters()).dtype == (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)
    assert [r for r, _, _ in auto.score(ITEMS)] == pytest.approx(cpu, abs=0.05)


def test_a_judge_gives_the_same_verdicts_on_the_gpu():
    from rlflow.stages.reward_judge import Judge
    from rlflow.stages.tiny_model import build_tiny_llama

    path = str(build_tiny_llama("repeat", progress=lambda line: None))
    verdicts = []
    for device in ("cpu", "cuda"):
        judge = Judge(path, "{completion}*2=", "regex:ga", max_new_tokens=6, batch_size=4, device=device,
                      dtype="float32")  # greedy verdicts match in the same precision
        verdicts.append(judge.score(ITEMS))
    assert verdicts[0] == verdicts[1]


@pytest.mark.vllm
def test_a_vllm_judge_gives_the_hf_verdicts_on_the_gpu():
    pytest.importorskip("vllm")
    from rlflow.stages.reward_judge import Judge
    from rlflow.stages.tiny_model import build_tiny_llama

    path = str(build_tiny_llama("repeat", progress=lambda line: None))
    hf = Judge(path, "{completion}*2=", "regex:ga", max_new_tokens=6, batch_size=4, device="cuda", dtype="float32")
    vllm = Judge(path, "{completion}*2=", "regex:ga", engine="vllm", max_new_tokens=6, batch_size=4, dtype="float32",
                 gpu_memory_utilization=0.3)
    try:
        assert vllm.score(ITEMS) == hf.score(ITEMS)
    finally:
        vllm.close()
