"""Hugging Face backend: any ``AutoModelForCausalLM`` + ``AutoTokenizer`` behind the policy interface.

``load_hf(init)`` reads a local folder or a hub id. :class:`HFTokenizer` adapts a transformers
tokenizer to the pipeline's tokenizer interface (``encode``/``decode``/``pad_id``/``eos_id``/
``vocab_size``/``save``/``token_id``). ``encode`` adds no special tokens (no BOS), so a prompt and
its completion encode the same way in SFT, rollout and evaluation.

:class:`HFDecoder` is the incremental-decoding state for the rollout engine: a transformers
cache filled by one prefill of the distinct prompts, then extended one token per step (Llama,
GPT-2 and Qwen2: the prompts' keys are shared by their group, see :class:`HFDecoder`).
:func:`hf_shared_prefix_logits` is the same idea for the GRPO log-prob passes.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
import torch.nn as nn

from pipeline.core.errors import InputError
from pipeline.data.tokenizer import HFTokenizer, load_hf_tokenizer
from pipeline.model import fast
from pipeline.model.attention import grouped_prefix_attention, positions_from_mask, whole_cache_key_bias, whole_groups
from pipeline.model.fast import fused_decode
from pipeline.model.hf_mask import self_attending_mask


def load_hf(init: str | Path, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, HFTokenizer]:
    """Model (weights in `dtype`; the compute dtype is set by autocast) and tokenizer from a local
    folder or a hub id."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    folder = Path(init)
    if folder.is_dir() and not any(folder.glob("*.safetensors")):
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        raise InputError(f"{folder}: no safetensors weights" + (
            f"; {', '.join(pickles)} {'is a' if len(pickles) == 1 else 'are'} pickle file{'s' * (len(pickles) > 1)}, "
            "which the pipeline never loads (unpickling can run code). Convert once where you trust the file: "
            "AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(OUT) writes model.safetensors" if pickles else
            "; expected the model.safetensors (or sharded *.safetensors) of save_pretrained"))
    # safetensors only, also for a hub id: a pickle `pytorch_model.bin` is never loaded
    model = AutoModelForCausalLM.from_pretrained(str(init), dtype=dtype, use_safetensors=True)
    return model, load_hf_tokenizer(init)


def generation_eos_ids(model: nn.Module) -> list[int]:
    """The eos ids of `model`'s generation_config (an int, a list or None): the tokens an instruct model
    ends its turn with (`<|im_end|>`, `<|eot_id|>`), often not its tokenizer's eos. Saved with the
    model (``generation_config.json``), so a trained checkpoint keeps them."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return []
    return [int(i) for i in ([eos] if isinstance(eos, int) else eos)]


class _TanhGELU(nn.Module):
    """``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` as ONE ``F.gelu(approximate="tanh")`` op
    (forward and backward) in place of transformers' Python formula of the same function
    (``gelu_new``: GPT-2 and its family; ``gelu_fast``, ``gelu_accurate``, ``gelu_python_tanh``).
    The formula dispatches eight elementwise ops forward (nine for ``gelu_fast``) and about twice
    that backward, each a full-size temporary that autograd keeps: on CPU 2-5x the time of the one
    op, more at the update's larger (tokens x 4C) shapes. The two differ by float rounding (an
    absolute difference of about 2e-7 in fp32); with the fast paths off (``fast.plain()``)
    the original module runs."""

    def __init__(self, plain: nn.Module) -> None:
        super().__init__()
        self.plain = plain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fast.enabled():
            return nn.functional.gelu(x, approximate="tanh")
        return self.plain(x)


def _tanh_gelu_formulas(activations):
    """A test of whether a module is one of transformers' Python formulas of the tanh-approximate GELU
    (the classes looked up once, not per module)."""
    names = ("NewGELUActivation", "FastGELUActivation", "AccurateGELUActivation")
    formulas = tuple(getattr(activations, name) for name in names if hasattr(activations, name))
    python_tanh = getattr(getattr(activations, "GELUTanh", None), "_gelu_tanh_python", None)

    def is_formula(module: nn.Module) -> bool:
        act = getattr(module, "act", None)  # GELUTanh(use_gelu_tanh_python=True): the formula as a method
        return type(module) in formulas or (python_tanh is not None and getattr(act, "__func__", None) is python_tanh)

    return is_formula


def fuse_activations(model: nn.Module) -> int:
    """Swap every module of `model` that computes the tanh-approximate GELU as a Python formula for
    :class:`_TanhGELU`, in place; returns how many were swapped (applying it twice swaps none).
    No parameters change, so state dicts, configs and saved checkpoints are those of the model."""
    from transformers import activations

    is_formula = _tanh_gelu_formulas(activations)
    swapped = 0
    for parent in list(model.modules()):
        if isinstance(parent, _TanhGELU):  # already swapped: its `plain` is the formula it replaced
            continue
        for name, child in list(parent.named_children()):
            if is_formula(child):
                setattr(parent, name, _TanhGELU(child))
                swapped += 1
    return swapped


def _checkpointed_forward(self, *args, **kwargs):
    """A decoder layer's forward, recomputed in backward (a non-reentrant checkpoint) when grad is on."""
    if torch.is_grad_enabled():
        from torch.utils.checkpoint import checkpoint

        return checkpoint(type(self).forward, self, *args, use_reentrant=False, **kwargs)
    return type(self).forward(self, *args, **kwargs)


def enable_gradient_checkpointing(model: nn.Module) -> int:
    """Recompute each decoder layer's activations in backward instead of keeping them; returns the
    number of layers. transformers' own switch only acts in train mode, and GRPO runs the policy in
    eval mode (no dropout), so each layer's forward becomes :func:`_checkpointed_forward`, bound to
    the layer (a deep copy rebinds it to the copy; applying it twice changes nothing)."""
    import types

    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(f"model.gradient_checkpointing: no decoder layers found in {type(model).__name__}")
    for layer in layers:
        layer.forward = types.MethodType(_checkpointed_forward, layer)
    return len(layers)


def _cache_kwarg(model: nn.Module) -> str:
    """transformers 5 renamed `past_key_values` to `cache` in some versions; use what forward takes."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under a peft wrapper
    params = inspect.signature(base.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def hf_shared_prefix_logits(model: nn.Module, input_ids, attention_mask, position_ids, start: int,
                            group: int) -> list[torch.Tensor]:
    """Logits at positions ``start-1 .. T-2`` of group-contiguous rows whose first `start` columns
    (ids and mask) are the same within each group of `group` rows, as two pieces along the columns
    (the prompt's last position (N, 1, V), then the rest), like
    :func:`pipeline.model.gpt.shared_prompt_logits`.

    The shared prompt runs ONCE per group (B = N / group rows) with a ``DynamicCache``; the cache
    is repeated per row and the response columns run on top of it. Same function of the inputs as
    one full forward (differentiable: the cache is built with ``cat``/``repeat_interleave``, so
    the prompt's gradient is the sum over its group), but the prompt trunk costs 1/group.
    """
    from transformers import DynamicCache

    T = input_ids.shape[1]
    cache = DynamicCache(config=model.config)
    key = _cache_kwarg(model)
    prompt_mask = self_attending_mask(model, attention_mask[::group, :start])  # the cache is empty: keys = queries
    out = model(input_ids=input_ids[::group, :start], attention_mask=prompt_mask,
                position_ids=position_ids[::group, :start], use_cache=True, logits_to_keep=1, **{key: cache})
    first = out.logits[:, -1:].repeat_interleave(group, dim=0)  # (N, 1, V): position start-1
    if T - 1 == start:
        return [first]
    cache.batch_repeat_interleave(group)
    out = model(input_ids=input_ids[:, start:T - 1], attention_mask=attention_mask[:, :T - 1],
                position_ids=position_ids[:, start:T - 1], use_cache=True, **{key: cache})
    return [first, out.logits]  # (N, 1, V), (N, T-1-start, V)


_SHARED_PREFIX_ATTN = "grpo_shared_prefix_decode"
_SHARED_PREFIX_TYPES = ("llama", "gpt2", "qwen2")  # plain causal self-attention, flat config (tested)
_active: list[HFDecoder] = []  # the decoder whose step is running (read by the attention function)


def _shared_prefix_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """One decode step of N = B*G rows as a transformers attention function: the B distinct prompts'
    keys are read once per group (:func:`pipeline.model.attention.grouped_prefix_attention`, the same
    math as the GPT decoder's), the row's own response keys as usual.

    query (N, H, 1, D); key/value (N, Hkv, t, D): the response positions so far (this step's
    included); `attention_mask`: (B, 1, 1, Tp) additive bias of the prompt keys (0 or -inf).
    Returns (N, 1, H, D) like transformers' own attention functions. Where the decoder's step set
    a `key_bias` (a reduced-precision cache on CPU, see
    :func:`~pipeline.model.attention.whole_cache_key_bias`), the step attends over the whole
    preallocated response cache instead, the positions not written yet masked.
    """
    dec = _active[-1]
    kp_t, vp = dec.prefix[module.layer_idx]  # (B, Hkv, D, Tp), (B, Hkv, Tp, D)
    if dec.key_bias is not None:
        key, value = dec.cache.k[module.layer_idx], dec.cache.v[module.layer_idx]  # (N, Hkv, max_new, D)
    # the prompt bias expanded over key heads once per rollout (`attention_mask` is its (B, 1, 1, Tp) form)
    y = grouped_prefix_attention(query, kp_t, vp, key, value, dec.prefix_bias, scale=scaling,
                                 key_bias=dec.key_bias)  # (N, H, 1, D)
    return y.transpose(1, 2), None


class _ResponseCache:
    """Preallocated keys/values of the response positions of N rows (duck-types a transformers
    Cache for decode steps: attention layers only call `update`)."""

    def __init__(self, values: list[torch.Tensor], rows: int, max_new: int) -> None:
        # shaped like the prompts' values (B, Hkv, Tp, D) of each layer, with N rows and max_new positions
        self.k = [vp.new_zeros(rows, vp.shape[1], max_new, vp.shape[3]) for vp in values]
        self.v = [vp.new_zeros(rows, vp.shape[1], max_new, vp.shape[3]) for vp in values]
        self.length = 0

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        end = self.length + key_states.shape[2]
        self.k[layer_idx][:, :, self.length:end] = key_states
        self.v[layer_idx][:, :, self.length:end] = value_states
        return self.k[layer_idx][:, :, :end], self.v[layer_idx][:, :, :end]


class HFDecoder:
    """KV-cached incremental decoding of a transformers causal LM.

    Shared prefix (model types in ``_SHARED_PREFIX_TYPES``: Llama, GPT-2, Qwen2): the prompts' keys/values
    from ONE prefill of the B distinct prompts stay (B, ...) and are read once per group by
    :func:`_shared_prefix_attention`; each of the N = B*G rows only stores its response
    keys/values, and attends to exactly the positions written so far. No per-step mask is built
    (the prompt mask is a fixed (B, 1, 1, Tp) bias), and the G copies of a prompt's keys are
    never made. Llama and Qwen2 (plain linear layers) then decode through
    :class:`pipeline.model.fast.fused_decode.FusedLlamaStep` (`fused`; None: where supported, with the
    fast paths on): fused q/k/v and gate/up matmuls and no module dispatch.

    Other models: a ``StaticCache`` where supported (``_can_compile_fullgraph``: keys/values
    preallocated for `max_len` and written in place; a ``DynamicCache`` concatenates the whole cache
    every step, which was over half of the decode time of a tiny Llama on CPU), else a
    ``DynamicCache``, repeated per group after the prefill; `mask` (N, max_len) holds the attention
    mask of every position and is sliced per step.
    """

    def __init__(self, model: nn.Module, max_len: int, shared_prefix: bool | None = None,
                 fused: bool | None = None) -> None:
        from transformers import DynamicCache, StaticCache

        self.model = model
        self.max_len = max_len
        cfg = model.config
        if shared_prefix is None:
            shared_prefix = (fast.enabled() and getattr(cfg, "model_type", None) in _SHARED_PREFIX_TYPES
                             and not getattr(cfg, "sub_configs", None)
                             and not getattr(cfg, "add_cross_attention", False))
        self.shared = shared_prefix
        self.static = (fast.enabled() and not self.shared
                       and bool(getattr(model, "_can_compile_fullgraph", False)))
        if self.static:
            self.cache = StaticCache(config=cfg, max_cache_len=max_len)
        else:
            self.cache = DynamicCache(config=cfg)
        self.key = _cache_kwarg(model)
        self.mask: torch.Tensor | None = None
        self.key_bias: torch.Tensor | None = None  # a module step over the whole response cache: see _shared_step
        self.length = 0
        if fused is None:
            fused = fast.enabled() and fused_decode.supported(model)
        self.use_fused = fused and self.shared  # decode steps through fused_decode (Llama, Qwen2)
        self.fused: fused_decode.FusedLlamaStep | None = None

    def _repeat_cache(self, repeats: int) -> None:
        if not self.static:
            self.cache.batch_repeat_interleave(repeats)
            return
        for layer in self.cache.layers:  # StaticLayer has no batch_repeat_interleave
            layer.keys = layer.keys.repeat_interleave(repeats, dim=0)
            layer.values = layer.values.repeat_interleave(repeats, dim=0)
            layer.batch_size = layer.keys.shape[0]

    def prefill(self, input_ids, attention_mask, position_ids, repeats: int) -> torch.Tensor:
        """Run the prompts once; rows of a group share (or get a copy of) their prompt's cache;
        last logits (B*r, V)."""
        B, T = input_ids.shape
        # a DynamicCache starts empty, so the prefill's keys are its queries and the self-attending mask
        # fits; a StaticCache's keys are max_len wide (those models take transformers' own mask anyway)
        mask = self_attending_mask(self.model, attention_mask) if self.shared else attention_mask
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                         use_cache=True, logits_to_keep=1, **{self.key: self.cache})
        if self.shared:
            # the prompts' keys transposed once for the whole rollout (see grouped_prefix_attention)
            self.prefix = [(layer.keys.transpose(-1, -2).contiguous(), layer.values) for layer in self.cache.layers]
            self.cache = _ResponseCache([layer.values for layer in self.cache.layers], B * repeats, self.max_len - T)
            bias = torch.zeros(B, 1, 1, T, dtype=self.prefix[0][0].dtype, device=input_ids.device)
            self.mask = bias.masked_fill(attention_mask[:, None, None, :] == 0, float("-inf"))
            self.prefix_bias = self.mask.expand(-1, self.prefix[0][0].shape[1], -1, -1).contiguous()  # (B, Hkv, 1, T)
            if self.use_fused:  # Llama/Qwen2: few, large ops per step
                self.fused = fused_decode.FusedLlamaStep(self.model, self.prefix, self.prefix_bias, self.cache,
                                                         B * repeats)
        else:
            if repeats > 1:
                self._repeat_cache(repeats)
            self.mask = torch.zeros(B * repeats, self.max_len, dtype=attention_mask.dtype, device=input_ids.device)
            self.mask[:, :T] = attention_mask.repeat_interleave(repeats, dim=0)
        self.length = T
        return out.logits[:, -1].repeat_interleave(repeats, dim=0)  # (N, V)

    def select(self, rows: torch.Tensor) -> bool:
        """Keep only `rows` (indices of the current rows, ascending) so later steps skip the rows
        that have stopped. Where the G rows of a group share their prompt's keys, `rows` must be
        whole groups (the prompts of the groups kept stay too). False: nothing changed."""
        if self.shared:
            groups = whole_groups(rows, self.cache.k[0].shape[0] // self.prefix[0][0].shape[0])
            if groups is None:
                return False
            self.prefix = [(kp_t[groups], vp[groups]) for kp_t, vp in self.prefix]
            self.mask, self.prefix_bias = self.mask[groups], self.prefix_bias[groups]
            for i in range(len(self.cache.k)):  # in place: the fused step holds this cache
                self.cache.k[i], self.cache.v[i] = self.cache.k[i][rows], self.cache.v[i][rows]
            if self.fused is not None:
                self.fused.rebind(self.prefix, self.prefix_bias)
            return True
        from transformers.cache_utils import (DynamicLayer, DynamicSlidingWindowLayer, StaticLayer,
                                              StaticSlidingWindowLayer)

        # only layers whose per-row state is their keys and values: the linear-attention, indexed and
        # quantised layers of other models (LFM2, Qwen3-Next, ...) keep more, so those decode every row
        plain = (StaticLayer, StaticSlidingWindowLayer) if self.static else (DynamicLayer, DynamicSlidingWindowLayer)
        if not all(type(layer) in plain for layer in getattr(self.cache, "layers", [None])):
            return False
        if self.static:
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[rows], layer.values[rows]
                layer.batch_size = layer.keys.shape[0]
        else:
            self.cache.batch_select_indices(rows)
        self.mask = self.mask[rows]
        return True

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Append one token per row (N,) at `positions` (N,); next-token logits (N, V)."""
        if self.shared:
            return self._shared_step(tokens, positions)
        self.mask[:, self.length] = 1
        self.length += 1
        out = self.model(input_ids=tokens[:, None], attention_mask=self.mask[:, : self.length],
                         position_ids=positions[:, None], use_cache=True, logits_to_keep=1,
                         **{self.key: self.cache})
        return out.logits[:, -1]

    def _shared_step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            self.length += 1
            return self.fused(tokens, positions)
        from transformers import AttentionInterface

        if _SHARED_PREFIX_ATTN not in AttentionInterface._global_mapping:
            AttentionInterface.register(_SHARED_PREFIX_ATTN, _shared_prefix_attention)
        cfg = self.model.config
        impl = cfg._attn_implementation
        cfg._attn_implementation = _SHARED_PREFIX_ATTN  # this forward only
        self.key_bias = whole_cache_key_bias(self.cache.k[0], self.cache.length)
        _active.append(self)
        try:
            # a 4-D mask is passed through untouched: no mask is built per step
            out = self.model(input_ids=tokens[:, None], attention_mask=self.mask, position_ids=positions[:, None],
                             use_cache=True, logits_to_keep=1, **{self.key: self.cache})
        finally:
            _active.pop()
            cfg._attn_implementation = impl
        self.cache.length += 1
        self.length += 1
        return out.logits[:, -1]


class HFOps:
    """What :class:`~pipeline.model.policy.Policy` needs from this backend (see there)."""

    @staticmethod
    def logits(runner, input_ids, attention_mask, logits_from: int) -> torch.Tensor:
        T = input_ids.shape[1]
        keep = {"logits_to_keep": T - logits_from} if logits_from else {}  # the last T - logits_from columns
        out = runner(input_ids=input_ids, attention_mask=self_attending_mask(runner, attention_mask),
                     position_ids=positions_from_mask(attention_mask), use_cache=False, **keep)
        return out.logits[:, logits_from:] if out.logits.shape[1] == T else out.logits

    shared_prompt_logits = staticmethod(hf_shared_prefix_logits)

    @staticmethod
    def decoder(module: nn.Module, max_len: int, dtype: torch.dtype | None) -> HFDecoder:
        return HFDecoder(module, max_len)

    @staticmethod
    def max_len(module: nn.Module) -> int | None:
        cfg = module.config
        return getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)


def gpt_to_llama(gpt) -> nn.Module:
    """The same network as a transformers ``LlamaForCausalLM`` (rope GPTs only; weights copied).

    The GPT was laid out for this: RMSNorm, SwiGLU with [gate; up] fused, fused [q; k; v],
    rotate-half rope with Llama's frequencies, no biases, tied head.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    c = gpt.config
    if c.positions != "rope":
        raise ValueError(f"only rope GPTs map onto Llama (this one has positions = {c.positions!r})")
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=4 * c.n_embd,
                      num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_head,
                      max_position_embeddings=c.block_size, rms_norm_eps=c.norm_eps, hidden_act="silu",
                      tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
                      rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta})
    sd = gpt.state_dict()
    out = {"model.embed_tokens.weight": sd["wte.weight"], "model.norm.weight": sd["ln_f.weight"]}
    for i in range(c.n_layer):
        src, dst = f"h.{i}.", f"model.layers.{i}."
        q, k, v = sd[src + "attn.c_attn.weight"].split(c.n_embd, dim=0)
        gate, up = sd[src + "mlp.c_fc.weight"].split(4 * c.n_embd, dim=0)
        out.update({
            dst + "input_layernorm.weight": sd[src + "ln_1.weight"],
            dst + "post_attention_layernorm.weight": sd[src + "ln_2.weight"],
            dst + "self_attn.q_proj.weight": q, dst + "self_attn.k_proj.weight": k,
            dst + "self_attn.v_proj.weight": v, dst + "self_attn.o_proj.weight": sd[src + "attn.c_proj.weight"],
            dst + "mlp.gate_proj.weight": gate, dst + "mlp.up_proj.weight": up,
            dst + "mlp.down_proj.weight": sd[src + "mlp.c_proj.weight"],
        })
    model = LlamaForCausalLM(cfg)
    missing, unexpected = model.load_state_dict({k: v.detach().clone() for k, v in out.items()}, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to embed_tokens
    if missing or unexpected:
        raise RuntimeError(f"GPT -> Llama mapping is incomplete: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval()
