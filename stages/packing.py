"""Micro-batches as the trainer's forward passes see them: right-padded rows, or sequences packed end to end.

Packed: a micro-batch's trajectories concatenated into one row, position ids restarting at 0 per sequence and no
attention mask, so no compute goes to padding. transformers 5 reads the restarts as sequence boundaries
(masking_utils.find_packed_sequence_indices) and builds a block-diagonal causal mask (sdpa, eager; flash-attention
takes them as varlen boundaries), but only when the forward gets no attention mask and no KV cache (use_cache=False):
with a cache it silently lets sequences attend to each other. `probe` catches that, or a model that ignores
position ids, on the model being trained.

Every per-token tensor is aligned to the targets, input_ids[:, 1:]: position k holds what the logits at k predict.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from rlflow.stages.batch_shards import balance
from rlflow.stages.trajectory import Trajectory


@dataclass
class MicroBatch:
    """One forward/backward pass's rows; the trainer adds old_logprobs / ref_logprobs before the loss."""

    input_ids: Tensor  # [B, L]
    targets: Tensor  # [B, L-1] = input_ids[:, 1:]
    mask: Tensor  # [B, L-1] float, 1 where the target is a trained completion token (not padding, prompt, environment)
    behaviour_logprobs: Tensor  # [B, L-1], 0 off the completions
    advantages: Tensor  # padded: [B], one per row; packed: [B, L-1], each sequence's on its own positions
    attention_mask: Tensor | None = None  # [B, L], padded rows only
    position_ids: Tensor | None = None  # [B, L], packed rows only: 0, 1, ... per sequence
    segments: Tensor | None = None  # [B, L-1], packed rows only: which sequence each target position belongs to
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None

    def to(self, device) -> MicroBatch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return MicroBatch(**{k: v.to(device) if isinstance(v, Tensor) else v for k, v in moved.items()})


def _completion_values(t: Trajectory, trained: bool) -> tuple[Tensor, Tensor]:
    """(trained mask, behaviour log-probs) of t's completion tokens; an untrained row (padding) is all masked."""
    mask = torch.tensor(t.trained_mask(), dtype=torch.float32) if trained else torch.zeros(len(t.completion_ids))
    return mask, torch.tensor(t.behaviour_logprobs, dtype=torch.float32)


def padded(
    rows: Sequence[Trajectory], advantages: Sequence[float], pad_token_id: int, trained: bool = True
) -> MicroBatch:
    """Rows right-padded to the longest; `trained=False` masks every token (a pass a rank runs for its peers)."""
    length = max(len(t.prompt_ids) + len(t.completion_ids) for t in rows)
    ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(rows), length), dtype=torch.long)
    mask = torch.zeros((len(rows), length - 1))
    behaviour = torch.zeros((len(rows), length - 1))
    for r, t in enumerate(rows):
        p, c = len(t.prompt_ids), len(t.completion_ids)
        ids[r, : p + c] = torch.tensor(list(t.prompt_ids) + list(t.completion_ids), dtype=torch.long)
        attn[r, : p + c] = 1
        # completion token j sits at position p + j and is predicted by the logits at p + j - 1;
        # environment segments of a multi-turn episode (loss_mask 0) are context, not trained
        mask[r, p - 1 : p + c - 1], behaviour[r, p - 1 : p + c - 1] = _completion_values(t, trained)
    adv = torch.tensor(list(advantages), dtype=torch.float32) if trained else torch.zeros(len(rows))
    return MicroBatch(input_ids=ids, targets=ids[:, 1:], mask=mask, behaviour_logprobs=behaviour, advantages=adv,
                      attention_mask=attn)


def packed(rows: Sequence[Trajectory], advantages: Sequence[float], trained: bool = True) -> MicroBatch:
    """The rows concatenated into one row of sum(prompt + completion) tokens, position ids restarting per row.

    The target after a sequence's last token is the next sequence's first: it is masked, like the prompts."""
    ids, positions, segments = [], [], []
    for k, t in enumerate(rows):
        n = len(t.prompt_ids) + len(t.completion_ids)
        ids += list(t.prompt_ids) + list(t.completion_ids)
        positions.append(torch.arange(n))
        segments.append(torch.full((n,), k, dtype=torch.long))
    total = len(ids)
    mask, behaviour, adv = torch.zeros(total - 1), torch.zeros(total - 1), torch.zeros(total - 1)
    start = 0
    for t, a in zip(rows, advantages):
        p, c = len(t.prompt_ids), len(t.completion_ids)
        span = slice(start + p - 1, start + p + c - 1)
        mask[span], behaviour[span] = _completion_values(t, trained)
        adv[start : start + p + c] = float(a) if trained else 0.0  # the last sequence's slice ends at total - 1
        start += p + c
    ids_t = torch.tensor(ids, dtype=torch.long)[None]
    return MicroBatch(input_ids=ids_t, targets=ids_t[:, 1:], mask=mask[None], behaviour_logprobs=behaviour[None],
                      advantages=adv[None], position_ids=torch.cat(positions)[None],
                      segments=torch.cat(segments)[None, : total - 1])


def split_by_rows(lengths: Sequence[int], count: int) -> list[list[int]]:
    """Row indices in `count` parts for padded micro-batches: length-sorted runs of near-equal row counts (less
    padding), then empty parts when there are fewer rows than parts."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    real = min(count, len(order))
    return [order[k * len(order) // real : (k + 1) * len(order) // real] for k in range(real)] + [[]] * (count - real)


#: the share of a packed row's compute its attention may add before the row is cut (see row_token_bound)
ATTENTION_SHARE = 0.1
#: a packed row is never cut below this many tokens: below it a pass's fixed cost outweighs attention's
MIN_ROW_TOKENS = 512


def row_token_bound(config, attention: str | None) -> int | None:
    """Tokens of a packed row past which its attention costs more than ATTENTION_SHARE of its dense layers (None: no
    bound, flash-attention's varlen kernels attend within each sequence).

    sdpa and eager attend over the whole row under a block-diagonal mask: a row of T tokens costs 4·d·T multiply-adds
    of attention per token and layer, forward (12·d·T with backward), where the layer's projections and MLP cost
    6·p per token (p: its parameters) whatever T is. One row of a whole batch makes attention quadratic in the
    batch: SmolLM2-135M (d 576, p 3.5M), 32 chat-form sums packed in one row of ~1,900 tokens, trained in 9.6 s a
    step here against 7.5 s padded and 8.0 s in rows of 300-600 tokens (2 threads, benchmarks/results/vs_trl_smollm2.md).
    T <= share·p / (2·d): 307 for SmolLM2-135M, raised to MIN_ROW_TOKENS."""
    if attention and attention.startswith("flash_attention"):
        return None
    d, heads = config.hidden_size, config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    ffn = getattr(config, "intermediate_size", None) or 4 * d
    per_layer = 2 * d * d + 2 * d * (d * kv // heads) + 3 * d * ffn  # q, o; k, v; gate, up, down (per layer, as attention)
    return max(MIN_ROW_TOKENS, int(ATTENTION_SHARE * per_layer / (2 * d)))


def split_by_tokens(costs: Sequence[int], count: int) -> list[list[int]]:
    """Row indices in `count` parts of near-equal tokens for packed micro-batches (empty parts when rows run out)."""
    return balance(list(costs), count)


def probe(logprobs_of: Callable[[Tensor, Tensor | None], Tensor], vocab_size: int) -> dict[str, float]:
    """How far packing moves a model's log-probs. `logprobs_of(input_ids [1, L], position_ids [1, L] or None)` returns
    the [1, L-1] log-probs of input_ids[:, 1:] as the trainer computes them.

    One sequence B packed behind another: `crossed`, the largest change of B's log-probs when the sequence in front
    changes (0 unless attention crosses the boundary); `moved`, the mean |difference| between B packed and B alone
    (rounding only, unless positions fail to restart)."""
    a, a_other = torch.arange(3, 9) % vocab_size, torch.arange(11, 17) % vocab_size
    b = torch.tensor([5, 2, 9, 4, 7, 1, 8]) % vocab_size
    positions = torch.cat([torch.arange(len(a)), torch.arange(len(b))])[None]
    behind_a = logprobs_of(torch.cat([a, b])[None], positions)[0, len(a) :]
    behind_other = logprobs_of(torch.cat([a_other, b])[None], positions)[0, len(a) :]
    alone = logprobs_of(b[None], None)[0]
    return {"crossed": (behind_a - behind_other).abs().max().item(), "moved": (behind_a - alone).abs().mean().item()}


def problem(deviations: dict[str, float], tolerance: float) -> str | None:
    """What `probe`'s deviations say is wrong with packing for the model, or None."""
    if deviations["crossed"] > tolerance:
        return (f"a packed sequence attends to the one before it (its log-probs moved by {deviations['crossed']:.3g} "
                "when that one changed): the model's forward does not turn restarting position ids into a "
                "block-diagonal mask")
    if deviations["moved"] > tolerance:
        return (f"a packed sequence's log-probs differ from the same sequence alone by {deviations['moved']:.3g} on "
                "average: the model does not restart positions from position_ids")
    return None
