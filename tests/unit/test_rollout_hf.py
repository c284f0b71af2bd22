"""Engine greedy generation == transformers' greedy ``generate`` on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch
import transformers  # noqa: F401 - the test extra installs it: missing fails, not skips
from _hf import HF_BASE, save_random_hf_model

import moerl.models as mm
from moerl.rollout import Engine, Request, SamplingParams

_BASE = dict(HF_BASE, pad_token_id=0, eos_token_id=None, bos_token_id=None)
_FAMILIES = {
    "qwen3_moe": dict(
        intermediate_size=48, moe_intermediate_size=16, head_dim=8, num_experts=4, norm_topk_prob=True
    ),
    "mixtral": dict(intermediate_size=16, num_local_experts=4),
    "olmoe": dict(intermediate_size=16, num_experts=4),
}
NEW_TOKENS = 12


def _hf_checkpoint(family: str, folder):
    """A tiny transformers model with O(1) random weights (decisive logits and routing), saved to folder."""
    return save_random_hf_model(family, folder, seed=3, **_BASE, **_FAMILIES[family])


@pytest.mark.parametrize("family", list(_FAMILIES))
def test_greedy_matches_transformers_generate(family, tmp_path):
    hf = _hf_checkpoint(family, tmp_path)
    ours = mm.from_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 64, (n,), generator=gen).tolist() for n in (3, 9, 6, 1)]
    # transformers: one left-padded batch, greedy, no early stop
    t = max(map(len, prompts))
    ids = torch.zeros(len(prompts), t, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, t - len(p) :] = torch.tensor(p)
        mask[i, t - len(p) :] = 1
    with torch.no_grad():
        ref = hf.generate(
            ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )[:, t:]
    engine = Engine(ours, max_slots=3, kv_token_budget=3 * 32)  # 4 prompts on 3 slots: one joins late
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)
    outs = engine.generate(
        [Request(request_id=str(i), prompt_ids=p, params=params) for i, p in enumerate(prompts)]
    )
    assert [c.token_ids for c in outs] == ref.tolist()
    assert all(c.finish_reason == "length" for c in outs)
    # greedy log-probs are log softmax(logits) (T = 1) of the chosen token
    full = torch.tensor(prompts[1] + outs[1].token_ids)[None]
    with torch.no_grad():
        lp = torch.log_softmax(hf(full).logits[0, len(prompts[1]) - 1 : -1].float(), -1)
    expected = lp.gather(-1, torch.tensor(outs[1].token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(outs[1].logprobs), expected, atol=1e-4)
