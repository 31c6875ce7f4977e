"""On a CUDA GPU (skipped without one): the GPU halves of the weight path and of colocation, the same code CI runs on
CPU with another backend (tests/integration/test_weight_sync.py, tests/unit/stages/test_engine_hf.py):
- vLLM's worker loads a version from CUDA IPC handles of buckets packed on its own GPU (trainer and engine sharing it);
- vLLM's worker joins an NCCL link and receives a version from a relay on another GPU (needs two);
- the hf engine's and vLLM's sleep free GPU memory, and waking then loading gives the same log-probs.
Each load is checked by the checksum the worker computed and by log-probs against transformers on the same weights.
"""

from __future__ import annotations

import threading

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]
ATOL = 2e-3  # GPU kernels (reduction order, TF32) against a transformers forward pass in fp32


@pytest.fixture(scope="module")
def model_dir():
    from rlflow.stages.tiny_model import build_tiny_llama

    return str(build_tiny_llama("repeat", progress=lambda line: None))


@pytest.fixture(scope="module")
def vllm_engine(model_dir):
    pytest.importorskip("vllm")
    from rlflow.stages.engine_vllm import VLLMEngine

    engine = VLLMEngine(model_dir, max_running=4, max_new_tokens=8, temperature=1.0, seed=3, max_model_len=64,
                        dtype="float32", gpu_memory_utilization=0.3, enable_sleep_mode=True)
    yield engine
    engine.close()


def perturbed(model_dir, seed: int) -> dict[str, torch.Tensor]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(seed)
    return {k: v + torch.randn(v.shape, generator=gen) * 0.05 for k, v in model.state_dict().items()}


def assert_generates_from(engine, model_dir, state) -> None:
    """The engine's behaviour log-probs are those of a transformers forward pass on `state`."""
    import transformers

    from rlflow.stages.trajectory import Trajectory

    prompt = transformers.AutoTokenizer.from_pretrained(model_dir)("repeat: red blue")["input_ids"]
    traj = Trajectory(group_id="g", index=0, prompt="", answer="", prompt_ids=prompt)
    engine.start(traj)
    done = []
    while not done:
        done = engine.step()
    ids = done[0].completion_ids
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    reference.load_state_dict(state)
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(done[0].behaviour_logprobs), expected, atol=ATOL)


def test_vllm_loads_a_version_from_cuda_ipc_handles_on_its_gpu(vllm_engine, model_dir):
    from rlflow.stages.checksum import checksum
    from rlflow.stages.weight_buckets import pack, state_buckets

    state = perturbed(model_dir, 1)
    buckets = [(layout, pack(layout, [t.cuda() for t in tensors])) for layout, tensors in state_buckets(state, 2**20)]
    assert len(buckets) > 1 and all(flat.is_cuda for _, flat in buckets)
    loaded = vllm_engine.load_ipc(buckets, version=1)
    assert loaded.version == 1 and loaded.missing == []
    assert loaded.checksum == checksum(state)  # computed in the worker, from the mapped CUDA buckets
    assert_generates_from(vllm_engine, model_dir, state)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL refuses two ranks on one GPU: needs two GPUs")
def test_vllm_workers_receive_a_version_over_an_nccl_link(vllm_engine, model_dir):
    """The relay's end on cuda:1 (as a trainer rank would be), vLLM's worker on cuda:0 joins as rank 1 over NCCL."""
    import uuid

    from torch.distributed import TCPStore

    from rlflow.runtime.weight_link import join
    from rlflow.stages.checksum import checksum
    from rlflow.stages.weight_buckets import pack, state_buckets

    host, key = "127.0.0.1", f"link-{uuid.uuid4().hex[:12]}"
    store = TCPStore(host, 0, 2, True, wait_for_workers=False)
    joined = threading.Thread(target=vllm_engine.join_link, args=(key, (host, store.port), "nccl"))
    joined.start()
    relay = join((host, store.port), 0, key, store=store, backend="nccl", device="cuda:1")
    joined.join(timeout=120)
    state = perturbed(model_dir, 2)
    buckets = list(state_buckets(state, 2**20))
    loaded = {}
    pull = threading.Thread(target=lambda: loaded.update(r=vllm_engine.load_over_link(key, [lay for lay, _ in buckets], 2)))
    pull.start()
    relay.send(torch.tensor([2], dtype=torch.int64, device="cuda:1"))
    for layout, tensors in buckets:
        relay.send(pack(layout, [t.to("cuda:1") for t in tensors]))
    pull.join(timeout=120)
    assert loaded["r"].checksum == checksum(state) and loaded["r"].missing == []
    assert_generates_from(vllm_engine, model_dir, state)


def test_vllm_sleep_frees_gpu_memory_and_wakes_to_a_loaded_version(vllm_engine, model_dir):
    freed = vllm_engine.sleep(2)
    print(f"vLLM sleep(2) freed {freed / 2**20:.1f} MiB of GPU memory")  # device_check.sh records it
    assert freed > 0 and vllm_engine.asleep == 2
    with pytest.raises(RuntimeError, match="asleep"):
        vllm_engine.start(None)
    vllm_engine.wake_up()
    state = perturbed(model_dir, 3)
    loaded = vllm_engine.load_weights(state, version=3)
    assert loaded.missing == []
    assert_generates_from(vllm_engine, model_dir, state)


def test_hf_engine_sleep_frees_its_gpu_memory(model_dir):
    from rlflow.stages.engine_hf import HFEngine

    engine = HFEngine(model_dir, max_new_tokens=8)
    assert engine.device.type == "cuda"
    held = engine.held_bytes()["weights"]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    assert engine.sleep(2) >= held
    print(f"hf sleep(2) freed {(before - torch.cuda.memory_allocated()) / 2**20:.1f} MiB of GPU memory")
    assert before - torch.cuda.memory_allocated() >= held  # back to the caching allocator: the trainer can take it
    engine.wake_up()
    engine.load_weights(perturbed(model_dir, 4), version=1)
    engine.sleep(1)  # level 1: the weights go to host memory and come back
    assert engine.held_bytes()["weights"] == 0
    engine.wake_up()
    assert engine.held_bytes()["weights"] == held
