"""A tiny model that knows the Hermes tool-call format, for the chat-form tool-calling tests (unit: token identity on
both engines; integration: a run with tool calls). The calc tiny model is taught, in about 20 s of supervised
steps, to answer every chat prompt with one calculator call and then `A=4` after the tool's reply; the directory is
saved with stages/chat_template.py's template as its tokenizer's own (a model with a template, as a user's would be).
It is cached per machine beside builtin:tiny-llama, keyed by everything the training sees (the examples' ids and
labels, the steps, the template, torch's version): the unit and integration tests teach it once, not once each."""

from __future__ import annotations

from pathlib import Path

TOOLS = ["builtin:calculator"]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'


def teach_tool_format(out: Path, steps: int = 240) -> Path:
    """Copy the taught model into `out` (its own directory, which the caller may change); teach it on a cache miss.
    240 steps: at 120 (loss 0.03 a token) a sampled turn (temperature 1) was a well-formed call ~8% of the time, so a
    16-episode run made no call at all about one time in four; at 240, 50-75% of sampled turns are calls."""
    import hashlib
    import json
    import shutil

    import torch
    import transformers

    from rlflow.stages import tasks
    from rlflow.stages.chat_template import TINY_TOOL_TEMPLATE, ChatRenderer
    from rlflow.stages.tiny_model import build_atomically, build_tiny_llama, cache_root
    from rlflow.stages.tools import load_tools

    base = build_tiny_llama("calc", progress=lambda line: None)
    tok = transformers.AutoTokenizer.from_pretrained(base)
    renderer = ChatRenderer(tok, load_tools(TOOLS)[0], TINY_TOOL_TEMPLATE)
    call = tok.encode(CALL, add_special_tokens=False) + [tok.eos_token_id]
    obs = renderer.observation_ids(call, [{"role": "tool", "name": "calculator", "content": "4"}])
    answer = tok.encode("A=4", add_special_tokens=False) + [tok.eos_token_id]
    examples = []
    for row in tasks.calc(5, 8):  # one call for every prompt: the format is what is taught, not arithmetic
        prompt = renderer.prompt_ids(row["prompt"])
        examples.append((prompt + call + obs + answer, [0] * len(prompt) + [1] * len(call) + [0] * len(obs) + [1] * len(answer)))
    key = hashlib.sha256(json.dumps([base.name, examples, steps, TINY_TOOL_TEMPLATE, torch.__version__,
                                     transformers.__version__]).encode()).hexdigest()[:10]
    cached = cache_root() / f"tool-taught-{base.name}-{key}"
    if not (cached / "config.json").exists():
        build_atomically(cached, lambda tmp: _teach(base, tok, examples, steps, tmp))
    shutil.copytree(cached, out, dirs_exist_ok=True)
    return out


def _teach(base: Path, tok, examples: list[tuple[list[int], list[int]]], steps: int, out: Path) -> None:
    """`steps` supervised steps on `examples` (ids, loss mask) from `base`; the model and `tok`, with the template, into `out`."""
    import torch
    import transformers

    from rlflow.stages.chat_template import TINY_TOOL_TEMPLATE

    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    width = max(len(ids) for ids, _ in examples)
    ids = torch.tensor([i + [tok.pad_token_id] * (width - len(i)) for i, _ in examples])
    labels = torch.tensor([[t if m else -100 for t, m in zip(i, mask)] + [-100] * (width - len(i)) for i, mask in examples])
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval().save_pretrained(out)
    tok.chat_template = TINY_TOOL_TEMPLATE
    tok.save_pretrained(out)
