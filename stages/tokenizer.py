"""A small byte-level BPE tokenizer trained locally on the built-in tasks' text (no download).

Digits are split one per token (so sums are digit by digit); every byte has a token, so any
text round-trips. `tokenizer(prompt)` prepends <s>; completions end with </s>.
"""

from __future__ import annotations

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2
# Always in the training text, so a model built for these tasks keeps the tokenizer (and cache key) it always had;
# a build for other built-in tasks adds their text (tiny_model.tokenizer_tasks).
BASE_TASKS = ("arith", "repeat")


def train_tokenizer(vocab_size: int = 384, *, seed: int = 0, rows: int = 4000, tasks: tuple[str, ...] = BASE_TASKS):
    """Train the BPE on prompts+answers (or +demos) of the named built-in tasks (`arith`, `countdown`, ...); return a
    PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from rlflow.registry import resolve

    # a row with a tool-using `demo` (builtin:calc) is learned from it: the demo, not the bare answer, is what a
    # warm start trains on
    text = [r["prompt"] + (r.get("demo") or r["answer"]) for name in tasks for r in resolve("task", f"builtin:{name}")(seed, rows)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(text, trainer)
    bos = bpe.token_to_id("<s>")
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)])
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        clean_up_tokenization_spaces=False,
    )
