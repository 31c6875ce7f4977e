"""Reward functions the integration tests reference by import string."""


def flaky_exact(completion: str, answer: str) -> float:
    """exact_match, but raises for answers containing the letter 'a' (a buggy user reward)."""
    if "a" in answer:
        raise RuntimeError(f"cannot score answer {answer!r}")
    return 1.0 if completion.strip() == answer.strip() else 0.0


def always_text(completion: str, answer: str):
    """Returns a string, never a number (a buggy user reward: every trajectory fails)."""
    return "yes" if completion.strip() == answer.strip() else "no"


def sleepy(completion: str, answer: str, row: dict) -> float:
    """Sleeps row["sleep"] seconds (a reward stuck on a slow service); records where it ran in row["probe"]."""
    import threading
    import time

    if row.get("probe"):
        with open(row["probe"], "a") as f:
            f.write(f"{threading.current_thread() is threading.main_thread()}\n")
    time.sleep(row.get("sleep", 0.0))
    return 1.0


_calls = 0


def dies_once(completion: str, answer: str, row: dict) -> float:
    """exact_match, but the worker process kills itself (SIGKILL) on its 12th call, once per marker file
    row["die_once"]: a reward worker lost mid-batch, which Ray restarts and retries."""
    import os
    import signal

    global _calls
    _calls += 1
    if _calls >= 12 and row.get("die_once") and not os.path.exists(row["die_once"]):
        with open(row["die_once"], "w") as f:
            f.write(row["prompt"])  # the prompt it was scoring when it died
        os.kill(os.getpid(), signal.SIGKILL)
    return 1.0 if completion.strip() == answer.strip() else 0.0


def exits_on(completion: str, answer: str, row: dict) -> float:
    """exact_match, but the process exits at once (os._exit(1)) on a row with row["poison"]: a poison row that kills
    its reward worker every time it is scored."""
    import os

    if row.get("poison"):
        os._exit(1)
    return 1.0 if completion.strip() == answer.strip() else 0.0


def hangs_on(completion: str, answer: str, row: dict) -> float:
    """exact_match, but never returns on a row with row["hang"] (a call stuck on a dead service); records its
    process id in row["pidfile"] when given."""
    import os
    import time

    if row.get("pidfile"):
        with open(row["pidfile"], "a") as f:
            f.write(f"{os.getpid()}\n")
    while row.get("hang"):
        time.sleep(1)
    return 1.0 if completion.strip() == answer.strip() else 0.0


def spins(completion: str, answer: str) -> float:
    """Never returns, busy in a Python loop (a reward stuck in its own code)."""
    while True:
        pass


def as_number(completion: str, answer: str):
    """float(completion), printing it first (a reward that prints must not break its channel); raises on text."""
    print(f"scoring {completion!r}")
    return float(completion)


def returns(completion: str, answer: str):
    """Returns the Python literal written in the completion (non-numbers, nan, inf, ...)."""
    import ast

    return float(completion[6:]) if completion.startswith("float:") else ast.literal_eval(completion)


def always_zero(completion: str, answer: str) -> float:
    """A policy that never earns a reward: every group is uniform, so drop_uniform_groups filters it."""
    return 0.0


def dies_or_hangs_on(completion: str, answer: str) -> float:
    """exact_match, but the process exits on the completion "die" and never returns on "hang": one bad member in
    the middle of a group."""
    import os
    import time

    if completion == "die":
        os._exit(1)
    while completion == "hang":
        time.sleep(1)
    return 1.0 if completion.strip() == answer.strip() else 0.0


def records(completion: str, answer: str, prompt: str, row: dict) -> float:
    """0.0, after appending {prompt, completion, answer} as a JSON line to row["probe"]: with weight 0 beside a reward
    model or judge, a record of every text the stage scored (one line per call; a short O_APPEND write is atomic)."""
    import json

    with open(row["probe"], "a") as f:
        f.write(json.dumps({"prompt": prompt, "completion": completion, "answer": answer}) + "\n")
    return 0.0


_draws = None


def nan_on_30_percent(completion: str, answer: str) -> float:
    """exact_match, but NaN on about 30% of answers, each on its own (issue #45's flaky reward). Deterministic: the
    k-th call in this process fails when the k-th draw of random.Random(2958) is below 0.3, so the stream of failures
    is the same in every run (which answers fail is set by their order, not by what was generated). Seed 2958: its
    answers 172-216 have more than half of their last 64 failed, so the old rule stopped a run in its second step."""
    import random

    global _draws
    if _draws is None:
        _draws = random.Random(2958)
    if _draws.random() < 0.3:
        return float("nan")
    return 1.0 if completion.strip() == answer.strip() else 0.0


def agent_says(completion: str, answer: str, row: dict) -> float:
    """An agent stage's reward (issue 48): what the agent returned arrives as row["agent"]."""
    return 1.0 if str(row["agent"]["answer"]) == answer else 0.0
