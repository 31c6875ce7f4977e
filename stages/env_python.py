"""`env: python`: a Python execution tool. The model writes `<python>print(2**10)</python>` (the stage's stop
string is `</python>`); the observation appended is `<output>1024</output>`.

Each block runs alone (no state carried between calls) in stages/sandbox.py, the sandbox code rewards run in.
"""

from __future__ import annotations

import re
import time

from rlflow.stages import sandbox
from rlflow.stages.environment import Environment, EnvStep

BLOCK = re.compile(r"<python>(.*?)</python>", re.DOTALL)


class PythonTool(Environment):
    """Runs the last `<python>CODE</python>` of a turn; the observation is its stdout (cut at max_output_chars),
    then the last line of stderr if it failed, or `timed out`. Reward 0, never done.

    cpu_s, wall_s, memory_mb: the sandbox limits of one block. latency_s: simulated latency slept after each run.
    """

    def __init__(self, max_output_chars: int = 200, latency_s: float = 0.0, cpu_s: int = 2, wall_s: float = 5.0,
                 memory_mb: int = 256):
        if max_output_chars < 1 or latency_s < 0:
            raise ValueError(f"python tool needs max_output_chars >= 1 and latency_s >= 0, "
                             f"not {max_output_chars} and {latency_s}")
        self.max_output_chars, self.latency_s = max_output_chars, float(latency_s)
        self.cpu_s, self.wall_s, self.memory_mb = cpu_s, wall_s, memory_mb

    def step(self, action: str) -> EnvStep:
        blocks = BLOCK.findall(action)
        body = self._run(blocks[-1]) if blocks else "error: no <python>...</python> block"
        if self.latency_s > 0:
            time.sleep(self.latency_s)
        return EnvStep("<output>" + body.rstrip("\n") + "</output>", 0.0, False)

    def _run(self, code: str) -> str:
        limits = sandbox.Limits(cpu_s=self.cpu_s, memory_mb=self.memory_mb, wall_s=self.wall_s,
                                output_chars=max(self.max_output_chars + 1, 2000))  # 2000: stderr's last line whole
        result = sandbox.run_python(code, limits=limits)
        out = result.stdout
        if len(out) > self.max_output_chars:
            out = out[: self.max_output_chars] + "..."
        if result.ok:
            return out
        if result.timed_out:
            why = "timed out"
        elif result.killed_by:
            why = f"killed by {result.killed_by}" + (" (CPU limit)" if result.killed_by == "SIGXCPU" else "")
        else:
            lines = result.stderr.strip().splitlines()
            why = lines[-1][-self.max_output_chars:] if lines else f"exit status {result.returncode}"
        return out + ("" if not out or out.endswith("\n") else "\n") + why
