"""On-policy distillation (train.distill): a frozen teacher's log-probs of the student's own sampled tokens as a
per-token signal, alone or beside the reward.

The student samples; the teacher scores each sampled token; the per-token reverse KL, estimated on the student's
samples, is k_t = log pi_student(y_t) - log pi_teacher(y_t) (Agarwal et al., "On-Policy Distillation of Language
Models: Learning from Self-Generated Mistakes" (GKD), arXiv:2306.13649 §3, with its divergence set to the reverse
KL; Gu et al., MiniLLM, arXiv:2306.08543 §2). Minimising it with the policy gradient gives each token the advantage
-k_t: the RL loss is unchanged and the distillation is only a different advantage, as Thinking Machines' "On-Policy
Distillation" (2025) and prime-rl / verl / slime run it. rlflow takes pi_student at the sampler's log-probs (the
behaviour policy, what the rollout engine recorded), so a stale sample is corrected by the same off-policy weight
as any other. The advantage of a token is

    A_t = reward_weight * A_seq + coef * (log pi_teacher(y_t) - log pi_behaviour(y_t))

with A_seq the algorithm's advantage from the rewards (sequence- or token-level). reward_weight 0 trains on the
teacher alone; the reward stage then still scores every sample, which is how the run measures the student.
"""

from __future__ import annotations

import torch
from torch import Tensor


def token_advantages(advantages: Tensor, teacher_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, *,
                     coef: float, reward_weight: float) -> Tensor:
    """[B, T] advantages: reward_weight x the algorithm's ([B] per row, or [B, T]) + coef x (teacher - behaviour)
    log-probs of each sampled token; 0 off the mask."""
    seq = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    gap = (teacher_logprobs.float() - behaviour_logprobs.float()) * mask
    return (reward_weight * seq.float() + coef * gap) * mask


def reverse_kl(teacher_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor) -> tuple[float, float]:
    """(sum over the mask of log pi_behaviour - log pi_teacher, tokens): the reverse KL's estimate on the samples,
    to be averaged over the batch by the caller."""
    with torch.no_grad():
        k = (behaviour_logprobs.float() - teacher_logprobs.float()) * mask
        return float(k.sum()), float(mask.sum())
