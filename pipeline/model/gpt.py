"""A from-scratch decoder-only GPT, small enough to read in one sitting (after nanoGPT).

Architecture (Llama-like, so a rope model exports 1:1 to ``LlamaForCausalLM``):
pre-norm blocks ``x + attn(rmsnorm(x))`` and ``x + mlp(rmsnorm(x))``; multi-head causal attention
through ``F.scaled_dot_product_attention``; SwiGLU MLP with hidden width ``4 * n_embd``; rotary
(``positions="rope"``, the rotate-half convention of HF Llama, theta 10,000) or learned absolute
positions; no biases; the output head is tied to the token embedding.

Padding: every forward takes an ``attention_mask`` (1 = token, 0 = pad). Positions come from the
mask (``cumsum - 1``), so left and right padding give a sequence the same positions and logits.
Pad queries attend to themselves only, which keeps them finite; their outputs are ignored.

Incremental decoding: a :class:`KVCache` preallocates keys/values for ``max_len`` positions; a
forward with ``cache=`` writes its keys/values at ``cache.length`` and attends over everything
written so far, so a new token costs one position, not the whole prefix. For G samples per
prompt the G rows share one copy of the prompt's keys (:func:`grouped_prefix_attention`). The GRPO
log-prob passes do the same with gradients (:func:`shared_prompt_logits`, :class:`PromptKV`).

The reference chapter's size (24 layers, 1024 wide, 16 heads, context 1024, vocab 2048) is ~405.8M parameters
with learned positions and ~404.8M with rope: 16 * n_embd^2 per block (4 attention + 12 SwiGLU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline.core.config import ModelConfig
from pipeline.model import fast
from pipeline.model.attention import grouped_prefix_attention, positions_from_mask, whole_groups
from pipeline.model.fast import fused_decode


SHAPE_FIELDS = ("n_layer", "n_head", "n_embd", "block_size", "positions", "dropout")


@dataclass
class GPTConfig:
    """The GPT's shape. The fields in `SHAPE_FIELDS` are :class:`pipeline.core.config.ModelConfig`'s of the
    same names (documented there, with its defaults); the rest is fixed by the tokenizer and the
    architecture."""

    vocab_size: int = 2048
    """Tokens in the vocabulary (the tokenizer's `vocab_size`)."""
    n_layer: int = ModelConfig.n_layer
    n_head: int = ModelConfig.n_head
    n_embd: int = ModelConfig.n_embd
    block_size: int = ModelConfig.block_size
    positions: str = ModelConfig.positions
    dropout: float = ModelConfig.dropout
    rope_theta: float = 10000.0
    """Rotary base frequency."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""

    @classmethod
    def from_model_config(cls, mc: ModelConfig, vocab_size: int) -> GPTConfig:
        """The shape of `mc` with the tokenizer's vocabulary size."""
        return cls(vocab_size=vocab_size, **{name: getattr(mc, name) for name in SHAPE_FIELDS})

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


class KVCache:
    """Preallocated keys/values of every layer for `max_len` positions of a batch.

    `k`, `v`: (n_layer, B, n_head, max_len, head_dim); `key_mask`: (B, max_len) bool, True where
    a real token was written; `length`: positions written so far (the same for every row).

    Shared prefix (`prefix`, `group`): row i of this cache continues row i // group of `prefix`,
    a filled cache of the B distinct prompts. The G samples of a prompt then read its keys once
    per step instead of G copies: prompt keys are most of the attention reads in GRPO rollouts.
    """

    def __init__(self, cfg: GPTConfig, batch: int, max_len: int, device, dtype) -> None:
        shape = (cfg.n_layer, batch, cfg.n_head, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.key_mask = torch.zeros(batch, max_len, device=device, dtype=torch.bool)
        self.length = 0
        self.prefix: KVCache | None = None
        self.prefix_bias: torch.Tensor | None = None  # (B, n_head, 1, Tp) additive bias of the prefix's keys
        self.prefix_k_t: torch.Tensor | None = None  # (n_layer, B, n_head, head_dim, Tp) the prefix's keys, transposed
        self.all_real = True  # every key written so far is a real token (no pad was written)
        self.group = 1

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def repeat_interleave(self, repeats: int) -> KVCache:
        """Each row repeated `repeats` times in place of one (row i -> rows i*r .. i*r+r-1)."""
        out = KVCache.__new__(KVCache)
        out.k = self.k.repeat_interleave(repeats, dim=1)
        out.v = self.v.repeat_interleave(repeats, dim=1)
        out.key_mask = self.key_mask.repeat_interleave(repeats, dim=0)
        out.length, out.prefix, out.group = self.length, None, 1
        out.prefix_bias, out.prefix_k_t, out.all_real = None, None, self.all_real
        return out

    def share_prefix(self, cfg: GPTConfig, repeats: int, max_new: int) -> KVCache:
        """A cache of B*repeats rows for `max_new` more positions that reads this one as prefix."""
        B = self.k.shape[1]
        out = KVCache(cfg, B * repeats, max_new, self.k.device, self.k.dtype)
        out.prefix, out.group = self, repeats
        prompt = self.key_mask[:, None, None, : self.length]  # (B, 1, 1, Tp), fixed for the whole rollout
        bias = torch.zeros(prompt.shape, device=self.k.device, dtype=self.k.dtype).masked_fill(~prompt, float("-inf"))
        out.prefix_bias = bias.expand(-1, self.k.shape[2], -1, -1).contiguous()  # (B, H, 1, Tp): a view per step
        out.prefix_k_t = self.k[:, :, :, : self.length].transpose(-1, -2).contiguous()
        return out


class PromptKV:
    """Keys/values of a prompt pass kept as a list (no in-place cache writes, so autograd can
    differentiate through them): the GRPO log-prob passes over G rows per prompt.

    Pass it as ``prompt_kv=`` to a forward of the B distinct prompts (each layer's keys/values
    are recorded), set ``attending = True``, then to a forward of the N = B*group rows' next
    columns: each row attends to its prompt's keys (written from an expanded view straight into the
    row's joined keys, with no separate repeated copy; the gradient sums over the group) and causally
    to its own columns, as one full forward would.
    """

    def __init__(self, prompt_mask: torch.Tensor, group: int) -> None:
        self.prompt_mask = prompt_mask.bool()  # (B, Tp)
        self.group = group
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.attending = False

    def keys_values(self, k, v, layer: int):
        if not self.attending:
            self.kv.append((k, v))
            return k, v
        kp, vp = self.kv[layer]  # (B, H, Tp, D), read by the group's rows without a repeated copy
        return self._per_row(kp, k), self._per_row(vp, v)

    def _per_row(self, prompt: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        """(N, H, Tp + T, D): each row's prompt keys (its group's, an expanded view) then its own."""
        B, H, Tp, D = prompt.shape
        G, T = self.group, own.shape[2]
        rows = own.view(B, G, H, T, D)
        return torch.cat([prompt[:, None].expand(B, G, H, Tp, D), rows], dim=3).view(B * G, H, Tp + T, D)

    def mask(self, attention_mask: torch.Tensor | None, T: int, N: int, device) -> torch.Tensor:
        """(N, 1, T, Tp + T) bool: every real prompt key, causal own keys, each query sees itself."""
        own = torch.ones(N, T, dtype=torch.bool, device=device) if attention_mask is None else attention_mask.bool()
        q_pos = torch.arange(T, device=device)[:, None]
        k_pos = torch.arange(T, device=device)[None, :]
        resp = ((k_pos <= q_pos) & own[:, None, None, :]) | (k_pos == q_pos)  # (N, 1, T, T)
        prompt = self.prompt_mask.repeat_interleave(self.group, dim=0)[:, None, None, :]
        return torch.cat([prompt.expand(N, 1, T, prompt.shape[-1]), resp], dim=-1)


def shared_prompt_logits(model: GPT, input_ids, attention_mask, position_ids, start: int,
                         group: int) -> list[torch.Tensor]:
    """Logits at positions ``start-1 .. T-2`` of group-contiguous rows whose first `start` columns
    agree within each group: the prompt runs once per group (:class:`PromptKV`). Two pieces along
    the columns, not joined: (N, 1, V) at the prompt's last position, (N, T-1-start, V) after it
    (``pipeline.model.logprobs.gather_logprobs`` takes them as they are)."""
    T = input_ids.shape[1]
    kv = PromptKV(attention_mask[::group, :start], group)
    first = model(input_ids[::group, :start], attention_mask[::group, :start], position_ids[::group, :start],
                  last_only=True, prompt_kv=kv).repeat_interleave(group, dim=0)  # (N, 1, V)
    if T - 1 == start:
        return [first]
    kv.attending = True
    rest = model(input_ids[:, start:T - 1], attention_mask[:, start:T - 1], position_ids[:, start:T - 1],
                 prompt_kv=kv)  # (N, T-1-start, V)
    return [first, rest]


def _rope_tables(cfg: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin tables (block_size, head_dim) in HF Llama's rotate-half layout: the sin
    table's first half negated (see :func:`apply_rope`)."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
    freqs = torch.outer(torch.arange(cfg.block_size, dtype=torch.float32), inv_freq)  # (S, D/2)
    sin = freqs.sin()
    return torch.cat([freqs, freqs], dim=-1).cos(), torch.cat([-sin, sin], dim=-1)  # (S, D) each


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, T, D) by per-token angles: ``x * cos + rotate_half(x) * sin``, rotate_half(x) =
    [-x2, x1], computed as [x2, x1] times the signed sin [-sin, sin] (the same products bit for bit,
    one negation fewer each way); cos/sin_signed are (B, 1, T, D)."""
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat([x2, x1], dim=-1) * sin_signed).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)  # fused q, k, v
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.dropout = cfg.dropout

    def forward(self, x, rope, attn_mask, cache: KVCache | None, layer: int) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if isinstance(cache, PromptKV):  # GRPO log-prob passes: prompt once per group (autograd-safe)
            k, v = cache.keys_values(k, v, layer)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None,
                                               dropout_p=self.dropout if self.training else 0.0)
            return F.dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, C)), self.dropout, self.training)
        if cache is not None:
            start, end = cache.length, cache.length + T
            cache.k[layer, :, :, start:end] = k
            cache.v[layer, :, :, start:end] = v
            k, v = cache.k[layer, :, :, :end], cache.v[layer, :, :, :end]  # (B, H, S, D)
        if cache is not None and cache.prefix is not None:
            P = cache.prefix
            y = grouped_prefix_attention(q, cache.prefix_k_t[layer], P.v[layer, :, :, :P.length], k, v,
                                         cache.prefix_bias, None if cache.all_real else cache.key_mask[:, :end])
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                               is_causal=attn_mask is None and cache is None,
                                               dropout_p=self.dropout if self.training else 0.0)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return F.dropout(self.c_proj(y), self.dropout, self.training)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.hidden = 4 * cfg.n_embd
        self.c_fc = nn.Linear(cfg.n_embd, 2 * self.hidden, bias=False)  # [gate; up]
        self.c_proj = nn.Linear(self.hidden, cfg.n_embd, bias=False)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.c_fc(x).split(self.hidden, dim=-1)  # (B, T, 4C) each
        return F.dropout(self.c_proj(F.silu(gate) * up), self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, attn_mask, cache, layer) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), rope, attn_mask, cache, layer)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.positions not in ("rope", "learned"):
            raise ValueError(f"positions = {cfg.positions!r}; allowed: rope, learned")
        if cfg.n_embd % cfg.n_head or cfg.head_dim % 2:
            raise ValueError(f"n_embd = {cfg.n_embd} must split into {cfg.n_head} heads of even width")
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd) if cfg.positions == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        if cfg.positions == "rope":
            cos, sin = _rope_tables(cfg)
            self.register_buffer("rope_cos", cos, persistent=False)  # (block_size, D)
            self.register_buffer("rope_sin_signed", sin, persistent=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # scaled init of residual projections (GPT-2)
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def _attn_mask(self, attention_mask, cache: KVCache | None, T: int) -> torch.Tensor | None:
        """Boolean (B, 1, T, S) mask: causal, no pad keys, each query always sees itself."""
        if cache is None:
            if attention_mask is None:
                return None  # plain causal: SDPA's is_causal fast path
            key_mask = attention_mask.bool()  # (B, T)
            offset = 0
        else:
            key_mask = cache.key_mask[:, : cache.length + T]  # (B, S)
            if T == 1:  # one new token sees every real key written so far, itself included
                return key_mask[:, None, None, :]  # (B, 1, 1, S)
            offset = cache.length
        S = key_mask.shape[1]
        dev = key_mask.device
        q_pos = torch.arange(offset, offset + T, device=dev)[:, None]  # (T, 1)
        k_pos = torch.arange(S, device=dev)[None, :]  # (1, S)
        causal = k_pos <= q_pos  # (T, S)
        return (causal & key_mask[:, None, None, :]) | (k_pos == q_pos)  # (B, 1, T, S)

    def forward(self, idx: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: KVCache | None = None,
                last_only: bool = False, prompt_kv: PromptKV | None = None, logits_from: int = 0) -> torch.Tensor:
        """Logits (B, T, V), or (B, 1, V) with `last_only`, or (B, T - logits_from, V): the
        vocabulary projection of the columns from `logits_from` on only.

        With `cache`, `idx` holds the next T tokens of every row, appended at `cache.length`;
        `attention_mask` then covers those T tokens only (None = all real) and `position_ids`
        must be given (the cache does not know where each row's real tokens start).
        """
        B, T = idx.shape
        if cache is not None:
            if cache.length + T > cache.max_len:
                raise ValueError(f"KV cache full: {cache.length} + {T} > {cache.max_len}")
            new_mask = torch.ones_like(idx, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
            cache.key_mask[:, cache.length: cache.length + T] = new_mask
            if attention_mask is not None and cache.all_real:
                cache.all_real = bool(new_mask.all())
        if position_ids is None:
            position_ids = (positions_from_mask(attention_mask) if attention_mask is not None
                            else torch.arange(T, device=idx.device).expand(B, T))
        if not idx.is_cuda and int(position_ids.max()) >= self.config.block_size:  # CUDA would assert
            raise ValueError(f"sequence longer than block_size = {self.config.block_size}")
        x = self.wte(idx)  # (B, T, C)
        rope = None
        if self.wpe is not None:
            x = x + self.wpe(position_ids)
        else:
            rope = (self.rope_cos[position_ids][:, None], self.rope_sin_signed[position_ids][:, None])  # (B, 1, T, D)
        x = self.drop(x)
        if prompt_kv is not None and prompt_kv.attending:
            attn_mask = prompt_kv.mask(attention_mask, T, B, idx.device)
        else:
            if attention_mask is not None and cache is None and bool(attention_mask.all()):
                attention_mask = None  # no padding: use the causal fast path
            attn_mask = self._attn_mask(attention_mask, cache, T)
        layer_cache = cache if prompt_kv is None else prompt_kv
        for i, block in enumerate(self.h):
            x = block(x, rope, attn_mask, layer_cache, i)
        if cache is not None:
            cache.length += T
        if last_only:
            x = x[:, -1:]
        h = self.ln_f(x)  # (B, T, C)
        if logits_from:
            h = h[:, logits_from:]  # (B, T - logits_from, C)
        return self.lm_head(h)  # (B, T', V)

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype | None = None) -> KVCache:
        p = self.wte.weight
        return KVCache(self.config, batch, max_len, p.device, dtype or p.dtype)


def count_params(cfg: GPTConfig) -> int:
    """Parameter count of a config without allocating its weights (built on the meta device)."""
    with torch.device("meta"):
        return GPT(cfg).num_params()


class GPTDecoder:
    """KV-cached incremental decoding: one prefill of the prompts, then one token per step.

    Same interface as :class:`pipeline.model.hf.HFDecoder`, so the rollout engine is backend-free.
    """

    def __init__(self, model: GPT, max_len: int, dtype: torch.dtype | None = None) -> None:
        self.model, self.max_len, self.dtype = model, max_len, dtype
        self.cache: KVCache | None = None
        self.fused: fused_decode.FusedGPTStep | None = None  # the decode step in few, large ops

    def prefill(self, input_ids, attention_mask, position_ids, repeats: int) -> torch.Tensor:
        """Prompts (B, T) once; the `repeats` rows of a group then share that prompt's cache (read,
        not copied: see :func:`grouped_prefix_attention`); last logits (B*r, V)."""
        B, T = input_ids.shape
        if repeats == 1 or not fast.enabled():  # plain: every row gets its own copy of the prompt's keys
            cache = self.model.new_cache(B, self.max_len, self.dtype)
            logits = self.model(input_ids, attention_mask, position_ids, cache=cache, last_only=True)[:, -1]
            self.cache = cache if repeats == 1 else cache.repeat_interleave(repeats)
            return logits.repeat_interleave(repeats, dim=0)  # (N, V)
        prompts = self.model.new_cache(B, T, self.dtype)
        logits = self.model(input_ids, attention_mask, position_ids, cache=prompts, last_only=True)  # (B, 1, V)
        self.cache = prompts.share_prefix(self.model.config, repeats, self.max_len - T)
        if fused_decode.gpt_supported(self.model):
            self.fused = fused_decode.FusedGPTStep(self.model, self.cache, B * repeats)
        return logits[:, -1].repeat_interleave(repeats, dim=0)  # (N, V)

    def select(self, rows: torch.Tensor) -> bool:
        """Keep only `rows` (indices of the current rows, ascending) so later steps skip the rows
        that have stopped. With a shared prefix `rows` must be whole groups (the G rows of a prompt
        share its keys): the prompts of the groups kept stay too. False: nothing changed."""
        c = self.cache
        if c is None:
            return False
        if c.prefix is not None:
            groups = whole_groups(rows, c.group)
            if groups is None:
                return False
            P = c.prefix
            P.k, P.v, P.key_mask = P.k[:, groups], P.v[:, groups], P.key_mask[groups]
            c.prefix_k_t, c.prefix_bias = c.prefix_k_t[:, groups], c.prefix_bias[groups]
        c.k, c.v, c.key_mask = c.k[:, rows], c.v[:, rows], c.key_mask[rows]
        if self.fused is not None:
            self.fused.rebind_gpt(c)
        return True

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Append one token per row (N,) at `positions` (N,); next-token logits (N, V)."""
        if self.fused is not None:
            if self.cache.length + 1 > self.cache.max_len:
                raise ValueError(f"KV cache full: {self.cache.length} + 1 > {self.cache.max_len}")
            return self.fused(tokens, positions)
        logits = self.model(tokens[:, None], None, positions[:, None], cache=self.cache, last_only=True)
        return logits[:, -1]


class GPTOps:
    """What :class:`~pipeline.model.policy.Policy` needs from this backend (see there)."""

    @staticmethod
    def logits(runner, input_ids, attention_mask, logits_from: int) -> torch.Tensor:
        return runner(input_ids, attention_mask, logits_from=logits_from)

    shared_prompt_logits = staticmethod(shared_prompt_logits)

    @staticmethod
    def decoder(module: GPT, max_len: int, dtype: torch.dtype | None) -> GPTDecoder:
        return GPTDecoder(module, max_len, dtype)

    @staticmethod
    def max_len(module: GPT) -> int:
        return module.config.block_size
