"""Chat-form episodes in token ids: the prompt rendered by the model's chat template with the tools' schemas, and each
turn's tool messages as the template's tokens, appended after the ids the engine generated.

The trained ids are exactly the generated ones: generated text is never decoded and re-tokenised. Re-tokenising a
conversation between turns is a known source of silent drift — a BPE merge across a turn boundary, or a template
that renders an assistant message differently from what was sampled, changes the tokens the trainer scores from
those the policy sampled (verl issue #6719, prime-rl issue #1352, TRL pull request #6250). Instead the observation's
tokens are a delta on a fixed conversation:

    base  = render([user "1", assistant "2"])                              (no generation prompt)
    after = render([user "1", assistant "2", tool messages...], generation prompt)
    delta = after[len(base):]      (after must start with base exactly, or the template is refused)

and what the template puts after an assistant message's content (`end_of_turn`, e.g. `<|im_end|>` `\\n`) is learned
from the same fixed conversation: a turn the engine ended on the end-of-turn token gets the rest of it (the `\\n`)
prepended to the delta, a turn ended otherwise (a stop string) gets all of it. So prompt + generated + observation ids
are what the template would give for the conversation, without touching a generated id.

`builtin:tiny-llama`'s tokenizer has no chat template of its own (its tasks are raw text); TINY_TOOL_TEMPLATE is the
ChatML-like one a chat-form stage renders it with: `<s>role\\ncontent</s>` turns, the tools listed in a system turn.
"""

from __future__ import annotations

# `<s>`/`</s>` are the tiny tokenizer's bos/eos: each turn is one `<s>role\ncontent</s>`, and an assistant turn
# ends where the model emits eos. Tools are listed one a line as name(params): description.
TINY_TOOL_TEMPLATE = (
    "{%- set sys = messages[0]['content'] if messages and messages[0]['role'] == 'system' else none -%}"
    "{%- if tools or sys is not none -%}"
    "{{ '<s>system\n' }}{% if sys is not none %}{{ sys }}{% if tools %}{{ '\n' }}{% endif %}{% endif %}"
    "{%- if tools -%}"
    "{{ 'Tools. Call one as <tool_call>{\"name\": NAME, \"arguments\": {...}}</tool_call>\n' }}"
    "{%- for t in tools -%}{%- set f = t['function'] if 'function' in t else t -%}"
    "{{ f['name'] + '(' + (f['parameters']['properties'] | list | join(', ')) + '): ' + f.get('description', '') + '\n' }}"
    "{%- endfor -%}{%- endif -%}{{ '</s>' }}"
    "{%- endif -%}"
    "{%- for m in messages -%}{%- if not (loop.first and m['role'] == 'system') -%}"
    "{{ '<s>' + m['role'] + '\n' + (m['content'] or '') }}"
    "{%- for c in m.get('tool_calls') or [] -%}{%- set f = c['function'] if 'function' in c else c -%}"
    "{{ '<tool_call>' + ({'name': f['name'], 'arguments': f['arguments']} | tojson) + '</tool_call>' }}"
    "{%- endfor -%}{{ '</s>' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<s>assistant\n' }}{%- endif -%}"
)

_USER, _ASSISTANT = {"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}


class TemplateError(ValueError):
    """The chat template cannot give observation tokens as a delta (it re-renders earlier messages)."""


class ChatRenderer:
    """Token ids of a chat-form episode's prompt and observations, by `tokenizer`'s chat template (or `template`)."""

    def __init__(self, tokenizer, tools: list[dict], template: str | None = None):
        self.tokenizer, self.tools, self.template = tokenizer, list(tools), template or None
        if not (self.template or getattr(tokenizer, "chat_template", None)):
            raise TemplateError("the tokenizer has no chat template; chat-form tools need one")
        prompt = self.render([_USER], generation=True)
        self.base = self.render([_USER, _ASSISTANT], generation=False)
        content = list(tokenizer.encode(_ASSISTANT["content"], add_special_tokens=False))
        rest = self.base[len(prompt):]
        if self.base[:len(prompt)] != prompt or rest[:len(content)] != content:
            raise TemplateError("the chat template does not render an assistant message as its generation prompt plus "
                                "its content: generated ids could not be kept as they are")
        self.end_of_turn = rest[len(content):]
        if not self.end_of_turn:
            raise TemplateError("the chat template puts nothing after an assistant message: a turn's end is unknown")

    def render(self, messages: list[dict], *, generation: bool) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, tools=self.tools or None, chat_template=self.template,
                                                 add_generation_prompt=generation, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 returns a BatchEncoding

    def prompt_ids(self, prompt: str, system: str | None = None) -> list[int]:
        """The first user message (after `system`), the tools in the template's place, generation prompt added."""
        messages = [{"role": "system", "content": system}] if system is not None else []
        return self.render(messages + [{"role": "user", "content": prompt}], generation=True)

    def observation_ids(self, turn_ids: list[int], messages: list[dict]) -> list[int]:
        """Ids to append after a generated turn (`turn_ids`) for its tool `messages`: the rest of the assistant turn's
        end, the tool messages and the next generation prompt, as the template renders them."""
        after = self.render([_USER, _ASSISTANT, *messages], generation=True)
        if after[:len(self.base)] != self.base:
            raise TemplateError("the chat template renders earlier messages differently once tool messages follow")
        ended = bool(turn_ids) and turn_ids[-1] == self.end_of_turn[0]
        return self.end_of_turn[1:] + after[len(self.base):] if ended else self.end_of_turn + after[len(self.base):]
