"""Built-in reward functions (`fn:` of a reward stage): (completion, answer[, prompt][, row]) -> float in [0, 1]."""

from __future__ import annotations

import ast
import json
import operator
import re
import secrets
import threading
from collections import OrderedDict
from fractions import Fraction


def exact_match(completion: str, answer: str) -> float:
    """1.0 if the completion, stripped, equals the answer."""
    return 1.0 if completion.strip() == str(answer).strip() else 0.0


def numeric_close(completion: str, answer: str) -> float:
    """1.0 for the exact number, partial credit decaying with relative error, 0.0 for non-numbers."""
    try:
        got, want = float(completion.strip()), float(answer)
    except ValueError:
        return 0.0
    if got == want:
        return 1.0
    return max(0.0, 1.0 - abs(got - want) / max(abs(want), 1.0)) * 0.5


COUNTDOWN_MAX_CHARS = 200  # longer "expressions" score 0 before parsing


def countdown(completion: str, answer: str, row: dict) -> float:
    """1.0 if the completion's expression (first line, before any `=`) uses only + - * / and parentheses on the
    row's `numbers` (each at most once) and equals its `target`, exactly (fractions); else 0.0. Parsed with `ast`,
    never evaluated as code."""
    from collections import Counter

    text = completion.strip().split("\n", 1)[0].split("=", 1)[0].strip()
    if not text or len(text) > COUNTDOWN_MAX_CHARS:
        return 0.0
    try:
        value, used = _arithmetic(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError):
        return 0.0
    if Counter(used) - Counter(row["numbers"]):  # a number not given, or given fewer times
        return 0.0
    return 1.0 if value == row["target"] else 0.0


def _arithmetic(node) -> tuple[Fraction, list[int]]:
    """(exact value, numbers used) of an expression tree of integer literals and + - * /; ValueError otherwise."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value), [node.value]
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        (a, used_a), (b, used_b) = _arithmetic(node.left), _arithmetic(node.right)
        return _OPERATORS[type(node.op)](a, b), used_a + used_b
    raise ValueError(f"not allowed in a countdown expression: {type(node).__name__}")


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def final_number(completion: str, answer: str) -> float:
    """1.0 if the last number in the completion equals the answer (`6`, `so 6 pens`, `5+3-2=6`), else 0.0."""
    numbers = _NUMBER.findall(completion)
    try:
        return 1.0 if numbers and float(numbers[-1]) == float(answer) else 0.0
    except ValueError:
        return 0.0


ANSWER_TAG = "A="
_TAGGED = re.compile(r"-?\d+(?:\.\d+)?")


def tagged_number(completion: str, answer: str) -> float:
    """1.0 if the number right after the last `A=` equals the answer (`<calc>37+48</calc>=85 A=85`), else 0.0.
    A calculator observation (`=85`) holds no `A=`: the model must write the answer itself."""
    at = completion.rfind(ANSWER_TAG)
    found = _TAGGED.match(completion, at + len(ANSWER_TAG)) if at >= 0 else None
    try:
        return 1.0 if found and float(found.group()) == float(answer) else 0.0
    except ValueError:
        return 0.0


def agent_reward(completion: str, answer: str, prompt: str, row: dict) -> float:
    """The reward the episode's agent returned (`{"reward": x, ...}`, row["agent"]): for agents that score their own
    episode, as a verifiers environment's rubric does (stages/agent_verifiers.py)."""
    result = row.get("agent")
    if not isinstance(result, dict) or not isinstance(result.get("reward"), (int, float)):
        raise ValueError(f"agent_reward reads the number the agent returned as {{'reward': x}}, and this episode's "
                         f"agent returned {str(result)[:120]!r}; return a reward from the agent, or score the "
                         "transcript with another fn")
    return float(result["reward"])


CODE_LIMITS_WALL_S = 5.0  # per completion, all its tests together (CPU loops stop sooner: 2 CPU-seconds)


def code_tests(completion: str, answer: str, prompt: str, row: dict) -> float:
    """Fraction of the row's hidden `tests` the completed function passes, run only in stages/sandbox.py. The
    completion is the function's body (appended to the prompt's `def` line) or a whole `def`; one that does not
    parse, crashes on load, or runs past its limits scores 0 for the tests it did not pass. Scores are cached per
    process by (source, tests): the same code is run once (code whose result varies from run to run keeps its first
    score), except after a wall-clock timeout, which depends on the machine's load."""
    tests = row.get("tests")
    if not isinstance(tests, list) or not tests:
        raise ValueError("code_tests needs a row with a list column 'tests' (builtin:code rows have one)")
    body = _strip_fences(completion)
    entry = row.get("entry") or ""
    source = body if entry and f"def {entry}(" in body else prompt + body
    try:
        ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return 0.0
    key = (source, json.dumps(tests))
    with _CODE_SCORES_LOCK:  # a reward call cut by its timeout may still run in a thread beside the next one
        if key in _CODE_SCORES:  # a group's samples often repeat each other once training sharpens the policy
            _CODE_SCORES.move_to_end(key)
            return _CODE_SCORES[key]
    from rlflow.stages import sandbox

    nonce = secrets.token_hex(8)
    result = sandbox.run_python(_CODE_HARNESS, files={"solution.py": source, "tests.json": key[1]},
                                args=(nonce,), limits=sandbox.Limits(cpu_s=2, memory_mb=512, wall_s=CODE_LIMITS_WALL_S))
    passed = {line.split()[1] for line in result.stdout.splitlines() if line.startswith(nonce) and line.endswith(" 1")}
    score = len(passed) / len(tests)
    if not result.timed_out:  # a wall-clock kill depends on the machine's load, not only on the code: run it again
        with _CODE_SCORES_LOCK:
            _CODE_SCORES[key] = score
            if len(_CODE_SCORES) > CODE_SCORE_CACHE:
                _CODE_SCORES.popitem(last=False)
    return score


CODE_SCORE_CACHE = 4096  # scores kept per process, least recently used dropped first
_CODE_SCORES: OrderedDict[tuple[str, str], float] = OrderedDict()
_CODE_SCORES_LOCK = threading.Lock()


# Runs inside the sandbox: load solution.py, then each test expression; one result line per test. (A solution that
# sets out to can read the nonce and forge lines: the sandbox contains damage, it does not make cheating impossible.)
_CODE_HARNESS = """\
import json, sys
nonce = sys.argv[1]
tests = json.load(open("tests.json"))
space = {"__name__": "solution"}
exec(compile(open("solution.py").read(), "solution.py", "exec"), space)
for i, test in enumerate(tests):
    try:
        ok = eval(test, space) is True
    except BaseException:
        ok = False
    print(nonce, i, int(ok), flush=True)
"""


def _strip_fences(text: str) -> str:
    """The code inside a ```python ... ``` block when the completion has one, else the completion."""
    if "```" not in text:
        return text
    inner = text.split("```", 2)[1]
    return inner.split("\n", 1)[1] if "\n" in inner and inner.split("\n", 1)[0].strip().isalpha() else inner
