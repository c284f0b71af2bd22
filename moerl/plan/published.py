"""``moerl plan --published``: the planner's predictions of figures other projects published, never fitted.

Each ``Figure`` holds a published value (a number or a range), the source file it was read from (repository
and path), and the setup of the run behind it as ``Plan`` parameters: GPU counts, batch, sequence lengths,
parallelism, schedule and transport, read from the same source or the recipe it names (``setup_source``).
Where a source does not state an input, the figure's ``assumed`` names the value used and why; no such value
was chosen by comparing a prediction with the figure. The planner's constants come from moerl's own
measurements (``calibration.json``) and datasheets only: nothing in this module feeds them, and
``tests/unit/test_plan_published.py`` checks that editing a published figure changes no constant and no
prediction, only the ratio.

A prediction is within the bound when |predicted / published - 1| <= ``BOUND`` (a range: inside it, or within
the bound of its nearest end). Misses are printed as misses.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moerl.plan.inputs import Plan, with_params
from moerl.plan.predict import predict, sync_setup
from moerl.plan.transports import sync_time

BOUND = 0.30
"""Largest |predicted / published - 1| counted as a hit (issue 53)."""

NEMO_REFIT = "NVIDIA-NeMo/RL: tools/refit_bandwidth_calculator.py (_NCCL_ANCHORS)"
NEMO_PERF = "NVIDIA-NeMo/RL: docs/about/performance-summary.md (v0.6, H100 BF16)"
NEMO_RECIPES = "NVIDIA-NeMo/RL: examples/configs/recipes/llm/performance/"
VERL_ASYNC = "volcengine/verl: docs/advance/fully_async.md"
VERL_SCRIPTS = "volcengine/verl: verl/experimental/fully_async_policy/shell/"
VERL_CKPT = "volcengine/verl: verl/checkpoint_engine/README.md"


@dataclass(frozen=True, slots=True, kw_only=True)
class Figure:
    """One published figure and the setup behind it."""

    key: str
    """Short name in the table."""
    quantity: str
    """``weight_sync_s``, ``step_s`` or ``tokens_per_s_per_gpu`` (a ``Prediction`` field of that name)."""
    low: float
    high: float
    """The published value (low == high) or range, in the quantity's unit."""
    source: str
    """Repository and file the figure is read from."""
    setup: dict
    """``Plan`` parameters of the run behind it."""
    setup_source: str
    """Where the setup's values come from."""
    assumed: str = ""
    """Inputs the sources do not state and the value used."""
    sync_gb: float = 0.0
    """> 0: the bytes of one sync as published (GB; the refit calculator's ``model_size_gb``) instead of the
    model's parameter count x 2."""
    sync_gpus: tuple[int, int] = (0, 0)
    """(trainer GPUs, rollout GPUs) of a sync benchmark that uses part of its nodes; (0, 0): the plan's."""


_QWEN = {"router_groups": 1, "topk_groups": 1, "rollout_ep_nodes": 1}
"""Qwen models route over all experts (no group limit); replicas of one node unless a figure says more."""
_H100 = {"hardware": "dgx-h100", **_QWEN}
_H20 = {"hardware": "h20", "prompts_per_step": 512, "group_size": 16, "prompt_len": 256, "rollout_rows_per_gpu": 64,
        **_QWEN}  # fmt: skip
"""verl's 128-H20 runs: 512 prompts x 16 (docs/advance/fully_async.md); a vLLM server (TP 4) decodes at most 256
sequences at once (verl at b178a3cd5: verl/trainer/config/rollout/rollout.yaml:68 ``max_num_seqs: 256``; the
fully async rollouter also keeps at most 16 prompts x n = 16 in flight per server,
verl/experimental/fully_async_policy/fully_async_rollouter.py:207): 64 rows per GPU."""
_VERL_ASYNC = {"schedule": "fully_async", "max_staleness": 1, "weight_transport": "nccl_broadcast",
               "sync_pipelined": False, "sync_bucket_mb": 4096}  # fmt: skip
_VERL_COLO = {"schedule": "colocated", "weight_transport": "cuda_ipc", "train_nodes": 8}
_VERL_STEP = (
    "; a fully async 'step' (verl at b178a3cd5) is one parameter version, 512 prompts: the trainer's "
    "timing_s/step summed over trigger_parameter_sync_step = 4 local steps of 128 prompts (verl/experimental/fully_async_policy/"
    "detach_utils.py:219, 255-256 time_sum; fully_async_trainer.py:320 the timer, 343 the sync after it, "
    "so the sync is not in the step; docs/advance/fully_async.md:371 total_rollout_steps 512*400 over 400 "
    "steps)"
)
_VERL_ASSUMED = (
    "prompt 256 tokens and mean response = max / 4 (not published; DAPO, arXiv:2503.14476, reports means "
    "of about a quarter of its 20K limit); response cv 0.5 (planner default)"
)
_NEMO_REFIT_SETUP = (
    "transport: NCCL reshard refit (tools/refit_bandwidth_calculator.py at 4527bfb:19 'measured H100 reshard "
    "results on 400 Gbps/rank InfiniBand', :57 'with generation EP enabled'; docs/design-docs/"
    "nccl-reshard-refit.md:58-80 bulk FFN path and misc packed broadcast, :256-257 each region moved once, "
    "then fanned out to replicas, :51-54 and :159 pipeline stages two at a time (NRL_REFIT_NUM_STREAMS); "
    "nemo_rl/models/policy/workers/megatron_policy_worker.py:2898-2905 misc after bulk); packed buffer 2% of the GPU's 80 GB = 1526 MiB (nemo_rl/utils/packed_tensor.py:25,30)"
)
_NEMO_REFIT_ASSUMED = (
    "the anchors name neither model nor GPUs ('indexed model GB' only): the bytes are the published ones and "
    "the trainer/generation split and generation TP are those of the non-colocated recipe named"
)
NEMO_REFIT_BUCKET_MB = round(0.02 * 80e9 / 2**20)
"""NeMo-RL's packed-broadcast buffer: NRL_REFIT_BUFFER_MEMORY_RATIO 0.02 of the GPU's memory (H100: 80 GB),
at most 5 GiB (``nemo_rl/utils/packed_tensor.py`` lines 25, 30)."""


def _refit(
    key: str, gb: float, low: float, high: float, model: str, recipe: str, assumed: str = ""
) -> Figure:
    """A refit anchor of NeMo-RL's calculator, set up as ``recipe``: "name.yaml (total nodes, generation
    nodes, generation TP, training PP; lines)"."""
    nodes, gen_nodes, tp, pp = (int(x) for x in recipe.split("(")[1].split(";")[0].split(","))
    setup = {**_H100, "model": model, "total_nodes": nodes, "train_nodes": nodes - gen_nodes,
             "rollout_tp": min(tp, 8), "rollout_ep_nodes": max(1, tp // 8), "weight_transport": "nccl_reshard",
             "schedule": "one_step_off", "sync_bucket_mb": NEMO_REFIT_BUCKET_MB, "train_pp_stages": pp}  # fmt: skip
    if tp > 8:  # a replica over several nodes: EP over whole nodes instead of TP
        setup["rollout_tp"] = 0
    if model == "deepseek-v3":  # group-limited routing, 4 of 8 groups (DeepSeek-V3 sec. 2.1.2)
        setup.update(router_groups=8, topk_groups=4)
    return Figure(key=key, quantity="weight_sync_s", low=low, high=high, source=NEMO_REFIT, setup=setup,
                  setup_source=f"{NEMO_RECIPES}{recipe}; {_NEMO_REFIT_SETUP}",
                  assumed="; ".join(x for x in (_NEMO_REFIT_ASSUMED, assumed) if x), sync_gb=gb)  # fmt: skip


def _nemo_perf(
    key: str, value: float, model: str, nodes: int, prompts: int, seq: int, max_seq: int, **kw
) -> Figure:
    setup = {**_H100, "model": model, "total_nodes": nodes, "train_nodes": nodes // 2, "schedule": "colocated",
             "weight_transport": "cuda_ipc", "prompts_per_step": prompts, "group_size": 32, "prompt_len": 256,
             "response_len": seq - 256, "max_response_len": max_seq - 256, "logprob_passes": 2, **kw}  # fmt: skip
    return Figure(key=key, quantity="tokens_per_s_per_gpu", low=value, high=value, source=NEMO_PERF, setup=setup,
                  setup_source=f"{NEMO_PERF} (GPUs, G-average seq len, T-max, parallelism); {NEMO_RECIPES} "
                  "(prompts x 32 generations; reference KL 0.01 in grpo_math_1B.yaml: policy + reference "
                  "log-prob passes)",
                  assumed="prompt 256 tokens of the average sequence (not published)")  # fmt: skip


PUBLISHED: tuple[Figure, ...] = (
    _refit(
        "NeMo-RL refit 63.2 GB",
        63.2,
        0.84,
        1.60,
        "qwen3-30b-a3b",
        "grpo-qwen3-30ba3b-4n8g-async-1off.yaml (4, 2, 2, 2; lines 35, 23, 27, 16)",
        "63.2 GB read as the 30B-A3B recipe's model (61 GB in bf16 by the planner's count)",
    ),
    _refit(
        "NeMo-RL refit 247.2 GB",
        247.2,
        1.46,
        1.74,
        "qwen3-235b-a22b",
        "grpo-nemotron3-super-120BA12B-32n8g-async-1off.yaml (32, 24, 8, 1; lines 62, 44, 47; "
        "PP from grpo_math_1B.yaml:219)",
        "247.2 GB is the 120B model (calculator :75 'the latest 120B measurement'; "
        "docs/design-docs/sparse-delta-refit.md:601): Nemotron-3-Super-120B-A12B, a hybrid Mamba MoE the "
        "planner cannot shape; Qwen3-235B-A22B's FFN fraction (0.966) stands in: Mamba mixers ride the "
        "misc path, so the prediction is a lower bound",
    ),
    _refit(
        "NeMo-RL refit 470.2 GB",
        470.2,
        2.31,
        2.73,
        "qwen3-235b-a22b",
        "grpo-qwen3-235b-32n8g-async-1off.yaml (32, 16, 8, 8; lines 34, 22, 25, 16)",
    ),
    _refit(
        "NeMo-RL refit 1342 GB",
        1342.0,
        3.27,
        3.46,
        "deepseek-v3",
        "grpo-deepseek-v3-64n8g-async-1off.yaml (64, 32, 32, 16; lines 33, 21, 24, 15)",
    ),
    *(
        Figure(
            key=f"verl ckpt engine {backend}",
            quantity="weight_sync_s",
            low=7.0,
            high=7.0,
            source=VERL_CKPT,
            setup={
                **_H100,
                "model": "qwen3-30b-a3b",
                "total_nodes": 4,
                "train_nodes": 1,
                "rollout_tp": 1,
                "weight_transport": "nccl_broadcast",
                "schedule": "one_step_off",
                "sync_pipelined": True,
                "sync_bucket_mb": 2048,
            },
            setup_source=f"{VERL_CKPT} (at 6f33c553b, lines 24-25, 35-36): 4x8 H100, CX7 400 Gb/s IB, trainer "
            f"FSDP world size 2, 30 rollouts each receiving the whole model; {backend} = all_gather + "
            f"{'broadcast' if backend == 'NCCL' else 'ring p2p'} (a pipelined chain: the broadcast term); "
            "buckets of 2 GiB (tests/checkpoint_engine/test_nccl_checkpoint_engine.py:52 at 6f33c553b), two "
            "alternating: bucket k + 1 is filled while k is broadcast, and received while k is handed on "
            "(verl/checkpoint_engine/nccl_checkpoint_engine.py:231-246, 305-331 at 6f33c553b): pipelined",
            assumed="the NIXL ring moves the same bytes per hop as the NCCL broadcast; the trainer's fp32 gather "
            "(nccl_checkpoint_engine.py:226) is counted in bf16 bytes: over NVLink, under the per-tensor term; "
            "per tensor (the term that bounds it): the sender gathers each of the 18,771 tensors whole "
            "(tests/checkpoint_engine/test_utils.py:37 get_per_tensor_param; verl/workers/engine/fsdp/"
            "transformer_impl.py:656, 670 state_dict() then full_tensor() of each DTensor) and casts and copies "
            "it into the bucket (nccl_checkpoint_engine.py:225-261), at moerl's own measured host cost per "
            "tensor (iter_full_tensors, bench/tensor_gather.py); the receivers only clone each tensor "
            "(test_utils.py:64; README.md:25 'only receive weight without cuda ipc to vllm/sglang')",
            sync_gpus=(2, 30),
        )  # fmt: skip
        for backend in ("NCCL", "NIXL")
    ),
    Figure(
        key="verl 7B colocated 128",
        quantity="step_s",
        low=356.30,
        high=356.30,
        source=VERL_ASYNC,
        setup={
            **_H20,
            **_VERL_COLO,
            "model": "qwen2.5-7b",
            "total_nodes": 16,
            "rollout_tp": 4,
            "response_len": 28672 // 4,
            "max_response_len": 28672,
            "logprob_passes": 1,
        },
        setup_source=f"{VERL_ASYNC} (128 H20, 512 prompts x 16, max response 28K, old_log_prob pass, no KL); "
        f"{VERL_SCRIPTS}dapo_7b_math_fsdp2_64_64.sh (gen_tp 4)",
        assumed=_VERL_ASSUMED,
    ),  # fmt: skip
    Figure(
        key="verl 7B async 64:64",
        quantity="step_s",
        low=150.63,
        high=150.63,
        source=VERL_ASYNC,
        setup={
            **_H20,
            **_VERL_ASYNC,
            "model": "qwen2.5-7b",
            "total_nodes": 16,
            "train_nodes": 8,
            "rollout_tp": 4,
            "response_len": 28672 // 4,
            "max_response_len": 28672,
            "logprob_passes": 0,
        },
        setup_source=f"{VERL_ASYNC} (64 rollout : 64 trainer H20, staleness 0.5 with partial rollouts, rollout "
        f"log-probs, NCCL checkpoint engine); {VERL_SCRIPTS}dapo_7b_math_fsdp2_64_64.sh (require_batches 4 x "
        f"ppo_mini_batch 32, trigger_parameter_sync_step 4, use_rollout_log_probs, no KL){_VERL_STEP}",
        assumed=_VERL_ASSUMED + "; verl's staleness 0.5 of a batch as the planner's bound of 1 version",
    ),  # fmt: skip
    Figure(
        key="verl 30B colocated 128",
        quantity="step_s",
        low=497.89,
        high=497.89,
        source=VERL_ASYNC,
        setup={
            **_H20,
            **_VERL_COLO,
            "model": "qwen3-30b-a3b",
            "total_nodes": 16,
            "rollout_tp": 4,
            "response_len": 8192 // 4,
            "max_response_len": 8192,
            "logprob_passes": 2,
        },
        setup_source=f"{VERL_ASYNC} (128 H20, 512 x 16, max response 8K, old_log_prob and ref passes); "
        f"{VERL_SCRIPTS}grpo_30b_a3b_base_math_megatron_96_32.sh (INFER_TP 4, EP 8)",
        assumed=_VERL_ASSUMED + "; the colocated script is not published: if it shares the 96:32 script's "
        "enforce_eager=True (line 192), its decode has no CUDA graphs, which the planner does not model",
    ),  # fmt: skip
    Figure(
        key="verl 30B async 96:32",
        quantity="step_s",
        low=282.75,
        high=282.75,
        source=VERL_ASYNC,
        setup={
            **_H20,
            **_VERL_ASYNC,
            "model": "qwen3-30b-a3b",
            "total_nodes": 16,
            "train_nodes": 4,
            "rollout_tp": 4,
            "response_len": 8192 // 4,
            "max_response_len": 8192,
            "logprob_passes": 1,
        },
        setup_source=f"{VERL_ASYNC} (96 rollout : 32 trainer H20, ref pass, staleness 0.5, partial rollouts); "
        f"{VERL_SCRIPTS}grpo_30b_a3b_base_math_megatron_96_32.sh (lines 105, 109-110: mini-batch 128 x 1, sync every "
        f"4; 24 use_kl_loss: the ref pass; 229 rollout log-probs){_VERL_STEP}",
        assumed=_VERL_ASSUMED + "; staleness 0.5 as a bound of 1 version; not modelled: the optimizer and "
        "parameter offload (lines 50, 54, 145-153) and vLLM's enforce_eager=True (line 192; the planner's "
        "decode step is graphed)",
    ),  # fmt: skip
    _nemo_perf("NeMo-RL 30B on-policy 32", 1102, "qwen3-30b-a3b", 4, 64, 3203, 4096, rollout_tp=2),
    _nemo_perf(
        "NeMo-RL 235B on-policy 128",
        58.9,
        "qwen3-235b-a22b",
        16,
        16,
        5698,
        8192,
        rollout_tp=0,
        rollout_ep_nodes=2,
        train_ep_nodes=2,
    ),
    _nemo_perf(
        "NeMo-RL 235B on-policy 256",
        37.4,
        "qwen3-235b-a22b",
        32,
        16,
        5713,
        8192,
        rollout_tp=0,
        rollout_ep_nodes=2,
        train_ep_nodes=2,
    ),
)
"""The figures of issue 53, in its order."""


def figure_plan(fig: Figure) -> Plan:
    """The ``Plan`` of ``fig``'s setup. Raises ConfigError as ``with_params``."""
    return with_params(Plan(), fig.setup)


def predict_figure(fig: Figure, cal: dict) -> tuple[float, dict[str, float]]:
    """The planner's value of ``fig.quantity`` for ``fig``'s setup and the parts it adds up from, seconds
    (flat dispatcher where EP matters: the published engines use all-to-all dispatch)."""
    plan = figure_plan(fig)
    if fig.quantity == "weight_sync_s":
        setup = sync_setup(plan, cal)
        if fig.sync_gb:
            setup = replace(setup, num_params=fig.sync_gb * 1e9 / 2)
        if fig.sync_gpus != (0, 0):
            setup = replace(setup, trainer_gpus=fig.sync_gpus[0], rollout_gpus=fig.sync_gpus[1])
        t = sync_time(setup, plan.weight_transport)
        return t.total_s, {
            "prepare": t.prepare_s,
            "transfer": t.transfer_s,
            "apply": t.apply_s,
            "buckets": t.buckets_s,
        }
    pr = predict(plan, cal)[0]
    parts = {
        "gen batch": pr.gen_batch_s,
        "train": pr.train_step_s,
        "sync": pr.weight_sync_s,
        "step": pr.step_s,
    }
    return getattr(pr, fig.quantity), parts


def error_of(predicted: float, low: float, high: float) -> float:
    """predicted / published - 1 against the nearest end of [low, high]; 0 inside it."""
    if low <= predicted <= high:
        return 0.0
    return predicted / (low if predicted < low else high) - 1


def published_rows(cal: dict) -> list[dict]:
    """One row per ``PUBLISHED`` figure: {key, quantity, published, predicted, ratio, error, hit, setup,
    source, setup_source, assumed, sync_gb, parts}; ``ratio`` is predicted over the published value (a
    range's midpoint)."""
    rows = []
    for fig in PUBLISHED:
        pred, parts = predict_figure(fig, cal)
        err = error_of(pred, fig.low, fig.high)
        published = f"{fig.low:g}" if fig.low == fig.high else f"{fig.low:g}-{fig.high:g}"
        rows.append({"key": fig.key, "quantity": fig.quantity, "published": published, "predicted": pred,
                     "ratio": pred / ((fig.low + fig.high) / 2), "error": err, "hit": abs(err) <= BOUND,
                     "setup": fig.setup, "source": fig.source, "setup_source": fig.setup_source,
                     "assumed": fig.assumed, "sync_gb": fig.sync_gb, "parts": parts, "sync_gpus": fig.sync_gpus})  # fmt: skip
    return rows
