"""Per-token log-probs and entropy of a causal LM without the whole micro-batch's full-vocabulary logits.

The model runs to its last hidden states; the lm_head then runs on one chunk of positions at a time. When the
log-probs need a gradient each chunk runs under torch.utils.checkpoint, so backward recomputes the chunk's logits
instead of keeping them; the entropy comes from the same logits, under no_grad unless asked for "grad" (a bonus). Peak logits memory is
one chunk, where the plain forward keeps [B, T, V] in the model dtype, its fp32 copy and log_softmax's output.

It runs inside the model's forward (a forward hook replaces the output), so a DeepSpeed engine sees the log-probs as
its forward's output: its backward hooks sit on the tensors the loss is made of, and ZeRO-3 gathers the lm_head
weight around each chunk, recomputed ones included, as around any module call. Those gathers are collectives, so
under ZeRO-3 every rank must run as many chunks as its peers: the count is given per forward (`chunks`), not derived
from the rank's own token count.
"""

from __future__ import annotations

import contextlib
import inspect
import math

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from rlflow.stages import grpo

#: logits per chunk: 2**26 fp32 values are 256 MiB (a 150k vocabulary: ~440 positions a chunk)
LOGITS_PER_CHUNK = 2**26


def _chunk(head: nn.Module, hidden: Tensor, targets: Tensor, temperature: float, entropy: bool | str):
    logits = head(hidden).float() / temperature
    logprobs = grpo.token_logprobs(logits, targets)
    if not entropy:
        return logprobs, None
    with torch.no_grad() if entropy != "grad" else contextlib.nullcontext():  # "grad": for an entropy bonus
        return logprobs, grpo.entropy_from_logits(logits)


def chunked_logprobs(
    head: nn.Module, hidden: Tensor, targets: Tensor, temperature: float, chunks: int, entropy: bool | str = False,
    positions: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """[B, T, H] hidden states and [B, T] targets -> ([B, T] log-probs at `temperature`, [B, T] entropy or None),
    equal to grpo.token_logprobs / entropy_from_logits of head(hidden).float() / temperature.

    `positions` ([B, T] bool, optional): the only positions whose values are wanted (the trained completion tokens);
    the head runs on them alone and every other position reads 0. A prompt is most of a row in short-answer tasks
    (a chat template and a question before a 5-token answer), and the head is the largest matrix of a small model
    with a large vocabulary (SmolLM2-135M: 49,152 x 576, a fifth of its parameters), run twice under checkpoint.
    The selected positions go through the head in exactly `chunks` runs of near-equal size (empty ones when there
    are fewer positions than chunks: under ZeRO-3 each run gathers the head, and every rank runs as many)."""
    flat, goal = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    index = None
    if positions is not None:
        index = positions.reshape(-1).nonzero().squeeze(1)
        flat, goal = flat.index_select(0, index), goal.index_select(0, index)
    keep = torch.is_grad_enabled()
    bounds = [k * flat.shape[0] // chunks for k in range(chunks + 1)]
    parts = []
    for lo, hi in zip(bounds, bounds[1:]):
        args = (head, flat[lo:hi], goal[lo:hi], temperature, entropy)
        parts.append(checkpoint(_chunk, *args, use_reentrant=False) if keep else _chunk(*args))

    def spread(values: Tensor) -> Tensor:  # back to [B, T], 0 off `positions`
        if index is not None:
            values = values.new_zeros(targets.numel()).index_copy(0, index, values)
        return values.view_as(targets)

    logprobs = spread(torch.cat([lp for lp, _ in parts]))
    return logprobs, spread(torch.cat([e for _, e in parts])) if entropy else None


def supports(model: nn.Module) -> bool:
    """Whether the model's forward can skip its full logits (logits_to_keep) and has a base model and an output
    embedding to run apart."""
    return ("logits_to_keep" in inspect.signature(model.forward).parameters
            and model.get_output_embeddings() is not None and model.base_model is not model)


class TokenLogprobs:
    """Makes `model`'s forward return (log-probs, entropy or None) of given targets while `request` is open.

    Call the model (or the engine around it) with `FORWARD_KWARGS` inside the block: it then computes the logits of
    its last position only, and the base model's last hidden states (after the final norm) go to `chunked_logprobs`.
    Under DeepSpeed attach after deepspeed.initialize: the hidden states are taken after the engine's hooks on the
    base model have run, and the model's output is replaced before the engine's hooks on the model see it."""

    FORWARD_KWARGS = {"logits_to_keep": 1, "use_cache": False}

    def __init__(self, model: nn.Module, chunk_tokens: int | None = None):
        self.head = model.get_output_embeddings()
        self.chunk_tokens = chunk_tokens or max(1, LOGITS_PER_CHUNK // model.config.vocab_size)
        self._request: tuple[Tensor, float, bool | str, int] | None = None
        self._hidden: Tensor | None = None
        model.base_model.register_forward_hook(self._keep_hidden)
        model.register_forward_hook(self._replace_output, prepend=True)

    def chunks_for(self, positions: int) -> int:
        """Chunks of at most chunk_tokens positions for a forward of `positions` positions (B * (L-1), or the
        selected ones)."""
        return max(1, math.ceil(positions / self.chunk_tokens))

    @contextlib.contextmanager
    def request(self, targets: Tensor, temperature: float, entropy: bool | str, chunks: int | None = None,
                positions: Tensor | None = None):
        """targets: [B, L-1] = input_ids[:, 1:] of the forward run inside the block; chunks: the lm_head runs for
        this forward (None: chunks_for its own positions; under ZeRO-3 give every rank the same count); positions:
        [B, L-1] bool, the only positions computed (chunked_logprobs), None: all."""
        wanted = targets.numel() if positions is None else int(positions.sum())
        self._request = (targets, temperature, entropy, chunks or self.chunks_for(wanted), positions)
        try:
            yield
        finally:
            self._request, self._hidden = None, None

    def _keep_hidden(self, module, args, output):
        if self._request is not None:
            self._hidden = output.last_hidden_state

    def _replace_output(self, module, args, output):
        if self._request is None:
            return None
        targets, temperature, entropy, chunks, positions = self._request
        hidden, self._hidden = self._hidden[:, :-1], None
        return chunked_logprobs(self.head, hidden, targets, temperature, chunks, entropy, positions)
