"""Attention helpers both backends share (the from-scratch GPT and the transformers adapter).

- ``positions_from_mask``: positions counted over real tokens, so left and right padding give a
  sequence the same positions (and logits).
- ``grouped_prefix_attention``: one decode step of G rows per prompt that read the prompt's keys
  once per group instead of G copies.
- ``whole_cache_key_bias``: when a decode step should attend over its whole preallocated response
  cache (masked) rather than the slice of the positions written so far.
"""

from __future__ import annotations

import torch


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of each token counted over real tokens only; pads get 0. (B, T) -> (B, T) long."""
    mask = attention_mask.long()
    return ((mask.cumsum(-1) - 1) * mask).clamp(min=0)


def grouped_prefix_attention(q, kp_t, vp, k, v, prefix_bias, key_mask=None, scale=None, key_bias=None) -> torch.Tensor:
    """One decode step of N = B*G rows whose G consecutive rows continue the same prompt: attention
    over the B prompts' keys, stored and read once per group (one (G, Tp) matmul per prompt, not G
    (1, Tp) ones), plus each row's own keys, one softmax over both. Both decoders use it: the GPT's
    :class:`~pipeline.model.gpt.KVCache` and the transformers attention function of ``pipeline.model.hf``.

    q: (N, H, 1, D); kp_t: (B, Hkv, D, Tp) the prompts' keys, transposed (made contiguous once per
    rollout: the prompt part is then one batched matmul with the scale and the pad bias fused in);
    vp: (B, Hkv, Tp, D); k, v: (N, Hkv, t, D) each row's own positions so far; H = Hkv * r
    (grouped-query attention: key head i serves query heads i*r .. i*r+r-1); prefix_bias: additive
    (0 or -inf) bias of the prompt keys in q's dtype, (B, Hkv, 1, Tp) (made once per rollout; a
    (B, 1, 1, Tp) bias also works, at the cost of a copy per call); key_mask: (N, t) bool, True =
    attend, or None when every row key is real (a decode cache); key_bias: (t,) additive bias (0 or
    -inf) of the row keys shared by every row, which lets `k` and `v` be a whole preallocated cache
    (contiguous, unlike a slice of its written positions) with the unwritten positions masked: one
    batched matmul with the scale and the bias fused in. Returns (N, H, 1, D).
    """
    N, H, T, D = q.shape
    if T != 1:
        raise ValueError("a shared-prefix cache decodes one token per step")
    B, Hkv, _, Tp = kp_t.shape
    G, r, t = N // B, H // Hkv, k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    q = q.reshape(N, Hkv, r, D)
    qg = q.view(B, G, Hkv, r, D).transpose(1, 2).reshape(B * Hkv, G * r, D)  # a group's queries together
    bias = prefix_bias.expand(B, Hkv, 1, Tp).reshape(B * Hkv, 1, Tp)
    sp = torch.baddbmm(bias, qg, kp_t.reshape(B * Hkv, D, Tp), alpha=scale)  # (B*Hkv, G*r, Tp)
    sp = sp.view(B, Hkv, G, r, Tp).transpose(1, 2).reshape(N, Hkv, r, Tp)
    if key_bias is None:
        sr = (q @ k.transpose(-1, -2)) * scale  # (N, Hkv, r, t)
    else:
        sr = torch.baddbmm(key_bias.expand(N * Hkv, r, t), q.reshape(N * Hkv, r, D),
                           k.reshape(N * Hkv, t, D).transpose(1, 2), alpha=scale).view(N, Hkv, r, t)
    if key_mask is not None:
        sr = sr.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    att = torch.cat([sp, sr], dim=-1)  # (N, Hkv, r, Tp + t)
    att = att.softmax(-1) if att.dtype == torch.float32 else att.float().softmax(-1).to(v.dtype)
    ap, ar = att.split([Tp, t], dim=-1)
    yp = ap.reshape(B, G, Hkv, r, Tp).transpose(1, 2).reshape(B, Hkv, G * r, Tp) @ vp  # (B, Hkv, G*r, D)
    y = yp.view(B, Hkv, G, r, D).transpose(1, 2).reshape(N, Hkv, r, D) + ar @ v  # (N, Hkv, r, D)
    return y.reshape(N, H, 1, D)


def whole_cache_key_bias(k: torch.Tensor, t: int) -> torch.Tensor | None:
    """For a decode step at response position `t` over the preallocated response keys `k`
    (N, Hkv, max_new, D): the (max_new,) additive bias (0 up to `t`, -inf after) that lets the step
    attend over the whole cache, or None: attend over the slice of the positions written so far.

    Only for a reduced-precision cache on CPU, once past a third of it: there oneDNN's batched
    matmuls copy a strided operand (the slice) before multiplying, so a step over the slice costs
    more as the response grows, while the whole cache is contiguous and costs the same at every
    step (``bench/rollout.py --bf16``; 1.4x on the step's attention at 64 new tokens). The masked
    positions get exactly zero weight. fp32 keeps the slice: there MKL reads it in place, and the
    default run's numbers stay the same."""
    M = k.shape[2]
    if k.dtype == torch.float32 or k.device.type != "cpu" or 3 * (t + 1) <= M:
        return None
    return torch.zeros(M, dtype=k.dtype, device=k.device).masked_fill_(torch.arange(M, device=k.device) > t,
                                                                       float("-inf"))


def whole_groups(rows: torch.Tensor, group: int) -> torch.Tensor | None:
    """The groups (row // `group`) that `rows` (ascending row indices) cover, if `rows` is exactly
    those groups' rows, each group whole; else None."""
    if rows.numel() == 0 or rows.numel() % group:
        return None
    groups = rows[::group] // group
    whole = (groups[:, None] * group + torch.arange(group, device=rows.device)).reshape(-1)
    return groups if torch.equal(whole, rows) else None
