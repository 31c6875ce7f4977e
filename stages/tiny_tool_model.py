"""`builtin:tiny-llama` for a chat-form tool stage: the task's text-form build, warm-started further on the same
transcripts in chat form, then cached beside it.

A calc row's demo `<calc>37+48</calc>=85 A=85` becomes the conversation the rollout renders (stages/chat_template.py,
TINY_TOOL_TEMPLATE): the prompt with the calculator's schema, the assistant's
`<tool_call>{"name": "calculator", "arguments": {"expression": "37+48"}}</tool_call>`, the tool's `85`, and the
assistant's `A=85`. Only the assistant's tokens are trained, as in a rollout (the tool's reply is context). The
template is saved as the tokenizer's own, so the directory is an ordinary chat model with tools.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from rlflow.stages.chat_template import TINY_TOOL_TEMPLATE, ChatRenderer
from rlflow.stages.tasks import demo_segments

TOOLS = ["builtin:calculator"]
SFT_STEPS, BATCH, LR, ROWS = 150, 16, 2e-3, 2400
SETTINGS = {"steps": SFT_STEPS, "batch": BATCH, "lr": LR, "rows": ROWS, "format": 1}


def chat_example(tokenizer, renderer: ChatRenderer, row: dict) -> tuple[list[int], list[int]]:
    """(ids, trained 0/1) of one row's tool-using transcript in chat form."""
    ids = renderer.prompt_ids(row["prompt"])
    mask = [0] * len(ids)
    for text, by_model in demo_segments(row["demo"]):
        if not by_model:
            continue  # the text form's observation: the tool message below stands for it
        text = text.strip()
        if text.startswith("<calc>"):
            expr = text.removeprefix("<calc>").removesuffix("</calc>")
            turn = json.dumps({"name": "calculator", "arguments": {"expression": expr}})
            turn_ids = tokenizer.encode(f"<tool_call>{turn}</tool_call>", add_special_tokens=False) + [tokenizer.eos_token_id]
            obs = renderer.observation_ids(turn_ids, [{"role": "tool", "name": "calculator", "content": row["answer"]}])
            ids, mask = ids + turn_ids + obs, mask + [1] * len(turn_ids) + [0] * len(obs)
        else:
            turn_ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
            ids, mask = ids + turn_ids, mask + [1] * len(turn_ids)
    return ids, mask


def build_tiny_tool_llama(task: str = "calc", *, seed: int = 0, progress=print) -> Path:
    """The directory of the chat-form tool model for `task` (a built-in task whose rows carry calculator demos);
    built on a cache miss (about a minute on 2 cores, after the text-form build)."""
    from rlflow.stages.tiny_model import build_atomically, build_tiny_llama, task_rows

    base = build_tiny_llama(task, seed=seed, progress=progress)
    key = hashlib.sha256(json.dumps(SETTINGS, sort_keys=True).encode() + TINY_TOOL_TEMPLATE.encode()).hexdigest()[:8]
    final = base.parent / f"{base.name}-tools-{key}"
    if (final / "config.json").exists():
        return final
    rows = [r for r in task_rows(task, seed + 7, ROWS) if r.get("demo")]
    return build_atomically(final, lambda tmp: _build(base, tmp, rows, progress))


def _build(base: Path, out: Path, rows: list[dict], progress) -> None:
    import torch
    import transformers

    from rlflow.stages.tools import load_tools

    if not rows:
        raise ValueError("no rows with a calculator demo to warm the tool model start on")
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    renderer = ChatRenderer(tokenizer, load_tools(TOOLS)[0], TINY_TOOL_TEMPLATE)
    examples = [chat_example(tokenizer, renderer, r) for r in rows]
    random.Random(0).shuffle(examples)
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model.train()
    for step in range(SFT_STEPS):
        batch = [examples[(step * BATCH + i) % len(examples)] for i in range(BATCH)]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([i + [tokenizer.pad_token_id] * (width - len(i)) for i, _ in batch])
        labels = torch.tensor([[t if m else -100 for t, m in zip(i, k)] + [-100] * (width - len(i)) for i, k in batch])
        attention = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in batch])
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % 50 == 0:
            progress(f"tiny-llama[tools]: step {step + 1}/{SFT_STEPS} loss {loss.item():.3f}")
    model.eval().save_pretrained(out)
    tokenizer.chat_template = TINY_TOOL_TEMPLATE
    tokenizer.save_pretrained(out)
