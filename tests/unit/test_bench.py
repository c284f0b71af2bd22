"""CPU smoke of the one-GPU benchmarks (tiny config) and hand-computed checks of their FLOP/byte counts.

The GPU figures come from bench/gpu_suite.sh on the device machine; here each benchmark runs end to end
on CPU at tiny size (transformers baseline included), writes its JSON, and the summary reads it back.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers  # noqa: F401 - the test extra installs it: missing fails, not skips

from bench import common, moe_layer, rollout_gpu, summarize, train_step

CPU = torch.device("cpu")


def test_spec_counts_match_the_model_and_hand_values():
    spec = common.SPECS["tiny"]
    hf = common.build_hf(spec, CPU, torch.float32)
    assert spec.num_params == sum(p.numel() for p in hf.parameters())
    # tiny: H=64, nh*hd=64, E=8, k=2, I=32, V=256, L=2
    # per layer 4*64*64 attention + 64*8 router + 2 * 3*64*32 experts = 16384 + 512 + 12288; lm_head 64*256
    assert spec.active_matmul_params == 2 * (16384 + 512 + 12288) + 16384
    assert spec.moe_flops_per_token() == 2 * (64 * 8 + 2 * 3 * 64 * 32)
    assert spec.train_flops_per_token(10) == 6 * spec.active_matmul_params + 12 * 2 * 10 * 64
    assert spec.kv_bytes_per_token() == 2 * 2 * 4 * 16 * 2
    ref = common.SPECS["reference"]
    assert abs(ref.num_params / 1e9 - 6.92) < 0.01  # the issue's ~6.9 B


def test_decode_weight_bytes_expected_experts():
    spec = common.SPECS["tiny"]
    # one row touches exactly k=2 of E=8 experts: E (1 - (1 - k/E)^1) = 2
    one = spec.decode_weight_bytes(1)
    per_layer = 4 * 64 * 64 + 64 * 8 + 2 * 3 * 64 * 32
    assert one == pytest.approx(2 * (2 * per_layer + 256 * 64 + 64))
    assert spec.decode_weight_bytes(10_000) == pytest.approx(
        2 * (2 * (4 * 64 * 64 + 64 * 8 + 8 * 3 * 64 * 32) + 256 * 64 + 10_000 * 64)
    )


def test_floor_sums_decode_steps():
    spec = common.SPECS["tiny"]
    f = rollout_gpu.floor_seconds(
        spec, batch=2, prompt_len=3, new_tokens=3, copy_tb_s=1.0, matmul_tflop_s=1.0
    )
    w, kv = spec.decode_weight_bytes(2), spec.kv_bytes_per_token()
    assert f["decode_bytes"] == pytest.approx((w + 2 * 4 * kv) + (w + 2 * 5 * kv))  # steps i = 1, 2
    assert f["tokens_per_s"] == pytest.approx(6 / f["total_s"])


def test_moerl_from_hf_copies_every_tensor():
    spec = common.SPECS["tiny"]
    hf = common.build_hf(spec, CPU, torch.float32, seed=3)
    ours = common.moerl_from_hf(hf, CPU, torch.float32)
    ids = torch.randint(0, spec.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert common.rel_err(ours(ids).logits, hf(input_ids=ids).logits) < 1e-5


def test_time_fn_and_rel_err():
    t = common.time_fn(lambda: None, CPU, warmup=0, iters=3)
    assert t.iters == 3 and 0 <= t.min_ms <= t.median_ms <= t.max_ms
    assert common.rel_err(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 0.0])) == pytest.approx(0.0 + 1.0)
    assert common.rel_err(torch.tensor([float("nan")]), torch.tensor([1.0])) == float("inf")


def test_benchmarks_run_on_cpu_and_summarize(tmp_path, capsys):
    moe = moe_layer.run("tiny", 64, CPU, iters=1, out_dir=tmp_path, check_tokens=32)
    assert set(moe["results"]) == {"transformers", "moerl-reference", "moerl"}
    assert moe["agreement_vs_float32"]["moerl"]["out"] < 1e-5  # float32 on CPU
    tr = train_step.run("tiny", [2], 32, CPU, steps=1, out_dir=tmp_path)
    assert tr["results"]["moerl/b2"]["tokens_per_s"] > 0 and "transformers/b2" in tr["results"]
    ac = train_step.run(
        "tiny",
        [2],
        32,
        CPU,
        steps=1,
        baseline=False,
        out_dir=tmp_path / "ac",
        activation_checkpointing=True,
        micro_batch_size=1,
    )
    assert ac["activation_checkpointing"] and ac["results"]["moerl/b2"]["tokens_per_s"] > 0
    assert ac["results"]["moerl/b2"]["grad_norms"][0] == pytest.approx(
        tr["results"]["moerl/b2"]["grad_norms"][0], rel=1e-4
    )
    ro = rollout_gpu.run("tiny", 2, 4, 3, CPU, runs=1, out_dir=tmp_path)
    assert ro["results"]["moerl"]["tokens"] == 6 and ro["results"]["transformers"]["tokens"] == 6
    assert ro["agreement"]["engine_vs_trainer_logprobs"]["mean_abs_diff"] < 1e-4  # float32
    for name in ("moe_layer", "train_step", "rollout_gpu"):
        assert json.loads((tmp_path / f"{name}.json").read_text())["benchmark"] == name
    capsys.readouterr()
    assert summarize.main([str(tmp_path), "--markdown"]) == 0
    table = capsys.readouterr().out
    assert (
        "| decode B=2 4+3 (tiny)" in table
        and "MoE layer 64 tokens" in table
        and "train step moerl/b2" in table
    )


def test_async_bound_runs_on_cpu(tmp_path, capsys):
    from bench import async_bound

    small = ["trainer.batch_groups=2", "rollout.group_size=2", "rollout.max_slots=8", "task.num_eval=4"]
    args = ["--rounds", "1", "--out-dir", str(tmp_path)] + [a for kv in small for a in ("--set", kv)]
    out = async_bound.main(args)
    m = out["median_s"]
    assert out["sync_step_s"] == pytest.approx(m["G2"] + m["T2"] + m["P"])
    assert out["async_step_floor_s"] == pytest.approx(max(m["G1"], m["T1"] + m["P"]))
    assert out["sharing_slowdown"] > 0 and set(out["train_1_thread_s"]) == {"alone", "beside_generation"}
    assert json.loads((tmp_path / "async_bound.json").read_text())["rounds"] == 1
    assert "async/sync samples/s at most" in capsys.readouterr().out


def test_mla_bench_runs_tiny_on_cpu(tmp_path):
    from bench import mla_gpu

    out = mla_gpu.run(
        ["--tiny", "--layers", "2", "--contexts", "16", "--iters", "1", "--out-dir", str(tmp_path)]
    )
    latent, expanded = out["points"]
    assert (latent["cache"], expanded["cache"]) == ("latent", "expanded")
    assert min(latent["tokens_per_s"], expanded["tokens_per_s"], latent["fraction_of_floor"]) > 0
    cfg = out["model"]  # tiny: 8 heads of nope 4 + rope 2 keys and v 4 values, against a latent of 16 + 2
    heads, nope, rope, v, rank = (cfg[k] for k in ("num_attention_heads", "qk_nope_head_dim",
                                                    "qk_rope_head_dim", "v_head_dim", "kv_lora_rank"))  # fmt: skip
    assert expanded["kv_gb"] / latent["kv_gb"] == pytest.approx(heads * (nope + rope + v) / (rank + rope))
    assert json.loads((tmp_path / "mla_gpu_tiny.json").read_text())["points"][0]["batch"] == 4
