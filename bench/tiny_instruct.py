"""Build a random-weight instruct-style model on the spot (no download): a Qwen2 decoder (GQA,
q/k/v biases) with a ChatML chat template, saved with save_pretrained for `model.init`.

    python bench/tiny_instruct.py OUT_DIR [--layers 4] [--width 256] [--heads 8] [--kv-heads 2]
                                          [--ffn 688] [--vocab 151936] [--gsm8k PATH]

The tokenizer is a byte-level BPE (2,048 tokens) trained on the GSM8K copy's text, with Qwen's
special tokens (`<|endoftext|>` pad, `<|im_start|>`, `<|im_end|>` eos). The model's vocabulary is
`--vocab` rows (Qwen2.5's 151,936 by default), so the vocabulary projection, sampling and log-prob
passes cost what they cost for the real model; ids the tokenizer lacks decode to nothing. `--ffn`:
the MLP width (default 2.7 x `--width`; Qwen2.5-0.5B's is 4864 at width 896).
bench/device_check.sh builds Qwen2.5-0.5B's shape with it on a GPU machine, which reaches no hub.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import default_gsm8k

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def texts(gsm8k: Path) -> list[str]:
    folder = gsm8k if gsm8k.is_dir() else gsm8k.parent
    out = []
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                out += [row.get("question", ""), row.get("answer", "")]
    return out


def build(out: Path, layers: int, width: int, heads: int, kv_heads: int, vocab: int, gsm8k: Path,
          ffn: int = 0) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts(gsm8k) + ["Think step by step <answer>0</answer>"],
                            trainers.BpeTrainer(vocab_size=2048, special_tokens=SPECIAL,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<|endoftext|>", eos_token="<|im_end|>")
    tok.chat_template = CHATML
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=max(vocab, len(tok)), hidden_size=width,
                      intermediate_size=ffn or int(width * 2.7) // 8 * 8,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=2048, tie_word_embeddings=True, use_sliding_window=False,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=0, help="MLP width (0: 2.7 x width)")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--gsm8k", default=None)
    args = ap.parse_args()
    path = build(Path(args.out), args.layers, args.width, args.heads, args.kv_heads, args.vocab,
                 Path(args.gsm8k or default_gsm8k()), args.ffn)
    print(path)


if __name__ == "__main__":
    main()
