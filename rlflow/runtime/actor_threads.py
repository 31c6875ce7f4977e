"""CPU threads of an actor that computes: a rollout instance (its engine) and a trainer rank.

The plan says how many (rlflow/devices.py thread_plan): a number, or "cores" — the node's cores divided among the
actors of one phase — where generation and training take turns (a synchronous run), so each phase has the
machine while the other waits. PLATFORM-NOTES: two threads per process on shared cores make step times jump 20x,
so actors that run side by side keep to the CPUs they reserve.
"""

from __future__ import annotations

import os

import ray


def threads_for(threads: int | str = 1, share: int = 1) -> int:
    """The thread count `threads` means on this node: a number as is; "cores": this process's usable cores over
    `share` (the actors of the phase), at least 1."""
    if isinstance(threads, int):
        return threads
    if threads != "cores":
        raise ValueError(f"threads {threads!r}: a positive number or 'cores'")
    return max(1, len(os.sched_getaffinity(0)) // max(1, share))


def use_threads(threads: int | str = 1, share: int = 1) -> int:
    """Set this actor's CPU threads (torch's intra-op pool, OpenMP for what it starts: vLLM's CPU worker inherits
    the environment) and only the GPUs Ray reserved for it (none: CUDA hidden, so engines and DeepSpeed that pick
    the GPU when there is one honour num_gpus: 0). Returns the count."""
    n = threads_for(threads, share)
    if not ray.get_gpu_ids():
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's choice anyway, without its warning
    os.environ["OMP_NUM_THREADS"] = str(n)
    import torch

    torch.set_num_threads(n)
    return n


def one_thread() -> int:
    """One CPU thread: an actor beside others on shared cores (the evaluator)."""
    return use_threads(1)
