"""A decode step of a Llama-family transformers model (Llama, Qwen2), or of the from-scratch GPT,
in few, large ops.

The shared-prefix decoder of ``pipeline.model.hf`` runs each decode step through the model's own
modules: three q/k/v and two gate/up matmuls per layer, rotary applied to q and k separately, a
transformers attention dispatch, about 420 aten ops per step for a 4-layer model. During a rollout
the weights do not change, so :class:`FusedLlamaStep` takes them once per rollout and runs the same
arithmetic as one flat function:

- q, k and v as ONE matmul (their weights concatenated), gate and up as one, each weight packed for
  oneDNN (or MKL) once per rollout on CPU fp32 (``pipeline.model.fast.packed``), and again for the new row count
  when finished rows leave the batch;
- rotary on q and k together, from a cos/sin table made once (``sin`` carries rotate-half's sign, so
  ``rotate_half(x) * sin`` is one flip and one multiply);
- this step's key/value written in place into the preallocated response cache (no ``cat``), and the
  attention of all rows and heads as batched calls over the prompt's keys (once per group) and the
  rows' response keys (:func:`pipeline.model.attention.grouped_prefix_attention`).

Same function of the inputs as the module path up to float rounding (greedy tokens identical in
tests/test_fused_decode.py); it runs only where :func:`supported` says the model is exactly the
architecture written here (plain ``nn.Linear`` layers: no LoRA or quantised wrappers; static rotary).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.model.attention import grouped_prefix_attention, whole_cache_key_bias
from pipeline.model.fast import packed

_TYPES = ("llama", "qwen2")
_STATIC_ROPE = ("default", "linear", "llama3")  # inv_freq fixed for the whole rollout


def _decoder_layers(model: nn.Module):
    base = getattr(model, "model", None)
    return None if base is None else getattr(base, "layers", None)


def supported(model: nn.Module) -> bool:
    """Whether `model` is a plain Llama/Qwen2 causal LM this step reproduces exactly."""
    cfg = model.config
    layers = _decoder_layers(model)
    if getattr(cfg, "model_type", None) not in _TYPES or layers is None or getattr(model, "lm_head", None) is None:
        return False
    if getattr(cfg, "use_sliding_window", False) or getattr(cfg, "pretraining_tp", 1) != 1:
        return False
    if getattr(model.model.rotary_emb, "rope_type", "default") not in _STATIC_ROPE:
        return False
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    for layer in layers:
        linears = [getattr(layer.self_attn, n, None) for n in names]
        linears += [getattr(layer.mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(type(m) is not nn.Linear for m in linears):  # LoRA / quantised wrappers: the module path
            return False
    return type(model.lm_head) is nn.Linear


class _Linear:
    """``x @ weight.T + bias`` on the packed weight (CPU fp32: :func:`~pipeline.model.fast.packed.PackedWeight`,
    oneDNN's or MKL's), else ``F.linear``.

    Under autocast (``model.dtype: bfloat16``) the weight and bias are cast to the autocast dtype
    once, on the first such call, and kept for the rollout: autocast casts them on every call
    otherwise (these are detached tensors, outside its cast cache), which for the LM head and the
    MLP weights cost as much as the bf16 matmuls themselves. The same values as autocast's own
    casts, so the same result."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> None:
        self.weight, self.bias = weight.detach().contiguous(), None if bias is None else bias.detach()
        self.rows, self.packed = rows, None  # packed on the first fp32 call (none under autocast)
        self.packable = weight.dtype == torch.float32 and weight.device.type == "cpu" and packed.available()
        self.cast: tuple[torch.dtype, torch.Tensor, torch.Tensor | None] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        if not (torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)):
            if self.packable and x.dtype == torch.float32:
                if self.packed is None:
                    self.packed = packed.PackedWeight(self.weight, self.bias, self.rows)
                return self.packed(x)
            return F.linear(x, self.weight, self.bias)
        dtype = torch.get_autocast_dtype(device)
        if self.weight.dtype == dtype or not self.weight.is_floating_point():
            return F.linear(x, self.weight, self.bias)
        if self.cast is None or self.cast[0] != dtype:
            self.cast = (dtype, self.weight.to(dtype), None if self.bias is None else self.bias.to(dtype))
        return F.linear(x.to(dtype) if x.is_floating_point() else x, self.cast[1], self.cast[2])


def _fused(modules: list[nn.Linear], rows: int) -> _Linear:
    weight = torch.cat([m.weight for m in modules], dim=0)
    biases = [m.bias for m in modules]
    bias = None if all(b is None for b in biases) else torch.cat(
        [b if b is not None else m.weight.new_zeros(m.out_features) for b, m in zip(biases, modules)])
    return _Linear(weight, bias, rows)


def _rms(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """RMSNorm with fp32 statistics (transformers' Llama RMSNorm, the GPT's own) as one
    ``F.rms_norm`` in fp32 instead of six elementwise ops; the weight applied in the input dtype."""
    eps = norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps
    if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), norm.weight, eps)
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


class _Layer:
    def __init__(self, layer: nn.Module, rows: int) -> None:
        att, mlp = layer.self_attn, layer.mlp
        self.ln_1, self.ln_2 = layer.input_layernorm, layer.post_attention_layernorm
        self.qkv = _fused([att.q_proj, att.k_proj, att.v_proj], rows)
        self.o = _Linear(att.o_proj.weight, att.o_proj.bias, rows)
        self.gate_up = _fused([mlp.gate_proj, mlp.up_proj], rows)
        self.down = _Linear(mlp.down_proj.weight, mlp.down_proj.bias, rows)
        self.act, self.hidden, self.scale = mlp.act_fn, mlp.gate_proj.out_features, att.scaling


class _GPTLayer:
    def __init__(self, block: nn.Module, rows: int) -> None:
        att, mlp = block.attn, block.mlp
        self.ln_1, self.ln_2 = block.ln_1, block.ln_2
        self.qkv = _Linear(att.c_attn.weight, None, rows)  # already fused: [q; k; v]
        self.o = _Linear(att.c_proj.weight, None, rows)
        self.gate_up = _Linear(mlp.c_fc.weight, None, rows)  # already fused: [gate; up]
        self.down = _Linear(mlp.c_proj.weight, None, rows)
        self.act, self.hidden, self.scale = F.silu, mlp.hidden, att.head_dim ** -0.5


def gpt_supported(model: nn.Module) -> bool:
    """Whether the from-scratch GPT's layers are all plain (no LoRA or other wrappers)."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return bool(linears) and all(type(m) is nn.Linear for m in linears)


class FusedLlamaStep:
    """Decode steps of N rows over a shared prefix (prompt keys/values once per group) and a
    preallocated response cache; see the module docstring. ``__call__`` matches ``HFDecoder.step``."""

    def __init__(self, model: nn.Module, prefix, prefix_bias: torch.Tensor, cache, rows: int) -> None:
        cfg = model.config
        self.H, self.Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.D = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.H
        self.embed = model.model.embed_tokens.weight
        self.layers = [_Layer(layer, rows) for layer in model.model.layers]
        self.norm = model.model.norm
        self.head = _Linear(model.lm_head.weight, model.lm_head.bias, rows)
        self.prefix, self.prefix_bias, self.cache = prefix, prefix_bias, cache
        # rotary tables for every position, made once: (P, D); sin with rotate-half's sign folded in
        P = cfg.max_position_embeddings
        probe = torch.zeros(1, dtype=self.embed.dtype, device=self.embed.device)
        cos, sin = model.model.rotary_emb(probe, torch.arange(P, device=self.embed.device)[None])  # (1, P, D)
        half = self.D // 2
        self.cos = cos[0]
        self.sin = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)
        self.wpe, self.key_mask = None, None

    def rebind(self, prefix, prefix_bias: torch.Tensor) -> None:
        """After the decoder kept a subset of its groups: their prompts' keys and bias (the
        response cache object is the same, its tensors already cut)."""
        self.prefix, self.prefix_bias = prefix, prefix_bias

    def _whole_cache_bias(self, t: int) -> torch.Tensor | None:
        """The response attention over the whole preallocated cache, position > `t` masked by this
        (max_new,) additive bias, or None: over the slice written so far (see
        :func:`~pipeline.model.attention.whole_cache_key_bias`)."""
        return whole_cache_key_bias(self.cache.k[0], t)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (N, h, D): ``x * cos + rotate_half(x) * sin`` with rotate_half as a flip of the halves."""
        N, h, D = x.shape
        swapped = x.view(N, h, 2, D // 2).flip(2).view(N, h, D)  # [x2, x1]
        return torch.addcmul(x * cos, swapped, sin)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        N, H, Hkv, D = tokens.shape[0], self.H, self.Hkv, self.D
        t = self.cache.length
        x = F.embedding(tokens, self.embed)  # (N, C)
        if self.wpe is not None:  # learned absolute positions (the GPT's `positions: learned`)
            x = x + F.embedding(positions, self.wpe)
        rope = None if self.cos is None else (self.cos[positions][:, None], self.sin[positions][:, None])  # (N, 1, D)
        if self.key_mask is not None:
            self.key_mask[:, t] = True
        key_bias = self._whole_cache_bias(t)
        for i, L in enumerate(self.layers):
            qkv = L.qkv(_rms(x, L.ln_1)).view(N, H + 2 * Hkv, D)  # (N, H + 2 Hkv, D)
            qk = qkv[:, : H + Hkv] if rope is None else self._rope(qkv[:, : H + Hkv], *rope)  # q, k together
            k_all, v_all = self.cache.k[i], self.cache.v[i]  # (N, Hkv, max_new, D)
            k_all[:, :, t] = qk[:, H:]
            v_all[:, :, t] = qkv[:, H + Hkv:]
            kp_t, vp = self.prefix[i]
            if key_bias is None:  # the positions written so far
                k_all, v_all = k_all[:, :, : t + 1], v_all[:, :, : t + 1]
            y = grouped_prefix_attention(qk[:, :H, None], kp_t, vp, k_all, v_all, self.prefix_bias, scale=L.scale,
                                         key_bias=key_bias)  # (N, H, 1, D)
            x = x + L.o(y.reshape(N, H * D))
            gate, up = L.gate_up(_rms(x, L.ln_2)).split(L.hidden, dim=-1)  # (N, 4C) each
            x = x + L.down(L.act(gate) * up)
        self.cache.length += 1
        return self.head(_rms(x, self.norm))  # (N, V)


class FusedGPTStep(FusedLlamaStep):
    """The same step for the from-scratch GPT (``pipeline.model.gpt``) over its shared-prefix
    :class:`~pipeline.model.gpt.KVCache` (`cache.prefix` the B prompts' cache, `cache` the rows')."""

    def __init__(self, model: nn.Module, cache, rows: int) -> None:  # noqa: D107 (no super: other weights)
        cfg = model.config
        self.H = self.Hkv = cfg.n_head
        self.D = cfg.head_dim
        self.embed = model.wte.weight
        self.wpe = None if model.wpe is None else model.wpe.weight
        self.layers = [_GPTLayer(block, rows) for block in model.h]
        self.norm = model.ln_f
        self.head = _Linear(model.lm_head.weight, None, rows)
        self.cache = cache
        self.rebind_gpt(cache)
        self.cos = self.sin = None
        if self.wpe is None:
            self.cos, self.sin = model.rope_cos, model.rope_sin_signed

    def rebind_gpt(self, cache) -> None:
        """Read the prompts' keys, their bias and the key mask from `cache` (again after a cut)."""
        P = cache.prefix
        self.prefix = [(cache.prefix_k_t[i], P.v[i, :, :, : P.length]) for i in range(len(self.layers))]
        self.prefix_bias, self.key_mask = cache.prefix_bias, cache.key_mask
