"""Make the stand-ins the examples train on: a tiny Hugging Face MoE model folder with a ChatML chat
template (``my_model/``) and a Parquet file of chat rows (``data/train.parquet``).

Replace them with your own: any Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3 or GLM-4-MoE folder
(config.json, safetensors, tokenizer.json, tokenizer_config.json with its chat_template) and your data.

    python3 make_tiny_model.py [--out FOLDER] [--rows N]     # needs the [data] extra (pyarrow)

The model is random (seed 0): the example's warm start (sft.steps) teaches it the answer format.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tokenizers import Tokenizer, decoders, models

from moerl.config import ModelConfig
from moerl.models import build_model, save_pretrained

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
CHAT_TEMPLATE = (  # Qwen's ChatML template, shortened
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)


def chat_tokenizer() -> Tokenizer:
    """A character-level BPE with the ChatML special tokens (ids 0-3, ``<|im_end|>`` ends a turn)."""
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for ch in "\n" + "".join(chr(c) for c in range(32, 127)):
        vocab[ch] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIALS)
    return backend


def save_model(folder: Path) -> None:
    """A random Qwen3-MoE (2 layers, 8 experts top-2, hidden 64: ~0.2M parameters) and its tokenizer (tokenizer.json, and
    tokenizer_config.json with the chat template) as a Hugging Face folder."""
    tokenizer = chat_tokenizer()
    torch.manual_seed(0)
    cfg = ModelConfig(
        hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8, top_k=2,
        moe_intermediate_size=64, max_position_embeddings=256,
    )  # fmt: skip
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<unk>",
        "chat_template": CHAT_TEMPLATE,
    }

    def add_tokenizer(tmp: Path) -> None:  # written with the weights, before the folder appears
        tokenizer.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=1))

    model = build_model(cfg, tokenizer.get_vocab_size(with_added_tokens=True))
    save_pretrained(model, folder, extra=add_tokenizer)


def save_rows(path: Path, num_rows: int) -> None:
    """Chat rows ``{"messages": [user, assistant]}``: "What is a+b?" answered "#### a+b" (2-digit a, b)."""
    rng = random.Random(0)
    rows = []
    for _ in range(num_rows):
        a, b = rng.randint(10, 49), rng.randint(10, 49)
        rows.append({"messages": [
            {"role": "user", "content": f"What is {a}+{b}?"},
            {"role": "assistant", "content": f"#### {a + b}"},
        ]})  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".", help="folder to write my_model/ and data/ into (default: here)")
    p.add_argument("--rows", type=int, default=2000, help="rows of data/train.parquet (default: 2000)")
    args = p.parse_args()
    out = Path(args.out)
    save_model(out / "my_model")
    save_rows(out / "data" / "train.parquet", args.rows)
    print(f"wrote {out / 'my_model'} and {out / 'data' / 'train.parquet'} ({args.rows} rows)")


if __name__ == "__main__":
    main()
