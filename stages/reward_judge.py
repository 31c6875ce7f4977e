"""A generative judge as a scorer (`judge:` of a reward stage): a causal LM reads a template filled with the row,
writes a verdict, and a named rule turns the verdict into a reward (the LLM-as-a-judge setting of "Judging
LLM-as-a-Judge with MT-Bench and Chatbot Arena", §2). Loaded once per reward actor, run in batches, greedy.

A verdict the rule cannot read fails its trajectory ("verdict 'maybe' is not yes or no"), and so does a batch that
runs past timeout_s ("timed out"): generation stops at the deadline (transformers' max_time, or the vLLM requests
aborted), it never hangs. The engines (`hf`, `vllm`) are in stages/judge_generate.py.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Callable

#: the format fields a judge's template may use
TEMPLATE_FIELDS = ("prompt", "completion", "answer")
#: the verdict rules, as a person writes them
VERDICT_RULES = ("yes_no", "score_0_10", "regex:PATTERN")


class Unparseable(ValueError):
    """The rule could not read a verdict; str() says what it got."""


def _shown(text: str) -> str:
    text = text.strip()
    return repr(text if len(text) <= 40 else text[:37] + "...")


def yes_no(text: str) -> float:
    """1.0 if the verdict's first word is yes, 0.0 if no (any case, punctuation after it ignored)."""
    word = re.match(r"\s*([A-Za-z]+)", text)
    if word and word.group(1).lower() in ("yes", "no"):
        return 1.0 if word.group(1).lower() == "yes" else 0.0
    raise Unparseable(f"verdict {_shown(text)} is not yes or no")


def score_0_10(text: str) -> float:
    """The verdict's first integer, 0..10, divided by 10."""
    found = re.search(r"-?\d+", text)
    if found and 0 <= int(found.group()) <= 10:
        return int(found.group()) / 10
    raise Unparseable(f"verdict {_shown(text)} holds no integer from 0 to 10")


def regex_rule(pattern: str) -> Callable[[str], float]:
    """With a group: the first match's group 1 as a number (no match or no number: unparseable). Without a group:
    1.0 if the pattern matches anywhere, else 0.0."""
    compiled = re.compile(pattern)

    def rule(text: str) -> float:
        found = compiled.search(text)
        if not compiled.groups:
            return 1.0 if found else 0.0
        if not found:
            raise Unparseable(f"verdict {_shown(text)} does not match {pattern!r}")
        try:
            value = float(found.group(1))
        except (TypeError, ValueError):
            raise Unparseable(f"verdict {_shown(text)}: {found.group(1)!r} is not a number") from None
        if not math.isfinite(value):
            raise Unparseable(f"verdict {_shown(text)}: {value} is not a finite number")
        return value

    return rule


def verdict_rule(spec: str) -> Callable[[str], float]:
    """The rule named by `spec` (VERDICT_RULES); ValueError saying why for an unknown name or a bad pattern."""
    if spec == "yes_no":
        return yes_no
    if spec == "score_0_10":
        return score_0_10
    if spec.startswith("regex:"):
        try:
            return regex_rule(spec.removeprefix("regex:"))
        except re.error as e:
            raise ValueError(f"'{spec}' is not a valid regular expression ({e})") from None
    raise ValueError(f"unknown verdict rule '{spec}'")


def template_problem(template: str) -> str | None:
    """Why a judge template is unusable (None: it is): bad format syntax, a field other than TEMPLATE_FIELDS, or no
    {completion} (a judge that never sees the completion judges nothing)."""
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        return f"the template is not a format string ({e}); write literal braces as {{{{ and }}}}"
    unknown = sorted(fields - set(TEMPLATE_FIELDS))
    if unknown:
        return f"the template uses {{{unknown[0]}}}; the fields are {', '.join('{' + f + '}' for f in TEMPLATE_FIELDS)}"
    if "completion" not in fields:
        return "the template has no {completion}: the judge would never see what it judges"
    return None


class Judge:
    """Verdicts on items ({prompt, completion, answer}) from a causal LM in this process, batch_size at a time."""

    def __init__(self, model_dir: str, template: str, verdict: str, *, engine: str = "hf", max_new_tokens: int = 8,
                 timeout_s: float = 30.0, batch_size: int = 8, device: str | None = None, dtype: str = "auto",
                 gpu_memory_utilization: float = 0.5):
        import torch

        from rlflow.stages.judge_generate import HFGreedy, VLLMGreedy
        from rlflow.stages.reward_model import weights_dtype

        self.template, self.rule, self.verdict = template, verdict_rule(verdict), verdict
        self.max_new_tokens, self.timeout_s, self.batch_size = max_new_tokens, timeout_s, batch_size
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = weights_dtype(dtype, self.device)
        if engine == "hf":
            self.generate = HFGreedy(model_dir, max_new_tokens=max_new_tokens, device=self.device, dtype=self.dtype)
        elif engine == "vllm":
            self.generate = VLLMGreedy(model_dir, max_new_tokens=max_new_tokens, batch_size=batch_size,
                                       dtype=self.dtype, gpu_memory_utilization=gpu_memory_utilization)
        else:
            raise ValueError(f"unknown judge engine {engine!r}; use hf or vllm")
        self.tokenizer = self.generate.tokenizer
        self.last_verdicts: list[str] = []  # the judge's text of the last batch (for tests and debugging)

    def close(self) -> None:
        """Shut the engine down (a vLLM judge's engine-core process); the judge is unusable after."""
        closing = getattr(self.generate, "close", None)
        if closing:
            closing()

    def prompt(self, item: dict) -> str:
        return self.template.format(prompt=item["prompt"], completion=item["completion"], answer=item.get("answer", ""))

    def score(self, items: list[dict]) -> list[tuple[float, str, bool]]:
        """(reward, "", False), or (nan, why, timed_out) per item."""
        out: list[tuple[float, str, bool]] = []
        for i in range(0, len(items), self.batch_size):
            out += self._batch(items[i:i + self.batch_size])
        return out

    def _batch(self, items: list[dict]) -> list[tuple[float, str, bool]]:
        from rlflow.stages.judge_generate import JudgeTimeout

        try:
            texts = self.generate([self.prompt(it) for it in items], self.timeout_s)
        except JudgeTimeout:  # cut short: no verdict to trust
            return [(math.nan, f"the judge timed out after {self.timeout_s:g} s", True)] * len(items)
        except Exception as e:  # noqa: BLE001 - this batch fails by name, the stage goes on
            why = f"the judge raised {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
            return [(math.nan, why, False)] * len(items)
        self.last_verdicts = texts
        out = []
        for text in texts:
            try:
                out.append((self.rule(text), "", False))
            except Unparseable as e:
                out.append((math.nan, f"the judge's {e} (rule {self.verdict})", False))
        return out
