"""`builtin:tiny-llama`: a small Llama built and warm-started locally on a built-in task, then cached.

With a pipeline's own data (`rows`: prompts and answers read from its task files), it is warm-started on those rows
instead (supervised, on the training rows only), so a user's own task starts from a model that has seen its format.

The result is a plain Hugging Face directory (LlamaForCausalLM, safetensors, fast tokenizer) that
transformers and vLLM load. Head dim 64 because vLLM's CPU attention accepts only some head sizes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

BUILD_FORMAT = 2  # bump when the recipe changes in a way the settings below do not capture
SFT_SEED_OFFSET = 1_000_003  # warm-start rows come from their own stream, not the RL prompts (task seed 0..)
EVAL_SEED_OFFSET = 2_000_003  # held-out prompts for the accuracy report


@dataclass(frozen=True)
class TinyLlamaSettings:
    """Everything that shapes the built model; its hash is part of the cache key."""

    vocab_size: int = 384
    hidden_size: int = 128  # small on purpose: on 2 CPU cores a smaller model learns more per second of warm start
    num_layers: int = 2
    num_heads: int = 2  # head_dim 64: vLLM CPU attention accepts 32, 64, 80, ... only
    intermediate_size: int = 512
    max_position_embeddings: int = 512
    sft_steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 20
    max_new_tokens: int = 8  # for the accuracy report
    eval_prompts: int = 256
    build_format: int = BUILD_FORMAT

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:10]


# Per-task warm starts, sized so the build stays within about a minute on 2 shared CPU cores.
# Other built-in tasks (registry.TASKS) get the default settings.
TASK_SETTINGS = {
    "arith": TinyLlamaSettings(sft_steps=500, max_new_tokens=8),
    "repeat": TinyLlamaSettings(sft_steps=110, max_new_tokens=48),
    "countdown": TinyLlamaSettings(sft_steps=300, max_new_tokens=16),
    "word_problems": TinyLlamaSettings(sft_steps=300, max_new_tokens=8),
    # 300 steps: greedy passes every hidden test on nearly every prompt. A 40-step warm start (greedy 0.66 held out)
    # was tried as a starting point for RL and fell to 0.27 in 60 steps (docs/results/learning.md).
    "code": TinyLlamaSettings(sft_steps=300, max_new_tokens=64),
    # few steps on purpose: a model that sometimes calls the calculator right leaves RL room to improve (held out,
    # with the calculator: 60 steps greedy 18% / sampled 2%, 70: 60% / 15%, 75: 74% / 28%, 80: 83% / 50%);
    # max_new_tokens is per turn (the accuracy report runs one calculator call between two turns)
    "calc": TinyLlamaSettings(sft_steps=75, max_new_tokens=16),
}
DEFAULT_SETTINGS = TinyLlamaSettings(sft_steps=300, max_new_tokens=48)
# A pipeline's own rows: fewer steps than the built-in tasks get, so a warm start leaves RL room to improve
DATA_SETTINGS = TinyLlamaSettings(sft_steps=80, max_new_tokens=48)
DATA_EVAL_ROWS = 128  # rows of the data held aside from the warm start, for its accuracy report


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where built models live: cache_dir, else $RLFLOW_CACHE/models, else ~/.cache/rlflow/models."""
    if cache_dir is not None:
        return Path(cache_dir)
    if os.environ.get("RLFLOW_CACHE"):
        return Path(os.environ["RLFLOW_CACHE"]) / "models"
    return Path.home() / ".cache" / "rlflow" / "models"


def _resolve(task: str, sft_steps: int | None, rows: list[dict] | None = None) -> tuple[str, TinyLlamaSettings]:
    """Task name without `builtin:` and its build settings. `a+b` warm-starts on several tasks at once
    (a pipeline with several task types); it takes the default settings with the longest answers' budget. With a
    pipeline's own `rows`, `task` is only the name (DATA_SETTINGS)."""
    from rlflow.registry import TASKS

    if rows is not None:
        if not rows:
            raise ValueError("no rows to warm builtin:tiny-llama start on")
        return task, DATA_SETTINGS if sft_steps is None else replace(DATA_SETTINGS, sft_steps=sft_steps)

    names = [t.removeprefix("builtin:") for t in task.split("+")]
    for name in names:
        if f"builtin:{name}" not in TASKS:
            known = ", ".join(sorted(n.removeprefix("builtin:") for n in TASKS))
            raise ValueError(f"unknown task '{name}' for builtin:tiny-llama; use one of: {known}")
    if len(names) == 1:
        settings = TASK_SETTINGS.get(names[0], DEFAULT_SETTINGS)
    else:
        longest = max(TASK_SETTINGS.get(n, DEFAULT_SETTINGS).max_new_tokens for n in names)
        settings = replace(DEFAULT_SETTINGS, max_new_tokens=longest)
    return "+".join(names), settings if sft_steps is None else replace(settings, sft_steps=sft_steps)


def tokenizer_tasks(task: str) -> tuple[str, ...]:
    """The tasks whose text trains the tokenizer: the base ones (so arith/repeat builds keep their tokenizer) and
    `task`'s. A function of the task name, which is in the cache directory's name and key."""
    from rlflow.stages.tokenizer import BASE_TASKS

    return BASE_TASKS + tuple(n for n in task.split("+") if n not in BASE_TASKS)


def tokenizer_for(task: str | None, seed: int = 0):
    """The tokenizer a build trains (_build), without the model: compile measures chat-form prompts with it. `task`:
    the built-in task(s) of the build (`calc`, `arith+repeat`); None: a build on a pipeline's own rows (a byte per
    token)."""
    from rlflow.stages.tokenizer import train_tokenizer

    if task is None:
        return train_tokenizer(DATA_SETTINGS.vocab_size, seed=seed, tasks=())
    task, settings = _resolve(task, None)
    return train_tokenizer(settings.vocab_size, seed=seed, tasks=tokenizer_tasks(task))


def task_rows(task: str, seed: int, count: int) -> list[dict]:
    """Rows {"prompt", "answer"} of a built-in task; for `a+b`, the tasks' rows interleaved."""
    from rlflow.registry import resolve

    names = task.split("+")
    parts = [resolve("task", f"builtin:{n}")(seed, -(-count // len(names))) for n in names]
    return [row for rows in zip(*parts) for row in rows][:count]


def model_dir(task: str = "arith", *, cache_dir: str | os.PathLike | None = None, seed: int = 0, sft_steps: int | None = None,
              rows: list[dict] | None = None) -> Path:
    """The cache directory a build with these arguments lives in (built or not).

    The key covers the build settings and a fingerprint of the task's rows (of every row, for a pipeline's own
    `rows`), so changing a task's generator or data never reuses a model warm-started on the old data.
    """
    task, settings = _resolve(task, sft_steps, rows)
    sample = rows if rows is not None else task_rows(task, seed, 64)
    key = hashlib.sha256(settings.key().encode() + json.dumps(sample, sort_keys=True).encode()).hexdigest()[:10]
    return cache_root(cache_dir) / f"tiny-llama-{task}-seed{seed}-{key}"


def build_tiny_llama(
    task: str = "arith", *, cache_dir: str | os.PathLike | None = None, seed: int = 0, sft_steps: int | None = None,
    rows: list[dict] | None = None, progress=print
) -> Path:
    """Return the directory of a tiny Llama warm-started on `task`, or on `rows` ({"prompt", "answer"}: a pipeline's
    own training rows, `task` then only names them); build it (about a minute) on a cache miss."""
    task, settings = _resolve(task, sft_steps, rows)
    final = model_dir(task, cache_dir=cache_dir, seed=seed, sft_steps=sft_steps, rows=rows)
    if (final / "config.json").exists():
        return final
    return build_atomically(final, lambda tmp: _build(tmp, task, seed, settings, progress, rows),
                            lambda: progress(f"tiny-llama[{task}]: another process built {final} first; using it"))


def build_atomically(final: Path, build, lost_race=lambda: None) -> Path:
    """Run `build(tmp)` into a fresh directory beside `final`, then rename it to `final` (readers see no model or a
    whole one); when another process renamed its build there first, keep theirs (`lost_race()` is told)."""
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".build-{final.name}-", dir=root))
    try:
        build(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the model is for every process of the user and others
        try:
            os.rename(tmp, final)  # atomic: readers see no model or a whole one
        except OSError:
            if not (final / "config.json").exists():
                raise
            lost_race()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _build(out: Path, task: str, seed: int, settings: TinyLlamaSettings, progress, data: list[dict] | None = None) -> None:
    """Train tokenizer, init, warm-start, evaluate and save into `out`. With `data` (a pipeline's own rows) the
    tokenizer is byte-level with no merges (one token per byte: any text, and a character-level view that small
    tasks of the user's own learn more easily from), and the warm start and its report use the
    rows: the last DATA_EVAL_ROWS (when there are twice that many) are held aside for the report."""
    import torch

    from rlflow.stages.tokenizer import train_tokenizer

    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # PLATFORM-NOTES: one thread per process on shared CPU cores
    try:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            progress(f"tiny-llama[{task}]: training a BPE tokenizer (vocab {settings.vocab_size})")
            tokenizer = train_tokenizer(settings.vocab_size, seed=seed, tasks=tokenizer_tasks(task) if data is None else ())
            model = _init_model(tokenizer, settings)
            params = sum(p.numel() for p in model.parameters()) / 1e6
            progress(f"tiny-llama[{task}]: {params:.2f}M params; warm start {settings.sft_steps} steps")
            if data is None:
                rows = task_rows(task, SFT_SEED_OFFSET + seed, settings.sft_steps * settings.batch_size)
                held_out = task_rows(task, EVAL_SEED_OFFSET + seed, settings.eval_prompts)
            else:
                aside = DATA_EVAL_ROWS if len(data) >= 2 * DATA_EVAL_ROWS else 0
                train, held_out = data[: len(data) - aside], data[len(data) - aside:] or data[:DATA_EVAL_ROWS]
                rows = [train[i % len(train)] for i in range(settings.sft_steps * settings.batch_size)]
            loss = _warm_start(model, tokenizer, rows, settings, progress, task)
            greedy = accuracy(model, tokenizer, held_out, settings.max_new_tokens, temperature=0.0)
            sampled = accuracy(model, tokenizer, held_out, settings.max_new_tokens, temperature=1.0)
    finally:
        torch.set_num_threads(threads)
    seconds = time.perf_counter() - started
    progress(
        f"tiny-llama[{task}]: {_metric(held_out)} on {_measured_on(held_out, data)}: greedy {greedy:.1%}, "
        f"sampled(T=1) {sampled:.1%}; built in {seconds:.0f} s"
    )
    from rlflow.stages.hf_quiet import no_progress_bars

    with no_progress_bars():  # no "Writing model shards" bar between the progress lines
        model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _portable_tokenizer_class(out / "tokenizer_config.json")
    report = {"task": task, "seed": seed, "settings": asdict(settings), "final_loss": loss, "accuracy_greedy": greedy,
              "accuracy_sampled": sampled, "eval_prompts": len(held_out),
              "eval_held_out": data is None or len(data) >= 2 * DATA_EVAL_ROWS, "build_seconds": round(seconds, 1)}
    (out / "rlflow_build.json").write_text(json.dumps(report, indent=2) + "\n")


def _measured_on(rows: list[dict], data: list[dict] | None) -> str:
    """What the build's accuracy was measured on, counted: prompts of the built-in task it never trained on, the
    rows held aside from the warm start, or (data too small to hold any aside) rows it trained on."""
    if data is None:
        return f"{len(rows)} held-out prompts"
    if len(data) >= 2 * DATA_EVAL_ROWS:
        return f"{len(rows)} of the {len(data)} rows, held out of the warm start"
    return (f"{len(rows)} of the {len(data)} rows it trained on (fewer than {2 * DATA_EVAL_ROWS}: none held out, so "
            "this is not a held-out accuracy)")


def _metric(rows: list[dict]) -> str:
    demos = sum(bool(r.get("demo")) for r in rows)
    scored = "tagged_number with one calculator call executed"
    return "exact match" if not demos else scored if demos == len(rows) else f"exact match or {scored}"


def _portable_tokenizer_class(path: Path) -> None:
    """Name the class PreTrainedTokenizerFast (transformers 4 and 5, hence vLLM) rather than 5's TokenizersBackend."""
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2) + "\n")


def _init_model(tokenizer, settings: TinyLlamaSettings):
    """A randomly initialised LlamaForCausalLM (untied embeddings) sized by the settings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=settings.hidden_size,
        intermediate_size=settings.intermediate_size,
        num_hidden_layers=settings.num_layers,
        num_attention_heads=settings.num_heads,
        num_key_value_heads=settings.num_heads,
        head_dim=settings.hidden_size // settings.num_heads,
        max_position_embeddings=settings.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def encode_row(tokenizer, row: dict) -> tuple[list[int], list[int]]:
    """(prompt ids with <s>, answer ids with </s>): the token layout the rollout engines produce. A row with a
    `demo` (a tool-using transcript) is encoded as the demo, one piece at a time as an episode tokenizes it."""
    prompt, answer, _ = encode_example(tokenizer, row)
    return prompt, answer


def encode_example(tokenizer, row: dict) -> tuple[list[int], list[int], list[bool]]:
    """encode_row's ids and, per answer token, whether the warm start trains it (not the tool's observations:
    they are environment tokens, as in a multi-turn rollout)."""
    from rlflow.stages.tasks import demo_segments

    prompt = tokenizer(row["prompt"])["input_ids"]
    pieces = demo_segments(row["demo"]) if row.get("demo") else [(row["answer"], True)]
    answer, trained = [], []
    for text, by_model in pieces:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        answer += ids
        trained += [by_model] * len(ids)
    return prompt, answer + [tokenizer.eos_token_id], trained + [True]


def _warm_start(model, tokenizer, rows: list[dict], settings: TinyLlamaSettings, progress, task: str) -> float:
    """Supervised steps on prompt+answer+eos (or prompt+demo+eos), loss on the answer tokens the model writes;
    warmup then cosine to 10%."""
    import torch

    examples = [encode_example(tokenizer, r) for r in rows]
    random.Random(0).shuffle(examples)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, betas=(0.9, 0.98), weight_decay=0.0)
    model.train()
    started, loss = time.perf_counter(), float("nan")
    for step in range(settings.sft_steps):
        batch = examples[step * settings.batch_size : (step + 1) * settings.batch_size]
        ids, mask, labels = _collate(batch, tokenizer.pad_token_id)
        decay = 0.1 + 0.45 * (1 + math.cos(math.pi * step / max(1, settings.sft_steps)))
        for group in optimizer.param_groups:
            group["lr"] = settings.lr * min(1.0, (step + 1) / settings.warmup_steps) * decay
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = out.loss.item()
        if (step + 1) % 50 == 0 or step + 1 == settings.sft_steps:
            progress(f"tiny-llama[{task}]: step {step + 1}/{settings.sft_steps} loss {loss:.3f} ({time.perf_counter() - started:.0f} s)")
    model.eval()
    return loss


def _collate(batch: list[tuple[list[int], list[int], list[bool]]], pad_id: int):
    """Right-padded input ids, attention mask and labels (-100 outside the answer and on untrained tokens)."""
    import torch

    width = max(len(p) + len(a) for p, a, _ in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    for i, (prompt, answer, trained) in enumerate(batch):
        n = len(prompt) + len(answer)
        ids[i, :n] = torch.tensor(prompt + answer)
        mask[i, :n] = 1
        labels[i, len(prompt) : n] = torch.tensor([t if keep else -100 for t, keep in zip(answer, trained)])
    return ids, mask, labels


def accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int, *, temperature: float, seed: int = 0) -> float:
    """Exact-match rate of completions sampled at `temperature` (0 = greedy), batched with left padding.

    Rows with a `demo` (builtin:calc) are scored as episodes with the calculator: the first turn stops at
    `</calc>`, the calculator's observation is appended, a second turn of up to max_new_tokens follows, and the
    whole text is scored with the `tagged_number` reward. One tool call is executed; later ones are not."""
    from rlflow.stages.rewards import exact_match, tagged_number

    prompts = [encode_row(tokenizer, r)[0] for r in rows]
    first = _generate(model, tokenizer, prompts, max_new_tokens, temperature, seed)
    texts = tokenizer.batch_decode(first, skip_special_tokens=True)
    episodes = [i for i, r in enumerate(rows) if r.get("demo")]
    if episodes:
        called = _second_turns(model, tokenizer, [prompts[i] for i in episodes], [first[i] for i in episodes],
                               max_new_tokens, temperature, seed)
        for i, text in zip(episodes, called):
            texts[i] = text
    return sum((tagged_number if r.get("demo") else exact_match)(t, r["answer"]) for t, r in zip(texts, rows)) / len(rows)


TOOL_STOP = "</calc>"  # the calculator's stop string, for the accuracy of demo rows


def _generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int):
    """The generated ids of each prompt (left-padded batch), eos and padding included."""
    import torch

    width = max(map(len, prompts))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {"do_sample": False}
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(seed)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **sampling)
    return out[:, width:].tolist()


def _second_turns(model, tokenizer, prompts, firsts, max_new_tokens: int, temperature: float, seed: int) -> list[str]:
    """Episode texts: each first turn cut after its first `</calc>`, the calculator's observation, and a second turn
    (a first turn without a call is the whole episode)."""
    from concurrent.futures import ThreadPoolExecutor

    from rlflow.stages.env_calculator import Calculator

    special = {tokenizer.pad_token_id, tokenizer.eos_token_id}
    actions: list[list[int] | None] = []
    for ids in firsts:
        ids = [t for t in ids if t not in special]
        cut = next((k for k in range(1, len(ids) + 1) if TOOL_STOP in tokenizer.decode(ids[:k])), None)
        actions.append(ids[:cut] if cut else None)
    calls = [i for i, a in enumerate(actions) if a is not None]
    texts = tokenizer.batch_decode(firsts, skip_special_tokens=True)
    if not calls:
        return texts
    with ThreadPoolExecutor(4) as pool:  # each call is a sandboxed subprocess (about 70 ms)
        observations = list(pool.map(lambda i: Calculator().step(tokenizer.decode(actions[i])).observation, calls))
    resumed = [prompts[i] + actions[i] + tokenizer(o, add_special_tokens=False)["input_ids"] for i, o in zip(calls, observations)]
    seconds = tokenizer.batch_decode(_generate(model, tokenizer, resumed, max_new_tokens, temperature, seed + 1),
                                     skip_special_tokens=True)
    for i, observation, second in zip(calls, observations, seconds):
        texts[i] = tokenizer.decode(actions[i]) + observation + second
    return texts
