r"""GRPO math: group-relative advantages, the k3 KL estimator and the clipped surrogate loss.

The defaults reproduce the reference chapter (DeepSeekMath GRPO as taught in "从零训练大模型 (十六)"):

    A_i     = (r_i - mean(r_group)) / (std(r_group) + 1e-4)          torch's unbiased std
    rho_t   = exp(logp_new - logp_old)
    L_t     = min(rho_t A_i, clip(rho_t, 1 - eps, 1 + eps) A_i) - beta * k3_t
    k3_t    = exp(d) - d - 1,  d = logp_ref - logp_new                (Schulman's k3, >= 0)
    loss    = - sum_t m_t L_t / sum_t m_t                             token-mean over the batch

Why a zero-variance group teaches nothing: if every completion of a prompt earns the same reward,
every A_i is 0, so rho_t * A_i is 0 and the group contributes no policy gradient (only the KL term
acts). Hence the arithmetic curriculum, and DAPO's dynamic sampling that drops such groups.

Variants users ask for, each off by default:

- ``adv_norm="none"`` (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training"):
  A_i = r_i - mean(r_group); dividing by the group std up-weights too-easy/too-hard prompts.
- ``adv_norm="batch"``: A_i = (r_i - mean(r_group)) / (std(r_batch) + eps), the batch-level
  scaling of several open-source recipes (e.g. "REINFORCE++"-style baselines).
- ``clip_high`` (DAPO clip-higher, Yu et al. 2025): clip(rho, 1 - eps_low, 1 + eps_high) with
  eps_high > eps_low (DAPO uses 0.2 / 0.28) so low-probability tokens can rise; fights entropy collapse.
- ``loss_agg``:
    * ``token-mean`` (the reference chapter, DAPO):        sum_{i,t} m L / sum_{i,t} m
    * ``seq-mean-token-mean`` (DeepSeekMath paper, eq. 3): mean_i [ sum_t m L / sum_t m ]
    * ``seq-mean-token-sum-norm`` (Dr. GRPO): sum_{i,t} m L / (N * max_len), a constant normaliser
      (``max_len`` = the generation budget), which removes the length bias of per-sequence means.
- ``importance="sequence"`` (GSPO, Zheng et al. 2025): s_i = exp(mean_t (logp_new - logp_old)),
  one clipped ratio per sequence broadcast to its tokens (GSPO clips at ~3e-4/4e-4 in the paper;
  pick `clip` accordingly). GSPO aggregates per sequence: use ``loss_agg="seq-mean-token-mean"``.
"""

from __future__ import annotations

from typing import Literal

import torch

from pipeline.rl.masked import masked_mean, masked_sum

AdvNorm = Literal["group", "batch", "none"]
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
Importance = Literal["token", "sequence"]


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4,
                     norm: AdvNorm = "group") -> torch.Tensor:
    """Group-relative advantages for group-contiguous rewards (N,) -> (N,)."""
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    r = rewards.float().view(-1, group_size)                    # (P, G): one row per prompt
    centered = r - r.mean(dim=1, keepdim=True)                   # baseline = the group's mean reward
    if norm == "group":
        adv = centered / (r.std(dim=1, keepdim=True) + eps)      # the reference chapter: per-group std
    elif norm == "batch":
        adv = centered / (r.std() + eps)
    elif norm == "none":
        adv = centered                                           # Dr. GRPO
    else:
        raise ValueError(f"norm={norm!r}; allowed: group, batch, none")
    return adv.reshape(-1)


def informative_groups(rewards: torch.Tensor, group_size: int, tol: float = 1e-6) -> torch.Tensor:
    """(groups,) bool: which groups' rewards are not all equal (the groups that carry a gradient);
    `rewards` group-contiguous, flat or (groups, G)."""
    return rewards.float().view(-1, group_size).std(dim=1) > tol


def informative_fraction(rewards: torch.Tensor, group_size: int, tol: float = 1e-6) -> float:
    """Fraction of groups whose rewards are not all equal (the groups that carry a gradient)."""
    return informative_groups(rewards, group_size, tol).float().mean().item()


def k3_kl(new_logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || ref): exp(d) - d - 1 with d = ref - new."""
    diff = ref_logp - new_logp
    return torch.exp(diff) - diff - 1.0


def loss_units(mask: torch.Tensor, mode: LossAgg = "token-mean") -> float:
    """What `aggregate` divides by, counted on `mask` (N, T): response tokens (token-mean), sequences
    with tokens (seq-mean-token-mean) or sequences (Dr. GRPO). A part of a batch carries its share
    units(part) / units(batch) of the batch's loss: micro-batches and DDP shards weight by it."""
    if mode == "token-mean":
        return float(mask.sum().item())
    if mode == "seq-mean-token-mean":
        return float((mask.sum(1) > 0).sum().item())
    return float(mask.shape[0])


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: LossAgg = "token-mean",
              max_len: int | None = None) -> torch.Tensor:
    """Reduce an (N, T) per-token objective to a scalar (see the module docstring)."""
    if mode == "token-mean":
        return masked_mean(per_token, mask)
    if mode == "seq-mean-token-mean":
        m = mask.to(per_token.dtype)
        lengths = m.sum(dim=1)
        per_seq = masked_sum(per_token, m, dim=1) / lengths.clamp(min=1.0)
        has_tokens = (lengths > 0).to(per_token.dtype)
        return (per_seq * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)
    if mode == "seq-mean-token-sum-norm":
        norm = max_len if max_len is not None else per_token.shape[1]
        return masked_sum(per_token, mask) / (per_token.shape[0] * norm)
    raise ValueError(f"loss_agg={mode!r}; allowed: token-mean, seq-mean-token-mean, seq-mean-token-sum-norm")


def grpo_loss(
    new_logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    resp_mask: torch.Tensor,
    clip: float = 0.2,
    kl_coef: float = 0.04,
    clip_high: float | None = None,
    loss_agg: LossAgg = "token-mean",
    importance: Importance = "token",
    max_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss over (N, T) per-token log-probs; returns (loss, stats as 0-d tensors).
    `ref_logp` may be None iff kl_coef == 0. `clipfrac` is the fraction of response tokens whose
    ratio lies outside the clip range [1 - clip, 1 + (clip_high or clip)], whichever side."""
    # rewards are scored on the host: advantages (and the mask) join the log-probs' device here
    mask = resp_mask.to(device=new_logp.device, dtype=new_logp.dtype)
    eps_low, eps_high = clip, (clip_high or clip)
    adv = advantages.to(device=new_logp.device, dtype=new_logp.dtype)[:, None]  # (N, 1): one per sequence

    # --- importance ratio -------------------------------------------------------------------
    log_ratio = new_logp - old_logp                              # (N, T)
    if importance == "sequence":                                 # GSPO: length-normalised sequence ratio
        seq_log_ratio = masked_mean(log_ratio, mask, dim=1)      # (N,)
        log_ratio = seq_log_ratio[:, None].expand_as(new_logp)
    elif importance != "token":
        raise ValueError(f"importance={importance!r}; allowed: token, sequence")
    ratio = torch.exp(log_ratio)

    # --- clipped surrogate --------------------------------------------------------------------
    surr1 = ratio * adv
    surr2 = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    surrogate = torch.min(surr1, surr2)

    # --- KL to the frozen reference -----------------------------------------------------------
    if kl_coef > 0:
        if ref_logp is None:
            raise ValueError("ref_logp is required when kl_coef > 0")
        kl = k3_kl(new_logp, ref_logp)
    else:
        kl = k3_kl(new_logp, ref_logp) if ref_logp is not None else torch.zeros_like(new_logp)

    per_token = surrogate - kl_coef * kl
    loss = -aggregate(per_token, mask, loss_agg, max_len)

    # --- statistics: 0-d tensors, no host sync here (the caller converts them when it logs) ----
    with torch.no_grad():
        r = ratio.detach()
        below, above = (1.0 - r) > eps_low, (r - 1.0) > eps_high       # outside [1 - eps_low, 1 + eps_high]
        stats = {
            "kl": masked_mean(kl.detach(), mask),
            "clipfrac": masked_mean((below | above).to(mask.dtype), mask),
            "clipfrac_low": masked_mean((below & (adv < 0)).to(mask.dtype), mask),
            "clipfrac_high": masked_mean((above & (adv > 0)).to(mask.dtype), mask),
            "ratio_mean": masked_mean(r, mask),
        }
    return loss, stats
