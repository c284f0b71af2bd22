"""SlotKVCache (writes, masks, slot copies, layouts) and the Scheduler (FIFO admission, compaction)."""

from types import SimpleNamespace

import pytest
import torch

from moerl.rollout.kv_cache import KVLayout, SlotKVCache, kv_layout
from moerl.rollout.params import Request, SamplingParams
from moerl.rollout.scheduler import Scheduler


def _cache(slots=3, capacity=6):
    return SlotKVCache(
        KVLayout(2, 1, 2, 3), num_slots=slots, capacity=capacity, dtype=torch.float32, device="cpu"
    )


def test_prefill_writes_slots_and_masks_padding():
    cache = _cache()
    k = torch.arange(2 * 1 * 3 * 2, dtype=torch.float32).view(2, 1, 3, 2)
    v = -torch.arange(2 * 1 * 3 * 3, dtype=torch.float32).view(2, 1, 3, 3)
    cache.bind_prefill(torch.tensor([2, 0]), torch.tensor([3, 2]), 3)
    assert cache.attn_mask.shape == (2, 1, 3, 3)
    # row 1 has 2 tokens: its padded query 2 sees keys 0, 1 only
    assert cache.attn_mask[1, 0].tolist() == [[True, False, False], [True, True, False], [True, True, False]]
    assert cache.attn_mask[0, 0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    k_all, v_all = cache.update(1, k, v)
    assert k_all is k and v_all is v
    assert torch.equal(cache.k[1, 2, :, :3], k[0]) and torch.equal(cache.v[1, 0, :, :3], v[1])
    assert cache.k[0].abs().sum() == 0 and cache.k[1, 1].abs().sum() == 0


def test_decode_scatters_at_positions_and_reads_a_prefix_of_slots():
    cache = _cache()
    cache.k[0, :2] = 7.0
    cache.bind_decode(2, torch.tensor([3, 1]), 4)
    assert cache.attn_mask[:, 0, 0].tolist() == [[True] * 4, [True, True, False, False]]
    k = torch.tensor([1.0, 2.0]).view(1, 1, 1, 2).repeat(2, 1, 1, 1)
    k[1] *= 10
    k_all, v_all = cache.update(0, k, torch.zeros(2, 1, 1, 3))
    assert k_all.shape == (2, 1, 4, 2) and v_all.shape == (2, 1, 4, 3)
    assert k_all[0, 0, 3].tolist() == [1.0, 2.0] and k_all[1, 0, 1].tolist() == [10.0, 20.0]
    assert k_all[0, 0, 2].tolist() == [7.0, 7.0]  # other positions untouched
    assert cache.k[0, 2].abs().sum() == 0  # slot 2 is outside the batch
    with pytest.raises(RuntimeError, match="do not match"):
        cache.update(0, torch.zeros(2, 1, 1, 5), torch.zeros(2, 1, 1, 3))
    cache.unbind()
    with pytest.raises(RuntimeError, match="outside a bound"):
        cache.update(0, k, k)


def test_copy_slots_copies_prefix_and_routed():
    cache = _cache()
    cache.k[:, 0] = torch.arange(6, dtype=torch.float32).view(1, 1, 6, 1)
    routed = cache.ensure_routed(2, 2)
    routed[0] = 5
    cache.copy_slots([0, 0], [1, 2], 4)
    assert cache.k[0, 2, 0, :, 0].tolist() == [0, 1, 2, 3, 0, 0]
    assert routed[1, :4].eq(5).all() and routed[1, 4:].eq(0).all()
    with pytest.raises(RuntimeError, match="routed experts shape"):
        cache.ensure_routed(3, 2)


def test_kv_layout_of_gqa_and_mla_configs():
    gqa = SimpleNamespace(
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=None, hidden_size=256
    )
    assert kv_layout(gqa) == KVLayout(4, 2, 32, 32)
    mla = SimpleNamespace(
        num_hidden_layers=3,
        num_attention_heads=4,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        kv_lora_rank=10,
    )
    lay = kv_layout(mla, "expanded")
    assert lay == KVLayout(3, 4, 12, 6)
    assert lay.bytes_per_token(torch.bfloat16) == 3 * 4 * (12 + 6) * 2
    latent = kv_layout(mla)  # the default: kv_lora_rank + rope per token and layer
    assert latent == KVLayout(3, 1, 14, 0, latent=True)
    assert latent.bytes_per_token(torch.bfloat16) == 3 * (10 + 4) * 2
    assert kv_layout(gqa, "expanded") == kv_layout(gqa)  # GQA ignores it


def _request(rid, n, plen=2):
    return Request(request_id=rid, prompt_ids=[1] * plen, params=SamplingParams(n=n))


def test_scheduler_fifo_partial_groups_and_compaction():
    sched = Scheduler(num_slots=4, max_prefill_tokens=5)
    for rid, n in [("a", 2), ("b", 3), ("c", 1)]:
        sched.add(_request(rid, n), seed=0)
    adm = sched.admit(lambda seed, i: i)
    # a (2 samples) and 2 of b's 3 fit; the prefill cap (5 tokens) is not reached by 2 prompts of 2
    assert [(x.request.request_id, [s.sample_index for s in x.sequences]) for x in adm] == [
        ("a", [0, 1]),
        ("b", [0, 1]),
    ]
    assert [s.slot for s in sched.running] == [0, 1, 2, 3]
    assert sched.admit(lambda seed, i: i) == []  # full: admission waits
    a0, a1, b0, b1 = sched.running
    moves = sched.release([a0])
    assert moves == [(3, 0)] and b1.slot == 0 and [s.slot for s in sched.running] == [0, 1, 2]
    assert sched.num_unfinished == 1 + 3 + 1
    adm = sched.admit(lambda seed, i: i)
    assert [(x.request.request_id, [s.sample_index for s in x.sequences]) for x in adm] == [("b", [2])]
    assert adm[0].sequences[0].slot == 3
    moves = sched.release([a1, b0])  # slots 1 and 2 free; slot 3 moves into 1
    assert moves == [(3, 1)] and [s.slot for s in sched.running] == [0, 1]
    assert not sched.is_in_flight("a") and sched.is_in_flight("b")
