"""moerl.plan.transports and moerl.plan.schedules: hand-computed weight-sync times of each transport, step
times of each schedule, the long tail of a batch, and ``weight_transport`` / ``schedule`` as plan
parameters (``--set``, JSON fields ``weight_sync_s``, ``step_s``, ``tokens_per_s_per_gpu``)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from moerl.cli import main
from moerl.configlib import ConfigError
from moerl.plan.args import CALIBRATION
from moerl.plan.models import get_model
from moerl.plan.predict import (
    Plan,
    checkpoint_tensors,
    ffn_fraction,
    predict,
    set_param,
    sync_setup,
    weight_sync,
)
from moerl.plan.schedules import StepParts, batch_decode_s, longest_response, step_s
from moerl.plan.transports import (
    BENCH_FILE,
    FP8_BYTES,
    TENSOR_FILE,
    SyncConstants,
    SyncSetup,
    constants_of,
    sync_constants,
    sync_time,
)

ROOT = Path(__file__).resolve().parents[2]
CAL = json.loads(CALIBRATION.read_text())
NO_COST = SyncConstants(copy_hbm_fraction=1.0, bucket_s=0.0, pinned_gb_s=10.0, store_gb_s=1.0, hash_gb_s=1e9,
                        apply_tensor_s=0.0, tensor_s=0.0)  # fmt: skip
# 1e9 parameters in bf16 (W = 2 GB), 8 trainer GPUs, 8 rollout GPUs in replicas of 2, 40 GB/s NICs
BASE = SyncSetup(num_params=1e9, wire_bytes=2.0, trainer_gpus=8, rollout_gpus=8, replica_gpus=2, gpus_per_node=8,
                 net_gb_s=40.0, nvlink_gb_s=400.0, copy_gb_s=1000.0, storage_gb_s=2.0, message_s=0.0,
                 bucket_bytes=2**30, consts=NO_COST)  # fmt: skip


def test_sharded_p2p_is_the_busiest_nic():
    # each receiver takes W / g = 1 GB, each sender W x 4 replicas / 8 = 1 GB: 1 GB / 40 GB/s; apply 1 GB at 1000
    t = sync_time(BASE, "sharded_p2p")
    assert t.transfer_s == pytest.approx(0.025) and t.apply_s == pytest.approx(0.001) and t.prepare_s == 0
    fewer_senders = sync_time(replace(BASE, trainer_gpus=2), "sharded_p2p")  # 2 GB x 4 / 2 = 4 GB per sender
    assert fewer_senders.transfer_s == pytest.approx(0.1)


def test_nccl_reshard_moves_each_region_once_then_fans_out():
    # all FFN: striped p2p max(2 GB / 8 senders, 2 GB / (2 x 4 replicas)) / 40, then fan-out 2 GB / 2 / 40
    t = sync_time(BASE, "nccl_reshard")
    assert t.transfer_s == pytest.approx(0.25 / 40 + 1.0 / 40) and t.apply_s == pytest.approx(0.001)
    # unlike sharded_p2p, a sender does not send its shard once per replica: 2 senders carry 1 GB each
    assert sync_time(replace(BASE, trainer_gpus=2), "nccl_reshard").transfer_s == pytest.approx(
        1 / 40 + 1 / 40
    )
    assert sync_time(replace(BASE, rollout_gpus=2), "nccl_reshard").transfer_s == pytest.approx(
        1 / 40
    )  # n = 1
    # 4 pipeline stages taken 2 at a time: each sender's 0.25 GB waits for 2 turns of the rollout side
    staged = sync_time(replace(BASE, pp_stages=4), "nccl_reshard")
    assert staged.transfer_s == pytest.approx(max(2 * 0.25, 0.25) / 40 + 1.0 / 40)
    assert sync_time(replace(BASE, pp_stages=2), "nccl_reshard").transfer_s == pytest.approx(t.transfer_s)
    # a quarter is not FFN: bulk 1.5 GB as above, then the rest (0.5 GB) gathered on rank 0 (7/8 over NVLink)
    # and broadcast, one 1 GiB bucket: gather + broadcast + its apply, less its apply (counted over all W)
    mixed = sync_time(replace(BASE, bulk_fraction=0.75), "nccl_reshard")
    misc = 0.5 * 7 / 8 / 400 + 0.5 / 40
    assert mixed.transfer_s == pytest.approx(0.1875 / 40 + 0.75 / 40 + misc)


def test_nccl_broadcast_gathers_then_sends_the_whole_version_once():
    one = replace(
        BASE, trainer_gpus=1, is_pipelined=False
    )  # no gather; broadcast 2 GB / 40 GB/s, apply 0.001
    assert sync_time(one, "nccl_broadcast").total_s == pytest.approx(0.05 + 0.001)
    gathered = replace(BASE, is_pipelined=False)  # 7/8 of W over NVLink at 400 GB/s: 4.375 ms more
    assert sync_time(gathered, "nccl_broadcast").total_s == pytest.approx(0.051 + 1.75 / 400)
    piped = replace(BASE, bucket_bytes=2e9 / 4)  # 4 buckets: the broadcast + a quarter of the other stages
    assert sync_time(piped, "nccl_broadcast").total_s == pytest.approx(0.05 + (0.001 + 1.75 / 400) / 4)
    # R does not enter but through one message per hop (a pipelined chain)
    assert sync_time(replace(one, rollout_gpus=800), "nccl_broadcast").total_s == pytest.approx(0.051)


def test_delta_fp8_and_bucket_costs():
    delta = replace(BASE, changed_fraction=0.1)  # 10% with a 4-byte index each: 0.3 of W on the wire
    assert delta.bytes_on_wire == pytest.approx(0.6e9)
    assert sync_time(delta, "sharded_p2p").prepare_s == pytest.approx(1e9 / 8 * 4 / 1e12)  # compare pass
    assert replace(BASE, changed_fraction=0.9).bytes_on_wire == pytest.approx(2e9)  # never more than whole
    fp8 = replace(BASE, wire_bytes=FP8_BYTES, is_fp8_requant=True)
    assert sync_time(fp8, "sharded_p2p").transfer_s == pytest.approx(0.025 * FP8_BYTES / 2)
    assert sync_time(fp8, "sharded_p2p").prepare_s == pytest.approx(1e9 / 8 * (2 + FP8_BYTES) / 1e12)
    costly = replace(BASE, consts=replace(NO_COST, bucket_s=0.01), bucket_bytes=2**27)  # 128 MiB
    assert sync_time(costly, "nccl_broadcast").buckets_s == pytest.approx(0.01 * 15)  # ceil(2e9 / 2^27)


def test_staged_and_stored_paths():
    staged = replace(BASE, trainer_gpus=1, is_pipelined=False)  # d2h 2 GB at 10, send at 40, h2d 1 GB at 10
    assert sync_time(staged, "checkpoint_engine").total_s == pytest.approx(0.2 + 0.05 + 0.1 + 0.001)
    two = replace(staged, trainer_gpus=2)  # each stages half: d2h 0.1 s (the gather is the broadcast's own)
    assert sync_time(two, "checkpoint_engine").total_s == pytest.approx(0.1 + 0.05 + 0.1 + 0.001)
    # one training node writes 2 GB at 2 GB/s; a rollout node reads its 4 replicas' shards (4 x 1 GB... = W x 4)
    stored = sync_time(BASE, "object_store")
    assert stored.transfer_s == pytest.approx(1.0 + 8e9 / 2e9, rel=1e-6)
    assert sync_time(BASE, "cuda_ipc").total_s == pytest.approx(0.001)  # its 1 GB copied on the device
    with pytest.raises(ConfigError, match="unknown weight_transport 'pigeon'"):
        sync_time(BASE, "pigeon")


def test_weight_sync_constants_are_derived_from_moerls_bench_not_fitted():
    bench = json.loads((ROOT / "bench" / "results" / BENCH_FILE).read_text())
    gather = json.loads((ROOT / "bench" / "results" / TENSOR_FILE).read_text())
    assert constants_of(CAL) == sync_constants(bench, gather)
    c = sync_constants(bench, gather)  # the bench's own figures: 13.8 GB, 49 buckets, one H200
    assert c.pinned_gb_s == pytest.approx(bench["weight_bytes"] / bench["floors_s"]["pinned_host_copy"] / 1e9)
    assert 0 < c.bucket_s < 0.01 and 0 < c.copy_hbm_fraction < 1
    # per tensor: the engine copy above the flat copy over the bench's 179 tensors; the 1-rank gather's CPU
    ipc, floor = bench["results"]["cuda_ipc"], bench["floors_s"]["device_copy (CUDA IPC floor)"]
    assert c.apply_tensor_s == pytest.approx((ipc["engine_copy_s"] - floor) / 179)
    assert c.tensor_s == gather["results"]["world_1"]["iter_full_tensors"]["cpu_s_per_tensor"] > 0
    with pytest.raises(ConfigError, match="lacks 'floors_s'"):
        sync_constants({"weight_bytes": 1, "results": {}}, gather)
    with pytest.raises(ConfigError, match="lacks 'world_1'"):
        sync_constants(bench, {"results": {}})


def test_schedules_step_times():
    parts = StepParts(gen_batch_s=10, gen_stream_s=4, train_s=6, sync_s=1)
    kw = {"sync_overlap": 0.0, "max_staleness": 1}
    assert step_s("colocated", parts, **kw) == step_s("sync", parts, **kw) == 17
    assert step_s("one_step_off", parts, **kw) == 11
    assert step_s("fully_async", parts, **kw) == 6  # trainer-bound: max(4 + 1, 6)
    assert step_s("fully_async", replace(parts, train_s=2), **kw) == 5  # rollout-bound, the sync paused it
    assert step_s("fully_async", replace(parts, train_s=2), sync_overlap=1.0, max_staleness=1) == 4
    assert step_s("fully_async", parts, sync_overlap=0.0, max_staleness=0) == 17  # on-policy: takes turns
    with pytest.raises(ValueError, match="unknown schedule"):
        step_s("eventually", parts, **kw)


def test_long_tail_of_a_batch():
    assert longest_response(1000, 0.0, 4096) == 1000
    assert longest_response(1000, 0.5, 4096, limit=2000) == 2000
    # Gamma(shape 4): the 1 - 1/4097 quantile is ~3.7 means (scipy.stats.gamma.ppf(1 - 1/4097, 4, scale=250) = 3705.77)
    assert longest_response(1000, 0.5, 4096) == pytest.approx(3705.77, rel=1e-4)
    one_s = lambda rows, ctx: 1.0  # noqa: E731 - every decode step takes a second
    kw = {"num_responses": 64, "prompt_len": 10, "mean": 100, "cv": 0.0}
    assert batch_decode_s(one_s, per_replica=8, rows=8, **kw) == pytest.approx(100)
    assert batch_decode_s(one_s, per_replica=16, rows=8, **kw) == pytest.approx(200)  # 8 wait for a row
    # steps cost their rows: the tail drains, so fewer row-seconds than a full batch to the longest
    by_rows = lambda rows, ctx: rows  # noqa: E731
    tail = batch_decode_s(by_rows, per_replica=8, rows=8, num_responses=64, prompt_len=10, mean=100, cv=0.5)
    assert 8 * 100 * 0.9 < tail < 8 * longest_response(100, 0.5, 64)


def test_plan_fields_and_json_point(tmp_path, capsys):
    cheap = {"preset": "bench-reference"}
    out = tmp_path / "p.json"
    argv = ["plan", "--preset", cheap["preset"], "--set", "weight_transport=nccl_broadcast", "--set",
            "schedule=one_step_off", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    point = json.loads(out.read_text())["points"][0]
    plan, pr = point["plan"], point["predictions"][0]
    assert pr["schedule"] == "one_step_off" and pr["weight_transport"] == "nccl_broadcast"
    assert pr["step_s"] == pytest.approx(max(pr["gen_batch_s"], pr["train_step_s"]) + pr["weight_sync_s"])
    gpus = plan["total_nodes"] * 8
    tokens = plan["prompts_per_step"] * plan["group_size"] * (plan["prompt_len"] + plan["response_len"])
    assert pr["tokens_per_s_per_gpu"] == pytest.approx(tokens / (pr["step_s"] * gpus))
    assert "schedule one_step_off, weight transport nccl_broadcast" in capsys.readouterr().out
    assert main(["plan", "--set", "weight_transport=cuda_ipc"]) == 2
    assert "needs schedule=colocated" in capsys.readouterr().err
    assert main(["plan", "--set", "weight_transport=pigeon"]) == 2
    err = capsys.readouterr().err.strip()
    assert "weight_transport must be one of nccl_broadcast" in err and "\n" not in err


def test_transport_and_schedule_change_the_prediction():
    p = Plan(
        model="qwen3-30b-a3b",
        router_groups=1,
        topk_groups=1,
        total_nodes=4,
        train_nodes=2,
        rollout_ep_nodes=1,
    )
    sharded, bcast = (
        weight_sync(set_param(p, "weight_transport", t), CAL).total_s
        for t in ("sharded_p2p", "nccl_broadcast")
    )
    assert bcast > 4 * sharded  # 16 trainer GPUs send in parallel; one broadcasts everything
    fp8 = weight_sync(set_param(p, "sync_fp8", "true"), CAL).total_s
    assert fp8 < sharded
    steps = {s: predict(set_param(p, "schedule", s), CAL)[0] for s in ("sync", "one_step_off", "fully_async")}
    assert steps["fully_async"].step_s < steps["one_step_off"].step_s < steps["sync"].step_s
    assert (
        steps["sync"].gen_batch_s
        > steps["sync"].step_s - steps["sync"].train_step_s - steps["sync"].weight_sync_s - 1e-9
    )


def test_ffn_fraction_and_pipeline_stages_reach_the_reshard():
    qwen, dsv3 = get_model("qwen3-30b-a3b"), get_model("deepseek-v3")
    assert ffn_fraction(qwen) == pytest.approx(48 * 128 * 3 * 2048 * 768 / qwen.num_params)  # ~0.950
    # DeepSeek-V3: 58 MoE layers of 256 experts plus 3 dense FFNs of width 18432; the shared expert is not FFN
    ffn = 58 * 256 * 3 * 7168 * 2048 + 3 * 3 * 7168 * 18432
    assert ffn_fraction(dsv3) == pytest.approx(ffn / dsv3.num_params)  # ~0.976
    p = Plan(model="qwen3-235b-a22b", router_groups=1, topk_groups=1, total_nodes=32, train_nodes=16,
             rollout_ep_nodes=1, rollout_tp=8, schedule="one_step_off", weight_transport="nccl_reshard")  # fmt: skip
    one, eight = (weight_sync(set_param(p, "train_pp_stages", n), CAL).transfer_s for n in (1, 8))
    assert eight > one  # 8 stages, 2 at a time: the senders' term is 4 turns long


def test_per_tensor_gather_and_load():
    """A sharded sender gathers each tensor whole (t_g of host each), issued while the GPU moves the bytes:
    the gather stage is the larger of the two; every receiver loads its tensors at t_a each."""
    costs = replace(NO_COST, tensor_s=1e-3, apply_tensor_s=1e-5)
    s = replace(BASE, is_pipelined=False, consts=costs, num_tensors=1000, receiver_tensors=600)
    t = sync_time(s, "nccl_broadcast")  # gather max(1.75 GB / 400, 1000 x 1 ms) + broadcast 0.05 + apply
    assert t.transfer_s == pytest.approx(1.0 + 0.05) and t.apply_s == pytest.approx(0.001 + 600 * 1e-5)
    few = replace(s, num_tensors=1)  # bytes bound again: 4.375 ms
    assert sync_time(few, "nccl_broadcast").transfer_s == pytest.approx(1.75 / 400 + 0.05)
    alone = replace(s, trainer_gpus=1)  # an unsharded trainer gathers nothing
    assert sync_time(alone, "nccl_broadcast").transfer_s == pytest.approx(0.05)
    # the reshard's misc broadcast gathers only the non-FFN tensors: 1000 - 900 = 100 of them
    mixed = replace(s, bulk_fraction=0.75, bulk_tensors=900)
    misc = max(0.5 * 7 / 8 / 400, 100 * 1e-3) + 0.5 / 40
    assert sync_time(mixed, "nccl_reshard").transfer_s == pytest.approx(0.1875 / 40 + 0.75 / 40 + misc)
    assert sync_time(s, "cuda_ipc").transfer_s == pytest.approx(1.0)  # colocated sharded trainer gathers too
    assert sync_time(s, "object_store").transfer_s == pytest.approx(1.0 + 8e9 / 2e9 + 1.0, rel=1e-6)
    for shards_as_they_lie in ("sharded_p2p", "checkpoint_engine"):
        assert (
            sync_time(s, shards_as_they_lie).transfer_s
            == sync_time(replace(s, consts=replace(costs, tensor_s=0.0)), shards_as_they_lie).transfer_s
        )


def test_checkpoint_tensors_from_the_shapes():
    # Qwen3-30B-A3B: 48 layers x (q, k, v, o, 2 norms, router, 128 x 3 experts) + embedding, norm, lm_head
    assert checkpoint_tensors(get_model("qwen3-30b-a3b")) == (48 * 391 + 3, 48 * 384, 48 * 384)
    # DeepSeek-V3: MLA with q LoRA (7) + 2 norms per layer; 58 MoE layers: router, 256 x 3, one shared MLP;
    # 3 dense FFNs
    ds = checkpoint_tensors(get_model("deepseek-v3"))
    assert ds == (61 * 9 + 58 * (1 + 768 + 3) + 3 * 3 + 3, 58 * 768 + 9, 58 * 768)
    p = Plan(model="qwen3-30b-a3b", router_groups=1, topk_groups=1, total_nodes=4, train_nodes=2,
             rollout_ep_nodes=1)  # fmt: skip
    ep = sync_setup(p, CAL)  # an EP replica of 8 GPUs loads the non-expert tensors and 1/8 of the experts'
    assert ep.num_tensors == 18771 and ep.receiver_tensors == 18771 - 18432 + 18432 // 8
    assert sync_setup(set_param(p, "rollout_tp", 4), CAL).receiver_tensors == 18771  # TP: a slice of each
