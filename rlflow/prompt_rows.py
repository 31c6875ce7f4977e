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


ROLES = ("system", "user", "assistant", "tool")


def messages_problem(value, where: str, field: str, *, answer_in_messages: bool) -> tuple[str, str, str] | None:
    """(message, rule, fix) for a `messages` prompt that is not a chat (prompt_format messages): a non-empty list of
    {role, content} with a known role and text content, a user message among them, and (answer_in_messages: the
    answer is the last assistant message) one with text at the end; None if usable."""
    fix = (f"write {field!r} as a list of {{\"role\": \"user\", \"content\": \"...\"}} messages (roles: "
           f"{', '.join(ROLES)})")
    if missing(value):
        return missing_problem(where, field, "prompt")
    if not isinstance(value, (list, tuple)) or not value:
        what = "an empty list" if isinstance(value, (list, tuple)) else f"a {type(value).__name__}"
        return f"{where} has messages that are {what} ({field!r})", "bad-messages", fix
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            return (f"{where} has message {i + 1} that is not {{role, content}} with a known role and text content "
                    f"({str(m)[:80]})", "bad-messages", fix)
    if answer_in_messages and (value[-1]["role"] != "assistant" or not value[-1]["content"].strip()):
        return (f"{where} has no assistant message with text at the end of {field!r}, which answer_field names as the "
                "answer", "missing-answer", "end every row's messages with the reference answer as an assistant message, "
                "or set answer_field to a column of answers")
    if not any(m["role"] == "user" for m in chat_messages(value, answer_in_messages)):
        return f"{where} has no user message to answer ({field!r})", "bad-messages", fix
    return None


def chat_messages(messages, answer_in_messages: bool) -> list[dict]:
    """The conversation the model continues: the row's messages, without the last one when it is the answer."""
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    return messages[:-1] if answer_in_messages else messages


def row_problem_as(row: dict, fields: tuple[str, str], where: str, prompt_format: str) -> tuple[str, str, str] | None:
    """row_problem for a task's prompt_format: with messages the prompt column holds a chat (messages_problem), and
    an answer_field equal to the prompt_field names the chat's last assistant message as the answer."""
    if prompt_format != "messages":
        return row_problem(row, fields, where)
    same = fields[0] == fields[1]
    problem = messages_problem(row.get(fields[0]), where, fields[0], answer_in_messages=same)
    return problem or (None if same else row_problem({"p": "x", fields[1]: row.get(fields[1])}, ("p", fields[1]), where))


def row_prompt_answer(row: dict, fields: tuple[str, str], prompt_format: str) -> tuple[str | list[dict], str]:
    """A usable row's prompt (text; with prompt_format messages the chat to continue) and answer text."""
    prompt = row[fields[0]]
    if prompt_format != "messages":
        return str(prompt), str(row[fields[1]])
    same = fields[0] == fields[1]
    return chat_messages(prompt, same), (prompt[-1]["content"] if same else str(row[fields[1]]))


def prompt_text(prompt: str | list[dict]) -> str:
    """A prompt as one text (logs, the ledger, the held-out hash): a chat's last user message."""
    if isinstance(prompt, str):
        return prompt
    return next((m["content"] for m in reversed(prompt) if m["role"] == "user"), "")


def held_out(prompt: str, fraction: float) -> bool:
    """Whether a row with this prompt text is in the held-out `fraction` (sha256: stable across processes and
    Python versions, unlike hash(); equal prompts fall on the same side)."""
    h = int.from_bytes(hashlib.sha256(prompt.encode("utf-8")).digest()[:8], "big")
    return h < fraction * 2**64


def encode_prompt(tokenizer, prompt: str | list[dict], prompt_format: str = "raw",
                  system_prompt: str | None = None) -> list[int]:
    """A prompt's token ids as the model expects them. raw: the text with the tokenizer's special tokens (<s>);
    chat: the tokenizer's chat template around it as the user message (after `system_prompt` as a system message),
    generation prompt added; messages: `prompt` is the chat itself (row_prompt_answer), rendered the same way
    (`system_prompt` first unless the chat opens with one); ValueError when the tokenizer has no chat template."""
    if prompt_format == "raw":
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if prompt_format not in ("chat", "messages"):
        raise ValueError(f"unknown prompt_format {prompt_format!r}; use raw, chat or messages")
    chat = list(prompt) if prompt_format == "messages" else [{"role": "user", "content": prompt}]
    opens = bool(chat) and chat[0]["role"] == "system"
    messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None and not opens else []
    ids = tokenizer.apply_chat_template(messages + chat, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 returns a BatchEncoding


def plain(row: dict) -> dict:
    """The row as plain JSON types (timestamps and the like become strings)."""
    return json.loads(json.dumps(row, default=str))
