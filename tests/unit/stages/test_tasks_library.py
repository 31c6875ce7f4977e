"""The task library: countdown and its ast checker, word problems, and the code task whose reward runs hidden
tests only through stages/sandbox.py."""

from __future__ import annotations

import re
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlflow import registry
from rlflow.stages import rewards, tasks

ROW = {"numbers": [3, 5, 7, 2], "target": 24}


@pytest.mark.parametrize("completion", ["7*3+5-2", "7*(5-2)+3 ", "(5+7)*2", " (7+5)*2=24\nmore text", "2*(7+5)",
                                        "3*5+7+2", "((3))*5+7+2"])
def test_countdown_accepts_valid_solutions(completion):
    assert rewards.countdown(completion, "", ROW) == 1.0


@pytest.mark.parametrize("completion", [
    "(7-5)*3*4",          # 4 is not given
    "(7-5)*3*2*1",        # 1 is not given
    "3*8",                # 8 is not given
    "(5+7)*2+3-3",        # 3 used twice
    "7*7-25",             # 7 twice, 25 not given
    "(7-5)*3*3",          # 3 twice
    "3*5+7-2",            # the given numbers, the wrong value (20)
    "(3+5)*(7-2)",        # 40
])
def test_countdown_rejects_wrong_or_reused_numbers(completion):
    assert rewards.countdown(completion, "", ROW) == 0.0


@pytest.mark.parametrize("completion", [
    "3/(5-5)", "7/(3-3)*2",              # division by zero (and 5 or 3 reused)
    "9**9**9", "2**5-7-3+2", "3^5",       # ** (and ^) are not allowed: no huge exponents
    "import os", "__import__('os').system('true')", "x", "abs(-24)", "-3*-8",
    "", "   ", "(3+5", "3 5 7 2", "lambda: 24", "[24][0]", "3.0*8.0", "True*24",
    "(" * 300 + "3" + ")" * 300,          # too long / too deep
])
def test_countdown_rejects_non_expressions_and_forbidden_operations(completion):
    assert rewards.countdown(completion, "", {"numbers": [3, 5, 7, 2, 9, 9, 9, 8, 5], "target": 24}) == 0.0


def test_countdown_given_target_alone_is_accepted_only_if_it_is_one_of_the_numbers():
    assert rewards.countdown("24", "", {"numbers": [24, 1, 2], "target": 24}) == 1.0
    assert rewards.countdown("24", "", ROW) == 0.0


def test_countdown_division_is_exact():
    assert rewards.countdown("7/2*2", "", {"numbers": [7, 2, 2], "target": 7}) == 1.0  # not 6 (no integer division)
    assert rewards.countdown("(1+2)/3*9", "", {"numbers": [1, 2, 3, 9], "target": 9}) == 1.0


def test_every_generated_countdown_answer_is_accepted_by_the_checker():
    rows = tasks.countdown(seed=7, count=500)
    assert len(rows) == 500 and len({r["prompt"] for r in rows}) > 400
    for row in rows:
        assert rewards.countdown(row["answer"], row["answer"], row) == 1.0, row
        assert 1 <= row["target"] <= 100 and 3 <= len(row["numbers"]) <= 4
        assert row["prompt"] == f"make {row['target']} from {' '.join(map(str, row['numbers']))}="


@given(st.lists(st.integers(1, 10), min_size=2, max_size=4), st.data())
@settings(max_examples=200, deadline=None)
def test_countdown_checker_agrees_with_exact_arithmetic(numbers, data):
    """Any expression built from the numbers scores 1 against its own exact value (when an integer), and 0 when
    the target is off by one."""
    ops = data.draw(st.lists(st.sampled_from("+-*/"), min_size=len(numbers) - 1, max_size=len(numbers) - 1))
    text, value = str(numbers[0]), Fraction(numbers[0])
    for op, n in zip(ops, numbers[1:]):
        text = f"({text}){op}{n}"
        value = {"+": value + n, "-": value - n, "*": value * n, "/": value / n}[op]
    if value.denominator != 1:
        assert rewards.countdown(text, "", {"numbers": numbers, "target": int(value)}) == 0.0
        return
    assert rewards.countdown(text, "", {"numbers": numbers, "target": int(value)}) == 1.0
    assert rewards.countdown(text, "", {"numbers": numbers, "target": int(value) + 1}) == 0.0


@given(st.text(max_size=60))
@settings(max_examples=200, deadline=None)
def test_countdown_never_raises_on_arbitrary_text(text):
    assert rewards.countdown(text, "", ROW) in (0.0, 1.0)


def test_word_problems_answers_are_consistent():
    rows = tasks.word_problems(seed=3, count=300)
    assert len({r["prompt"] for r in rows}) > 250
    for row in rows:
        assert row["prompt"].endswith(" A=") and int(row["answer"]) >= 0
        assert rewards.final_number(row["answer"], row["answer"]) == 1.0
    # recompute a few by hand from the text
    for row in rows:
        nums = list(map(int, re.findall(r"\d+", row["prompt"])))
        p = row["prompt"]
        if "gets" in p and "gives away" in p:
            assert int(row["answer"]) == nums[0] + nums[1] - nums[2]
        elif "bags of" in p:
            assert int(row["answer"]) == nums[0] * nums[1] - nums[2]
        elif "doubled the rest" in p:
            assert int(row["answer"]) == 2 * (nums[0] - nums[1])
        elif "a day for" in p:
            assert int(row["answer"]) == nums[0] * nums[1] + nums[2]
        elif "share" in p:
            assert int(row["answer"]) == nums[1] // nums[0] + nums[2] and nums[1] % nums[0] == 0
        else:
            assert int(row["answer"]) == nums[0] * (nums[1] + nums[2])


@pytest.mark.parametrize("completion,score", [("6", 1.0), (" 6", 1.0), ("so 6 pens", 1.0), ("5+3-2=6", 1.0),
                                              ("6.0", 1.0), ("7", 0.0), ("6 then 7", 0.0), ("", 0.0), ("six", 0.0)])
def test_final_number_reads_the_last_number(completion, score):
    assert rewards.final_number(completion, "6") == score


def test_tasks_are_deterministic_and_seeded():
    for task in (tasks.countdown, tasks.word_problems, tasks.code):
        assert task(1, 20) == task(1, 20) and task(1, 20) != task(2, 20)


def test_code_rows_have_hidden_tests_and_cover_every_template():
    rows = tasks.code(seed=0, count=400)
    assert {r["entry"].rstrip("0123456789_") for r in rows} >= {"add", "reverse", "fizzbuzz", "vowels", "sum_list"}
    for row in rows:
        assert row["prompt"].startswith("# ") and f"\ndef {row['entry']}(" in row["prompt"] and row["prompt"].endswith("):\n")
        assert len(row["tests"]) == 4 and all(t.startswith(row["entry"] + "(") for t in row["tests"])


def one_row_per_template() -> list[dict]:
    seen: dict[str, dict] = {}
    for row in tasks.code(seed=5, count=300):
        seen.setdefault(row["entry"].rstrip("0123456789").rstrip("_"), row)
    return list(seen.values())


def test_every_code_reference_solution_passes_its_hidden_tests_in_the_sandbox():
    rows = one_row_per_template()
    assert len(rows) == len(tasks._CODE_TASKS)
    for row in rows:
        assert rewards.code_tests(row["answer"], row["answer"], row["prompt"], row) == 1.0, row


def test_code_prompts_are_varied_enough_for_a_held_out_split():
    from rlflow.runtime.evaluation import held_out

    prompts = {row["prompt"] for row in tasks.code(seed=0, count=5000)}
    assert len(prompts) > 300 and sum(held_out(p, 0.1) for p in prompts) > 20


def test_a_repeated_code_completion_is_scored_once_unless_it_timed_out(monkeypatch):
    from rlflow.stages import sandbox

    runs = []
    real = sandbox.run_python
    monkeypatch.setattr(sandbox, "run_python", lambda *a, **k: runs.append(1) or real(*a, **k))
    monkeypatch.setattr(rewards, "_CODE_SCORES", type(rewards._CODE_SCORES)())
    row = {"prompt": "# add 3 to x\ndef add_3(x):\n", "tests": ["add_3(1)==4", "add_3(2)==6"], "entry": "add_3"}
    assert [rewards.code_tests("    return x+3", "", row["prompt"], row) for _ in range(3)] == [0.5, 0.5, 0.5]
    assert len(runs) == 1
    assert rewards.code_tests("    return x+3 ", "", row["prompt"], row) == 0.5 and len(runs) == 2  # other source
    monkeypatch.setattr(rewards, "CODE_LIMITS_WALL_S", 0.5)
    sleepy = "    import time\n    time.sleep(30)"
    assert [rewards.code_tests(sleepy, "", row["prompt"], row) for _ in range(2)] == [0.0, 0.0]
    assert len(runs) == 4  # timed out: not cached


def test_wrong_and_partial_solutions_score_below_one():
    row = next(r for r in tasks.code(seed=1, count=200) if r["entry"] == "fizzbuzz")
    call = lambda completion: rewards.code_tests(completion, row["answer"], row["prompt"], row)
    assert call("    return str(n)") < 1.0                          # right only for some n
    assert call("    return 'Fizz'") < 1.0
    whole = row["prompt"] + row["answer"]
    assert call(whole) == 1.0                                        # a whole `def` is accepted as is
    assert call(f"```python\n{whole}\n```") == 1.0                   # and inside a fenced block


@pytest.mark.parametrize("completion", [
    "    return (",                                # does not parse
    "  return x\n return y",                       # bad indentation
    "    raise SystemExit(0)",                     # crashes in every test
    "    pass\nimport os\nos._exit(0)",            # exits before any test runs
    "    pass\nraise RuntimeError('boom')",        # crashes on load
    "    while True: pass",                        # infinite loop: CPU limit
    "    pass\nwhile True: pass",                  # infinite loop on load
    "    return __import__('os').fork() or x",     # forks
])
def test_broken_or_hostile_completions_score_zero_and_never_raise(completion):
    row = {"prompt": "# add 3 to x\ndef add_3(x):\n", "answer": "    return x+3", "entry": "add_3",
           "tests": ["add_3(1)==4", "add_3(0)==3"]}
    assert rewards.code_tests(completion, row["answer"], row["prompt"], row) == 0.0


def test_code_tests_without_tests_column_is_a_reward_error():
    with pytest.raises(ValueError, match="tests"):
        rewards.code_tests("    return 1", "", "def f():\n", {"prompt": "", "answer": ""})


def test_new_tasks_and_rewards_are_registered():
    for name in ("countdown", "word_problems", "code"):
        assert registry.resolve("task", f"builtin:{name}") is getattr(tasks, name)
    for name in ("countdown", "final_number", "code_tests"):
        assert registry.resolve("reward", name) is getattr(rewards, name)


def test_reward_caller_passes_the_row_and_prompt():
    from rlflow.runtime.reward_call import reward_caller

    row = tasks.countdown(0, 1)[0]
    assert reward_caller(rewards.countdown)(row["answer"], row["answer"], row["prompt"], row) == 1.0
