"""Rollout routing replay (R3) on the bench model: how far the trainer's log-probs are from the engine's
with and without replaying the engine's experts, and what recording the experts costs the engine's decode.

    python bench/r3_gpu.py                                                          # CPU smoke (tiny)
    python bench/r3_gpu.py --spec reference --batch 32 --prompt-len 64 \\
        --new-tokens 128 --device cuda                                              # 4096 response tokens

The model is the seeded bench model of ``bench/common.py`` (bf16 on CUDA, float32 on CPU). The engine
(CUDA graphs on CUDA) samples ``--new-tokens`` tokens per prompt at temperature 1 and records the experts it
routed every fed token to (``SamplingParams.return_routed_experts``). The trainer's no-grad forward
(``Trainer.no_grad_logprobs``: shared-prompt forward, ``moerl.rl.token_logprobs``) recomputes the response
log-probs with ``algorithm.routing_replay=off`` (its own top-k) and ``r3`` (the engine's experts forced),
on a copy of the weights in ``--trainer-dtype``. Reported over the response tokens: mean |trainer - engine|
log-prob and the k3 estimate of KL(engine || trainer) per token (``moerl.rl.rollout_mismatch_sums``), the
fraction of (token, layer) expert choices of the free forward that differ from the engine's, and the number
of replayed choices that differ (must be 0).

Decode cost: the same requests timed ``--runs`` times (median, after a warm-up that captures the graphs)
with recording off and on; tokens/s over the whole generate call, and over decode only (minus a prefill-
only run). Writes ``<out-dir>/r3_gpu.json``.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    SPECS,
    add_decode_args,
    bench_dtype,
    bench_parser,
    device_info,
    print_table,
    random_prompts,
    same_weights_pair,
    write_json,
)
from bench.rollout_gpu import engine_for, sampling_requests, time_generate  # noqa: E402
from moerl.config import AlgorithmConfig, TrainerConfig  # noqa: E402
from moerl.records import Group, Lease, RolloutTask, Sample  # noqa: E402
from moerl.rl import rollout_mismatch_sums  # noqa: E402
from moerl.trainer.batch import build_train_batch  # noqa: E402
from moerl.trainer.local import LocalTrainer  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _timed_generate(
    model, prompts, new_tokens: int, runs: int, sync_every: int, record: bool, device
) -> dict:
    """Median tokens/s of one engine's ``generate`` of the requests (recording experts or not)."""
    engine = engine_for(model, len(prompts), len(prompts[0]), new_tokens, sync_every)
    t = time_generate(engine, prompts, new_tokens, 1.0, runs, device, record=record)
    med, prefill = t.median_s, t.prefill_s
    tokens = len(prompts) * new_tokens
    graphs = getattr(engine, "_graphs", None)
    return {
        "seconds": t.seconds,
        "median_s": med,
        "tokens": tokens,
        "tokens_per_s": tokens / med,
        "decode_tokens_per_s": len(prompts) * (new_tokens - 1) / max(med - prefill, 1e-9),
        "cuda_graph_replays": None if graphs is None else graphs.num_replays,
    }


def decode_cost(model, prompts, new_tokens: int, runs: int, sync_every: int, device) -> dict:
    """tokens/s of the same requests with expert recording off and on (one engine each)."""
    out = {
        "off": _timed_generate(model, prompts, new_tokens, runs, sync_every, False, device),
        "on": _timed_generate(model, prompts, new_tokens, runs, sync_every, True, device),
    }
    out["on_over_off"] = out["on"]["tokens_per_s"] / out["off"]["tokens_per_s"]
    out["decode_on_over_off"] = out["on"]["decode_tokens_per_s"] / out["off"]["decode_tokens_per_s"]
    return out


def _batch(completions):
    """One group per completion (its own prompt) as the trainer's ``TrainBatch``."""
    groups = []
    for i, c in enumerate(completions):
        task = RolloutTask(task_id=f"t{i}", prompt_ids=c.prompt_ids, prompt_text="", answer="", num_samples=1)
        sample = Sample(
            prompt_ids=c.prompt_ids,
            response_ids=c.token_ids,
            response_logprobs=c.logprobs,
            loss_mask=[1] * len(c.token_ids),
            finish_reason=c.finish_reason,
            policy_versions=[0] * len(c.token_ids),
            reward=0.0,
            routed_experts=c.routed_experts,
        )
        groups.append(Group.from_lease(Lease(task, "bench", i + 1, 0.0), [sample], 0.0))
    return build_train_batch(groups, pad_id=0, estimator="gae")  # advantages unused: zeros


def replay_agreement(model, completions, trainer_dtype: torch.dtype, micro_batch: int) -> dict:
    """Trainer-vs-engine log-prob gap over the response tokens, free and replayed (see the docstring)."""
    batch = _batch(completions)
    trainer_model = copy.deepcopy(model).to(trainer_dtype).keep_router_buffers_fp32()
    dev = next(trainer_model.parameters()).device
    fed = batch.attention_mask.bool().clone()
    fed[torch.arange(fed.shape[0]), batch.attention_mask.sum(1) - 1] = False  # the last token is never fed
    out = {"tokens": batch.num_tokens}
    for mode in ("off", "r3"):
        trainer = LocalTrainer(
            trainer_model,
            TrainerConfig(micro_batch_size=micro_batch),
            AlgorithmConfig(routing_replay=mode, mismatch_mode="none"),
        )
        logp = trainer.no_grad_logprobs(batch).cpu()
        sums = rollout_mismatch_sums(logp, batch.behaviour_logprobs, batch.loss_mask)
        with torch.no_grad():
            mb = batch  # the experts this forward runs: returned by the model (forced ones under r3)
            routed = trainer_model(
                mb.input_ids.to(dev),
                mb.attention_mask.to(dev),
                forced_experts=mb.routed_experts.to(dev) if mode == "r3" else None,
                return_routed_experts=True,
            ).routed_experts.cpu()
        differ = (routed.sort(-1).values != batch.routed_experts.sort(-1).values).any(-1)[fed]
        out[mode] = {
            "mean_abs_diff": float(sums[0]) / batch.num_tokens,
            "k3_kl": float(sums[1]) / batch.num_tokens,
            "expert_choices_differing_frac": float(differ.float().mean()),
            "expert_choices_differing": int(differ.sum()),
        }
    return out


def run(
    spec_name: str,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    device: torch.device,
    *,
    runs: int = 3,
    sync_every: int = 16,
    trainer_dtype: str | None = None,
    micro_batch: int = 8,
    out_dir: str | None = None,
) -> dict:
    """The whole benchmark; returns the payload written to r3_gpu.json."""
    dtype = bench_dtype(device)
    tdtype = DTYPES[trainer_dtype] if trainer_dtype else dtype
    spec = SPECS[spec_name]
    model = same_weights_pair(spec, device, dtype)[1]
    prompts = random_prompts(spec.vocab_size, batch, prompt_len)
    completions = engine_for(model, batch, prompt_len, new_tokens, sync_every).generate(
        sampling_requests(prompts, new_tokens, 1.0, "a", record=True)
    )
    payload = {
        "benchmark": "r3_gpu",
        **device_info(device),
        "spec": spec.as_dict(),
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "engine_dtype": str(dtype),
        "trainer_dtype": str(tdtype),
        "agreement": replay_agreement(model, completions, tdtype, micro_batch),
        "decode": decode_cost(model, prompts, new_tokens, runs, sync_every, device),
    }
    write_json("r3_gpu", payload, out_dir)
    _print(payload)
    return payload


def _print(p: dict) -> None:
    a, d = p["agreement"], p["decode"]
    print_table(
        f"R3 {p['spec']['name']} engine {p['engine_dtype']} trainer {p['trainer_dtype']} {p['device']}: "
        f"{a['tokens']} response tokens",
        ["trainer forward", "mean |logp diff| (nats)", "k3 KL (nats/token)", "expert choices != engine"],
        [
            [m, a[m]["mean_abs_diff"], a[m]["k3_kl"], f"{a[m]['expert_choices_differing_frac']:.4f}"]
            for m in ("off", "r3")
        ],
    )
    print_table(
        f"decode B={p['batch']} P={p['prompt_len']} N={p['new_tokens']}",
        ["recording", "tokens/s", "decode tokens/s", "graph replays"],
        [
            [k, d[k]["tokens_per_s"], d[k]["decode_tokens_per_s"], d[k]["cuda_graph_replays"]]
            for k in ("off", "on")
        ],
    )
    print(f"recording on / off: {d['on_over_off']:.3f} (decode only {d['decode_on_over_off']:.3f})")


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(__doc__)
    add_decode_args(ap)
    ap.add_argument("--trainer-dtype", choices=sorted(DTYPES), default=None, help="default: the engine's")
    ap.add_argument("--micro-batch", type=int, default=8, help="trainer rows per forward")
    run(**vars(ap.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
