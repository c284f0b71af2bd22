"""FP8 rollout of a bf16 policy (``rollout.weight_dtype=fp8``), CPU: the engine quantizes each version as it
loads, decodes with the dequantize-then-matmul path, and stays close to the bf16 policy (log-prob gap and
greedy agreement measured by ``moerl.rollout.precision_gap``)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from _tiny import small_model_config

import moerl.models as mm
import moerl.rollout.weight_dtype as wd
from moerl.config import ConfigError, RolloutConfig, load_config
from moerl.models.fp8 import FP8_DTYPE, Fp8Experts, quantize_blockwise
from moerl.rl import preset_from_config
from moerl.rollout.params import Request, SamplingParams
from moerl.rollout.precision_gap import logprob_gap
from moerl.runtime.build import make_engine


@pytest.fixture(scope="module")
def policy():
    """A bf16 Qwen3-MoE policy 160 wide (two scale blocks, the second partial)."""
    torch.manual_seed(3)
    cfg = small_model_config("qwen3_moe", hidden_size=160, moe_intermediate_size=64)
    return mm.build_model(cfg, vocab_size=64).to(torch.bfloat16).eval()


def _engine(policy, weight_dtype):
    cfg = load_config(
        None,
        [f"rollout.weight_dtype={weight_dtype}", "rollout.max_slots=16", "rollout.kv_token_budget=512"],
    )
    engine = make_engine(copy.deepcopy(policy), cfg, version=-1)
    engine.update_weights(policy.state_dict(), 0)  # as a worker's first poll: the full-precision version
    return engine


def _greedy(engine, prompts):
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    reqs = [Request(request_id=str(i), prompt_ids=p, params=params) for i, p in enumerate(prompts)]
    return engine.generate(reqs)


def test_fp8_rollout_of_a_bf16_policy_is_close_to_bf16(policy):
    fp8, bf16 = _engine(policy, "fp8"), _engine(policy, "auto")
    experts = fp8.model.layers[1].mlp.experts
    assert isinstance(experts, Fp8Experts) and experts.down_proj.dtype == FP8_DTYPE
    q, s = quantize_blockwise(policy.layers[1].mlp.experts.down_proj)  # quantized on load, in the engine
    assert torch.equal(experts.down_proj.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(experts.down_proj_scale_inv, s)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (6,), generator=gen).tolist() for _ in range(6)]
    out8, out16 = _greedy(fp8, prompts), _greedy(bf16, prompts)
    gap = logprob_gap(policy, fp8.model, [(c.prompt_ids, c.token_ids) for c in out8])
    assert gap.tokens == 48
    assert 1e-4 < gap.logprob_gap_mean < 0.05 and gap.logprob_gap_max < 0.3
    assert gap.greedy_agreement >= 0.85  # measured 0.958 (46 of 48 positions), gap mean 0.010, max 0.051
    same = sum(a.token_ids == b.token_ids for a, b in zip(out8, out16, strict=True))
    assert same >= 3  # measured 5 of 6 greedy completions identical to bf16's (a flip changes the rest)
    # the control: the bf16 engine is the policy itself (gap 0, full agreement)
    ctrl = logprob_gap(policy, bf16.model, [(c.prompt_ids, c.token_ids) for c in out16])
    assert ctrl.logprob_gap_mean == 0.0 and ctrl.greedy_agreement == 1.0
    # the engine's behaviour log-probs are its FP8 model's (what the mismatch correction compares)
    c = out8[0]
    ids = torch.tensor([c.prompt_ids + c.token_ids])
    logp = torch.log_softmax(fp8.model(ids).logits.float(), -1)[0, 5:-1].gather(-1, ids[0, 6:, None])[:, 0]
    assert torch.allclose(torch.tensor(c.logprobs), logp, atol=2e-2)


def test_weight_dtype_config(policy, monkeypatch):
    with pytest.raises(ConfigError, match="rollout.weight_dtype='int4'"):
        RolloutConfig(weight_dtype="int4")
    monkeypatch.setitem(wd.WEIGHT_DTYPES, "int4", wd.WEIGHT_DTYPES["auto"])  # the choices are the registry's
    assert RolloutConfig(weight_dtype="int4").weight_dtype == "int4"
    monkeypatch.delitem(wd.WEIGHT_DTYPES, "int4")
    cfg = load_config(None, ["rollout.weight_dtype=fp8"])
    assert preset_from_config(cfg.algorithm).mismatch_mode == "truncate"  # the correction is on by default
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(None, ["rollout.weight_dtype=fp8", "algorithm.mismatch_mode=none"])
    assert any("nothing corrects" in str(w.message) for w in caught)
    assert _engine(policy, "bf16").model.lm_head.weight.dtype == torch.bfloat16
    assert set(wd.WEIGHT_DTYPES) == {"auto", "bf16", "fp8"}


def test_engine_weight_bytes_counts_what_the_engine_holds(policy):
    arch = policy.config
    fp8 = _engine(policy, "fp8").model
    held = sum(t.numel() * t.element_size() for t in fp8.state_dict().values())
    assert wd.engine_weight_bytes(arch, torch.bfloat16, "fp8") == held
    bf16 = sum(t.numel() * t.element_size() for t in policy.state_dict().values())
    assert wd.engine_weight_bytes(arch, torch.bfloat16, "auto") == bf16
    assert wd.engine_weight_bytes(arch, torch.float32, "bf16") == bf16
    experts = policy.layers[0].mlp.experts  # EP 2: half the routed experts (1 byte each + their scales)
    routed = sum(t.numel() for t in (experts.gate_up_proj, experts.down_proj)) * 2  # 2 layers
    scales = sum(t.numel() * 4 for n, t in fp8.state_dict().items() if ".experts." in n and "scale" in n)
    assert wd.engine_weight_bytes(arch, torch.bfloat16, "fp8", ep_size=2) == held - (routed + scales) // 2


def test_ep_engine_shards_fp8_experts(policy, tmp_path):
    """``rollout.ep_size > 1`` with FP8: each EP rank holds its experts' FP8 shards and scales. On a
    one-rank gloo group the EP engine decodes the FP8 engine's very tokens and log-probs."""
    import datetime

    import torch.distributed as dist

    from moerl.ep.parallelize import ExpertParallelExperts
    from moerl.rollout.ep_engine import EPEngine

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )  # fmt: skip
    try:
        cfg = load_config(None, ["rollout.weight_dtype=fp8", "rollout.ep_size=2", "rollout.kv_cache=slots"])
        ep = EPEngine(make_engine(copy.deepcopy(policy), cfg, version=-1), dispatcher="alltoall")
        ep.update_weights(policy.state_dict(), 0)  # full precision in, quantized per local shard
        experts = ep.engine.model.layers[1].mlp.experts
        assert isinstance(experts, ExpertParallelExperts) and experts.is_fp8
        q, s = quantize_blockwise(policy.layers[1].mlp.experts.gate_up_proj)
        assert torch.equal(experts.gate_up_proj.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(experts.gate_up_proj_scale_inv, s)
        prompts = [[1, 2, 3, 4], [5, 6, 7]]
        got, want = _greedy(ep, prompts), _greedy(_engine(policy, "fp8"), prompts)
        assert [(c.token_ids, c.logprobs) for c in got] == [(c.token_ids, c.logprobs) for c in want]
    finally:
        dist.destroy_process_group()


def test_fp8_rollout_of_an_mla_model_decodes_on_the_latent_cache():
    """MLA's absorbed decode reads kv_b's matrix itself: an FP8 kv_b is dequantized for it (else the
    einsum of the queries with float8 weights fails). The FP8 engine's greedy tokens and log-probs on the
    latent cache equal a teacher-forced forward of the same FP8 model (float32 activations): the decode is
    checked against its own model, not against the unquantized one, whose near-tied logits FP8 rounding may
    flip. The model is initialized (``init_weights``): ``MoeForCausalLM(cfg)`` alone leaves its parameters
    as ``torch.empty`` made them, whatever the allocator held (an earlier test's tensors: the cause of this
    test failing after tests/unit/test_fp8.py, with NaN log-probs or a flipped token)."""
    from bench.mla_gpu import model_config
    from moerl.models.model import MoeForCausalLM
    from moerl.rollout import Engine, Request, SamplingParams
    from moerl.rollout.weight_dtype import prepare_rollout_model

    torch.manual_seed(0)
    model = MoeForCausalLM(model_config(2, 8, 512, True)).float().eval()
    with torch.no_grad():
        model.init_weights(std=0.1)  # O(0.1) weights: decisive logits
    fp8 = prepare_rollout_model(copy.deepcopy(model), "fp8")
    assert fp8.layers[0].self_attn.kv_b_proj.weight.dtype == FP8_DTYPE
    prompt = list(range(5, 25))
    req = Request(request_id="a", prompt_ids=prompt, params=SamplingParams(max_new_tokens=8, temperature=0.0))
    engine = Engine(fp8, cache="paged", max_slots=4, kv_token_budget=512, block_size=16)
    assert engine.cache.latent
    out = engine.generate([req])[0]
    ids = torch.tensor([prompt + out.token_ids[:-1]])
    with torch.no_grad():
        logp = torch.log_softmax(fp8(ids).logits[0, len(prompt) - 1 :].float(), dim=-1)
    assert out.token_ids == logp.argmax(-1).tolist()
    want = logp.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.logprobs), want, atol=1e-4, rtol=0)
