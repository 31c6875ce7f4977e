"""Built-in verifiable tasks (`data.source: builtin:<name>`): prompts whose answers vary in length.

Each task is a function (seed, count) -> list of {"prompt", "answer"} rows; pure Python, no download. Rows of a
task for a tool (`calc`) also have a `demo`: the transcript of a tool-using episode, for warm starts.
"""

from __future__ import annotations

import random
import re


def arith(seed: int = 0, count: int = 1024) -> list[dict]:
    """Sums of two numbers of 1-2 digits: `12+7=` -> `19`. Small enough for a 0.6M-param model to half-learn
    in a minute of warm start, so RL has signal to improve on."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = (rng.randint(0, 10 ** rng.randint(1, 2) - 1) for _ in range(2))
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return rows


def repeat(seed: int = 0, count: int = 1024) -> list[dict]:
    """Repeat a short word n times: `ab*5=` -> `ab ab ab ab ab`. Lengths are long-tailed in n."""
    rng = random.Random(seed)
    letters = "abcdefghij"
    rows = []
    for _ in range(count):
        word = "".join(rng.choice(letters) for _ in range(rng.randint(1, 3)))
        n = min(1 + int(rng.lognormvariate(0.8, 0.7)), 16)
        rows.append({"prompt": f"{word}*{n}=", "answer": " ".join([word] * n)})
    return rows


def countdown(seed: int = 0, count: int = 1024) -> list[dict]:
    """Reach a target from 3-4 numbers with + - * / (each number at most once): `make 24 from 3 5 7 2=` -> one
    solution, e.g. `(7-5)*3*2`; columns `numbers` and `target` are what the `countdown` reward checks."""
    from fractions import Fraction

    rng = random.Random(seed)
    rows = []
    while len(rows) < count:
        numbers = [rng.randint(1, 10) for _ in range(rng.randint(3, 4))]
        terms = [(Fraction(n), str(n), True) for n in numbers]  # (value, text, is a bare number)
        rng.shuffle(terms)
        while len(terms) > 1:
            (a, sa, la), (b, sb, lb) = terms.pop(rng.randrange(len(terms))), terms.pop(rng.randrange(len(terms)))
            op = rng.choice("+-*/")
            if op == "/" and b == 0:
                op = "*"
            value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else a}[op]
            terms.append((value, f"{sa if la else f'({sa})'}{op}{sb if lb else f'({sb})'}", False))
        target, expression, _ = terms[0]
        if target.denominator == 1 and 1 <= target <= 100:
            rows.append({"prompt": f"make {target} from {' '.join(map(str, numbers))}=", "answer": expression,
                         "numbers": numbers, "target": int(target)})
    return rows


_NAMES = ("Ann", "Bo", "Cy", "Dee", "Eli", "Fay")
_THINGS = ("apples", "pens", "cards", "coins", "shells", "eggs")
# (question template, answer from the numbers a, b, c); 2-3 steps each, small numbers, integer answers >= 0
_WORD_PROBLEMS = (
    ("{n} has {a} {t}, gets {b} more, then gives away {c}. How many {t} now?", lambda a, b, c: a + b - c),
    ("{n} buys {a} bags of {b} {t} and loses {c}. How many {t} are left?", lambda a, b, c: a * b - c),
    ("There are {a} boxes of {b} {t}. {c} more {t} go in each box. How many {t} in all?", lambda a, b, c: a * (b + c)),
    ("{n} had {a} {t}, used {c}, then doubled the rest. How many {t} now?", lambda a, b, c: 2 * (a - c)),
    ("{n} gets {a} {t} a day for {b} days, then {c} more. How many {t} in all?", lambda a, b, c: a * b + c),
    ("{b} friends share {ab} {t} equally, then each finds {c} more. How many {t} does each have?",
     lambda a, b, c: a + c),
)


def word_problems(seed: int = 0, count: int = 1024) -> list[dict]:
    """Multi-step arithmetic word problems from templates: `Ann has 5 pens, gets 3 more, ... A=` -> `6`."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        template, solve = rng.choice(_WORD_PROBLEMS)
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        c = rng.randint(1, min(a, 9))  # never more taken away than there is
        question = template.format(n=rng.choice(_NAMES), t=rng.choice(_THINGS), a=a, b=b, c=c, ab=a * b)
        rows.append({"prompt": f"{question} A=", "answer": str(solve(a, b, c))})
    return rows


# name, comment, argument kind, reference body, reference function, input generator, range of k; {k} is drawn per
# row, {a} is the argument's name (drawn from ARGUMENT_NAMES[kind]). The wide k ranges and the argument names keep
# the prompts varied (about 470 distinct): a held-out split is by prompt text, and with 39 distinct prompts a 10%
# split held out 3 of them, so held-out accuracy moved in steps of a third.
_CODE_TASKS = (
    ("add_{k}", "add {k} to {a}", "num", "return {a}+{k}", lambda k: lambda x: x + k, lambda r: r.randint(-20, 20),
     (2, 49)),
    ("times_{k}", "multiply {a} by {k}", "num", "return {a}*{k}", lambda k: lambda x: x * k, lambda r: r.randint(-9, 9),
     (2, 12)),
    ("is_even", "True if {a} is even", "num", "return {a}%2==0", lambda k: lambda n: n % 2 == 0,
     lambda r: r.randint(-9, 30), (0, 0)),
    ("clamp_{k}", "{a} limited to 0..{k}", "num", "return min(max({a},0),{k})", lambda k: lambda x: min(max(x, 0), k),
     lambda r: r.randint(-5, 55), (2, 49)),
    ("sum_list", "sum of the numbers in {a}", "list", "return sum({a})", lambda k: sum, lambda r: _ints(r), (0, 0)),
    ("max_list", "largest number in {a}", "list", "return max({a})", lambda k: max, lambda r: _ints(r, 1), (0, 0)),
    ("first_{k}", "the first {k} items of {a}", "list", "return {a}[:{k}]", lambda k: lambda xs: xs[:k],
     lambda r: _ints(r), (1, 5)),
    ("squares", "squares of the numbers in {a}", "list", "return [x*x for x in {a}]",
     lambda k: lambda xs: [x * x for x in xs], lambda r: _ints(r), (0, 0)),
    ("reverse", "{a} reversed", "str", "return {a}[::-1]", lambda k: lambda s: s[::-1], lambda r: _word(r), (0, 0)),
    ("vowels", "number of vowels in {a}", "str", "return sum(c in 'aeiou' for c in {a})",
     lambda k: lambda s: sum(c in "aeiou" for c in s), lambda r: _word(r), (0, 0)),
    ("fizzbuzz", "Fizz if {a}%3==0, Buzz if {a}%5==0, FizzBuzz if both, else str({a})", "num",
     ("if {a}%15==0:\n        return 'FizzBuzz'\n    if {a}%3==0:\n        return 'Fizz'\n    if {a}%5==0:\n"
      "        return 'Buzz'\n    return str({a})"),
     lambda k: lambda n: "FizzBuzz" if n % 15 == 0 else "Fizz" if n % 3 == 0 else "Buzz" if n % 5 == 0 else str(n),
     lambda r: r.randint(1, 45), (0, 0)),
)
ARGUMENT_NAMES = {"num": ("x", "n", "v", "num"), "list": ("xs", "nums", "items", "values"), "str": ("s", "text", "word")}


def _ints(rng: random.Random, least: int = 0) -> list[int]:
    return [rng.randint(-9, 9) for _ in range(rng.randint(least, 5))]


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdeiou") for _ in range(rng.randint(0, 6)))


def code(seed: int = 0, count: int = 1024) -> list[dict]:
    """Write a small Python function: the prompt is a comment and a `def` line, the answer its body; column `tests`
    holds hidden asserts (`add_3(1)==4`), run by the `code_tests` reward only inside stages/sandbox.py."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        name, comment, kind, body, reference, draw, (low, high) = rng.choice(_CODE_TASKS)
        k, arg = rng.randint(low, high), rng.choice(ARGUMENT_NAMES[kind])
        name, comment, body, fn = name.format(k=k), comment.format(k=k, a=arg), body.format(k=k, a=arg), reference(k)
        inputs = []
        while len(inputs) < 4:
            value = draw(rng)
            inputs += [] if value in inputs else [value]
        rows.append({"prompt": f"# {comment}\ndef {name}({arg}):\n", "answer": f"    {body}",
                     "tests": [f"{name}({v!r})=={fn(v)!r}" for v in inputs], "entry": name})
    return rows


CALC_CUE = " Calc:"  # ends every builtin:calc prompt; the completion starts with the tool call
# (operator, question template): two numbers 10..99 and one operation, harder than a tiny model can do in its head
_CALC_PROBLEMS = (
    ("+", "{n} has {a} {t} and buys {b} more. How many {t} now?"),
    ("+", "{n} has {a} {t} and {m} has {b}. How many {t} in all?"),
    ("-", "{n} has {a} {t} and gives away {b}. How many {t} are left?"),
    ("-", "{n} had {a} {t} and lost {b}. How many {t} remain?"),
    ("*", "{n} buys {a} bags of {b} {t}. How many {t} in all?"),
    ("*", "{n} gets {a} {t} a day for {b} days. How many {t} in all?"),
)
CALC_OBSERVATION = re.compile(r"(?<=</calc>)(=\S*)")  # the calculator's reply right after a call, in a demo


def calc(seed: int = 0, count: int = 1024) -> list[dict]:
    """Word problems for the calculator tool (`env: calculator`): `Ann has 37 pens and buys 48 more. How many pens
    now? Calc:` -> answer `85`. Column `demo` is the transcript of an episode that uses the tool, the calculator's
    observation included as the environment appends it: `<calc>37+48</calc>=85 A=85`; the model's final answer
    follows the last `A=` (reward `tagged_number`)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        op, template = rng.choice(_CALC_PROBLEMS)
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if op == "-" and a < b:
            a, b = b, a  # never more taken away than there is
        name, other = rng.sample(_NAMES, 2)
        question = template.format(n=name, m=other, t=rng.choice(_THINGS), a=a, b=b)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        rows.append({"prompt": question + CALC_CUE, "answer": str(value),
                     "demo": f"<calc>{a}{op}{b}</calc>={value} A={value}"})
    return rows


def demo_segments(demo: str) -> list[tuple[str, bool]]:
    """A `demo` cut where an episode cuts it: (text, written by the model) pieces, the calculator's observations
    (`=85` right after `</calc>`) being the environment's. Empty pieces are dropped."""
    pieces = CALC_OBSERVATION.split(demo)
    return [(text, i % 2 == 0) for i, text in enumerate(pieces) if text]
