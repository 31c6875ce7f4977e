"""What a prompt row is, for every reader of one: training's stream, evaluation's held-out set, the head check.

One rule judges a row (`row_problem`): a missing, empty or non-text prompt or answer is a problem named by the row's
place in its file, and every reader stops on it (compile and run start in the head, runtime/prompt_source.py
while drawing, runtime/evaluation.py for held-out rows). The held-out split (`held_out`) and the prompt's token ids
(`encode_prompt`) are shared the same way, so evaluation scores exactly the rows training skips, formatted as
training formats them. No Ray, no torch: imported by the compiler and both runtime readers alike.
"""

from __future__ import annotations

import hashlib
import json

BUILTIN_TASK_ROWS = 4096  # rows generated for a built-in task without a limit


def missing(value) -> bool:
    """No value: absent, null, or a float NaN (how Parquet/pandas often write a null)."""
    return value is None or (isinstance(value, float) and value != value)


def missing_problem(where: str, field: str, what: str) -> tuple[str, str, str]:
    """A row at `where` lacks its `what` (prompt or answer), held in column `field`."""
    return (f"{where} has no {what} ({field!r} is missing or null)", f"missing-{what}",
            f"give every row {'an' if what == 'answer' else 'a'} {what}, or remove the rows without one")


def not_text(value, what: str) -> bool:
    """A prompt must be a string; an answer a string or a number (an answer 4 is the text '4'), never a bool, a list,
    an object or bytes."""
    if isinstance(value, str):
        return False
    return what == "prompt" or isinstance(value, bool) or not isinstance(value, (int, float))


def row_problem(row: dict, fields: tuple[str, str], where: str) -> tuple[str, str, str] | None:
    """(message, rule, fix) for the first unusable field of a row at `where`: missing-*, *-not-text, empty-*
    (prompt, then answer); None if the row is usable. The head check (compile, run start), the rows drawn during
    the run and the held-out rows of an evaluation all judge a row by this."""
    for field, what in zip(fields, ("prompt", "answer")):
        value = row.get(field)
        if missing(value):
            return missing_problem(where, field, what)
        if not_text(value, what):
            kind = "a string or a number" if what == "answer" else "a string"
            return (f"{where} has {'an' if what == 'answer' else 'a'} {what} that is not text ({field!r} is a "
                    f"{type(value).__name__})", f"{what}-not-text", f"write every {what} as {kind}")
        if isinstance(value, str) and not value.strip():
            return (f"{where} has an empty {what} ({field!r} is {value!r})", f"empty-{what}",
                    f"give every row {'an' if what == 'answer' else 'a'} {what} with text, or remove the rows without one")
    return None


def held_out(prompt: str, fraction: float) -> bool:
    """Whether a row with this prompt text is in the held-out `fraction` (sha256: stable across processes and
    Python versions, unlike hash(); equal prompts fall on the same side)."""
    h = int.from_bytes(hashlib.sha256(prompt.encode("utf-8")).digest()[:8], "big")
    return h < fraction * 2**64


def encode_prompt(tokenizer, prompt: str, prompt_format: str = "raw", system_prompt: str | None = None) -> list[int]:
    """A prompt's token ids as the model expects them. raw: the text with the tokenizer's special tokens (<s>);
    chat: the tokenizer's chat template around it as the user message (after `system_prompt` as a system message),
    generation prompt added; ValueError when the tokenizer has no chat template."""
    if prompt_format == "raw":
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if prompt_format != "chat":
        raise ValueError(f"unknown prompt_format {prompt_format!r}; use raw or chat")
    messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    ids = tokenizer.apply_chat_template(messages + [{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 returns a BatchEncoding


def plain(row: dict) -> dict:
    """The row as plain JSON types (timestamps and the like become strings)."""
    return json.loads(json.dumps(row, default=str))
