"""A hand-built learned reward model for the end-to-end tests: it prefers responses made of digits."""

from pathlib import Path

import torch
import transformers

from moerl.tasks import load_tokenizer


def save_digit_reward_model(folder: Path) -> Path:
    """A one-layer ``Qwen3ForSequenceClassification`` over the built-in tokenizer whose score rises with
    the fraction of digit tokens in the sequence (prompt + response), saved to ``folder``.

    How: every embedding has feature 0 = 1 and digit tokens also feature 1 = 1; q and k are 0, so
    attention averages v uniformly over the prefix; v reads feature 1 and o_proj writes the average into
    feature 2; the MLP adds nothing; the score head reads feature 2 after the final norm. At the last
    token the score is ``w * 2f * sqrt(H) / sqrt(1 + d + 4 f^2)``, increasing in the digit fraction f
    (d = 1 when the last token is a digit)."""
    tok = load_tokenizer(None)
    h = 8
    cfg = transformers.Qwen3Config(
        vocab_size=tok.vocab_size, hidden_size=h, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=4, max_position_embeddings=128,
        num_labels=1, pad_token_id=tok.pad_id, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.Qwen3ForSequenceClassification(cfg).eval()
    digits = [i for d in "0123456789" for i in tok.encode(d)]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.model.embed_tokens.weight[digits, 1] = 1.0
        attn = model.model.layers[0].self_attn
        attn.v_proj.weight[0, 1] = 1.0  # kv head 0, channel 0 <- feature 1
        attn.o_proj.weight[2, 0] = 1.0  # feature 2 <- head 0, channel 0 (the prefix mean)
        model.score.weight[0, 2] = 4.0
    model.save_pretrained(folder)
    return folder
