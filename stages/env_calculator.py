"""`env: calculator`: a tool for arithmetic word problems. The model writes `<calc>37+48</calc>` (the stage's
stop string is `</calc>`); the observation appended is `=85`.

The expression is checked against an `ast` whitelist (int and float literals, + - * / // %, parentheses, unary
minus; at most 64 characters), then evaluated by stages/sandbox.py, the sandbox code rewards run in. Bad input
never raises: the observation says what was wrong (`=error: ...`), so the policy learns from it.
"""

from __future__ import annotations

import ast
import itertools
import os
import random
import re
import time

from rlflow.stages import sandbox
from rlflow.stages.environment import Environment, EnvStep

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
MAX_CHARS = 64
LIMITS = sandbox.Limits(cpu_s=1, memory_mb=128, file_mb=1, processes=2, wall_s=5.0, output_chars=200)
LATENCIES = ("fixed", "exponential")
_ALLOWED = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div,
            ast.FloorDiv, ast.Mod, ast.USub)
# runs in the sandbox; integral floats print as ints (`=2.5`, `=85`, not `=85.0`)
_PROGRAM = """\
r = {expr}
if isinstance(r, float):
    r = int(r) if r.is_integer() and abs(r) < 1e15 else format(r, ".12g")
print(r)
"""
_EPISODES = itertools.count()  # per process: each episode draws its own latencies


class Calculator(Environment):
    """Evaluates the last `<calc>EXPR</calc>` of a turn; reward 0, never done (the reward stage scores the answer).

    latency_s, latency: simulated environment latency, slept after computing: `fixed` sleeps latency_s,
    `exponential` an exponentially distributed time of mean latency_s. seed: the latency stream of an instance
    stepped without reset; reset starts each episode on a stream of its own (seed, process, episode count), so
    the trajectories of a batch draw independent latencies rather than the same sequence.
    """

    def __init__(self, latency_s: float = 0.0, latency: str = "fixed", seed: int = 0):
        if latency not in LATENCIES:
            raise ValueError(f"calculator latency '{latency}' is not one of {', '.join(LATENCIES)}")
        if latency_s < 0:
            raise ValueError(f"calculator latency_s must be >= 0, not {latency_s}")
        self.latency_s, self.latency, self.seed = float(latency_s), latency, seed
        self.rng = random.Random(seed)

    def reset(self, row: dict) -> str:
        self.rng = random.Random(f"{self.seed}/{os.getpid()}/{next(_EPISODES)}")
        return ""

    def step(self, action: str) -> EnvStep:
        calls = CALL.findall(action)
        observation = "=" + (calculate(calls[-1]) if calls else "error: no <calc>...</calc>")
        self._sleep()
        return EnvStep(observation, 0.0, False)

    def _sleep(self) -> None:
        if self.latency_s <= 0:
            return
        time.sleep(self.latency_s if self.latency == "fixed" else self.rng.expovariate(1.0 / self.latency_s))


def calculate(expr: str) -> str:
    """The value of an arithmetic expression as text (`85`, `2.5`), or `error: <why>` (under 40 characters)."""
    tree = parse(expr.strip())
    if isinstance(tree, str):
        return f"error: {tree}"
    # the checked tree written back (no comments or line breaks), so the sandbox runs exactly what was checked
    result = sandbox.run_python(_PROGRAM.format(expr=ast.unparse(tree)), limits=LIMITS)
    if result.ok and result.stdout.strip():
        return result.stdout.strip()
    if result.timed_out or result.killed_by:
        return "error: timed out" if result.timed_out else "error: over its limits"
    last = (result.stderr.strip().splitlines() or ["failed"])[-1]
    return "error: " + last.partition(": ")[2 if ": " in last else 0][:30]


def parse(expr: str) -> ast.Expression | str:
    """The tree of a whitelisted arithmetic expression, or why `expr` is not one (short)."""
    if not expr:
        return "empty"
    if len(expr) > MAX_CHARS:
        return f"over {MAX_CHARS} chars"
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return "syntax"
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED):
            return f"{type(node).__name__.lower()} not allowed"[:30]
        if isinstance(node, ast.Constant) and type(node.value) not in (int, float):
            return "only numbers allowed"
    return tree
