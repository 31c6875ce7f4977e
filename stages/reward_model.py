"""A reward model as a scorer (`model:` of a reward stage): a Hugging Face sequence-classification model with one
label, loaded once per reward actor (a stateful class in the stage's Ray Data actor pool) and run in batches.

`builtin:tiny-reward` is built here, locally and deterministically (no download, no training): a one-layer
LlamaForSequenceClassification on the tiny tokenizer whose weights are set by hand so that its score is the share
of digit tokens in the text it reads (to about 1e-4). A stand-in that shows the plumbing and that a test can check
against a count; it teaches a policy nothing useful.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

TINY_REWARD_FORMAT = 1  # bump when the construction below changes: it is the cache key
_HIDDEN = 64  # one head of 64 (the tiny Llama's head size)
_BIAS = 100.0  # every token's constant component: it dominates the RMS norms, so they scale by a near-constant


def tiny_reward_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    from rlflow.stages.tiny_model import cache_root

    return cache_root(cache_dir) / f"tiny-reward-v{TINY_REWARD_FORMAT}"


def build_tiny_reward(*, cache_dir: str | os.PathLike | None = None, progress=print) -> Path:
    """The directory of `builtin:tiny-reward`; built (about a second: a BPE tokenizer and a hand-set model) on a miss."""
    final = tiny_reward_dir(cache_dir)
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".build-{final.name}-", dir=final.parent))
    try:
        progress("tiny-reward: constructing a one-layer reward model (score = share of digit tokens)")
        tokenizer, model = _construct()
        from rlflow.stages.hf_quiet import no_progress_bars

        with no_progress_bars():
            model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        config = json.loads((tmp / "tokenizer_config.json").read_text())
        config["tokenizer_class"] = "PreTrainedTokenizerFast"  # transformers 4 and 5 alike
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, final)  # atomic: readers see no model or a whole one
        except OSError:
            if not (final / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _construct():
    """(tokenizer, LlamaForSequenceClassification) with hand-set weights. Embedding: dim 0 = _BIAS for every token,
    dim 2 = 1 for a digit. Attention with zero queries and keys is uniform over the causal prefix, so value dim 2 ->
    output dim 1 carries the prefix's share of digits to the last token; the MLP adds nothing (zero down_proj), and
    the score head reads dim 1 scaled back by the norms' near-constant RMS (dim 0)."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from rlflow.stages.tokenizer import train_tokenizer

    tokenizer = train_tokenizer(384, seed=0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=_HIDDEN, intermediate_size=_HIDDEN, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=_HIDDEN, max_position_embeddings=512,
                         num_labels=1, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForSequenceClassification(config)
    rms = _BIAS / math.sqrt(_HIDDEN)  # each norm divides by about this
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in (model.model.norm, model.model.layers[0].input_layernorm, model.model.layers[0].post_attention_layernorm):
            norm.weight.fill_(1.0)
        embed = model.model.embed_tokens.weight
        embed[:, 0] = _BIAS
        for digit in tokenizer.convert_tokens_to_ids(list("0123456789")):
            embed[digit, 2] = 1.0
        attn = model.model.layers[0].self_attn
        attn.v_proj.weight[3, 2] = rms  # the normalised digit marker back to 1
        attn.o_proj.weight[1, 3] = 1.0
        model.score.weight[0, 1] = rms
    return tokenizer, model


def is_digit_share(text_ids: list[int], tokenizer) -> float:
    """What builtin:tiny-reward scores a sequence of ids (with its <s>): the share of them that are digits."""
    digits = set(tokenizer.convert_tokens_to_ids(list("0123456789")))
    return sum(i in digits for i in text_ids) / len(text_ids)


def model_dir_problem(path: Path) -> str | None:
    """Why `path` is not a usable reward model directory (None: it is): config.json with a *ForSequenceClassification
    architecture and one label. Reads the config only (no torch)."""
    config_file = path / "config.json"
    if not config_file.is_file():
        return f"'{path}' is not a Hugging Face model directory (no config.json)"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"'{config_file}' is not readable JSON ({type(e).__name__})"
    archs = config.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in archs):
        return f"'{path}' holds {', '.join(archs) or 'no architecture'}, not a *ForSequenceClassification model"
    labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
    if labels != 1:
        return f"'{path}' has {labels} labels; a reward model has one (a scalar score)"
    return None


def weights_dtype(dtype: str, device: str):
    """The torch dtype a reward model or judge loads in: `dtype` as declared; auto is bfloat16 on a CUDA GPU that has
    it, float16 on one that does not, float32 elsewhere."""
    import torch

    if dtype != "auto":
        return getattr(torch, dtype)
    if not str(device).startswith("cuda"):
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


class RewardModel:
    """Scores (prompt, completion) pairs with a sequence-classification model, batch_size at a time, on `device`.
    The text is the tokenizer's chat template over a user and an assistant turn when it has one, else prompt +
    completion; longer texts keep their end (the completion)."""

    def __init__(self, model_dir: str, batch_size: int = 16, device: str | None = None, dtype: str = "auto"):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = weights_dtype(dtype, self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.truncation_side = "left"
        from rlflow.stages.hf_quiet import no_progress_bars

        with no_progress_bars():
            self.model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=self.dtype)
            self.model = self.model.to(self.device).eval()
        if self.model.config.pad_token_id is None:  # it finds each row's last token by the pad id
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.max_length = min(self.tokenizer.model_max_length, getattr(self.model.config, "max_position_embeddings", 512))
        self.batch_size = batch_size

    def text(self, prompt: str, completion: str) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt},
                                                       {"role": "assistant", "content": completion}], tokenize=False)
        return prompt + completion

    def score(self, items: list[dict]) -> list[tuple[float, str, bool]]:
        """(score, "", False) per item ({prompt, completion, ...}); a batch that raises fails its items by name."""
        import torch

        out: list[tuple[float, str, bool]] = []
        for i in range(0, len(items), self.batch_size):
            batch = [self.text(it["prompt"], it["completion"]) for it in items[i:i + self.batch_size]]
            try:
                enc = self.tokenizer(batch, padding=True, truncation=True, max_length=self.max_length,
                                     return_tensors="pt").to(self.device)
                with torch.inference_mode():
                    logits = self.model(**enc).logits[:, 0].float().tolist()
            except Exception as e:  # noqa: BLE001 - this batch fails by name, the stage goes on
                why = f"the reward model raised {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
                out += [(math.nan, why, False)] * len(batch)
                continue
            out += [(v, "", False) if math.isfinite(v) else (math.nan, f"the reward model scored {v}", False) for v in logits]
        return out
