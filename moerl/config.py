"""Run configuration: one dataclass per component, loaded from YAML, overridden from the CLI.

Every component takes only its own config (``RolloutConfig``, ``TrainerConfig``, ...). Each is a
``@dataclass(kw_only=True, slots=True)`` that validates itself in ``__post_init__`` and raises
``ConfigError`` naming the field, the bad value and the allowed range. ``RunConfig`` composes them.

A YAML run config mirrors the nesting (``trainer: {lr: 1e-5}``); ``--set trainer.lr=1e-5`` overrides
one field, its value parsed as YAML. Unknown keys are an error that suggests the closest valid key.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from moerl.atomic import atomic_write_text
from moerl.choices import DTYPE_NAMES, MODEL_FAMILIES
from moerl.config_algorithm import (  # noqa: F401 - re-exported
    AlgorithmConfig,
    check_algorithm_combination,
    check_group_samples,
)
from moerl.config_cluster import ClusterConfig, StorageConfig  # noqa: F401 - re-exported
from moerl.config_engine import check_engine_sizes, engine_slot_tokens  # noqa: F401 - re-exported
from moerl.config_env import EnvConfig, check_episode_run  # noqa: F401 - re-exported
from moerl.config_fleet import ChaosConfig, FleetConfig  # noqa: F401 - re-exported
from moerl.config_paths import INPUT_PATHS, resolve_paths  # noqa: F401 - re-exported
from moerl.config_reward import RewardConfig  # noqa: F401 - re-exported
from moerl.config_trainer import TrainerConfig  # noqa: F401 - re-exported
from moerl.configlib import (  # noqa: F401 - re-exported: the config API lives here
    ConfigError,
    apply_overrides,
    check_choice,
    check_range,
    from_dict,
    to_dict,
    yaml_problem,
)

# ----------------------------------------------------------------------------------------------
# Components

DATASET_TASKS = ("dataset", "jsonl")
"""Task names that read ``task.path`` (``jsonl`` is the older name of ``dataset``)."""


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The policy model: a Hugging Face checkpoint folder, or a fresh model of the given shape."""

    path: str | None = None
    """Hugging Face model folder (config.json + safetensors). ``None``: initialize from the fields below."""
    family: str = "qwen3_moe"
    """Architecture for a fresh model (``model_type`` of transformers): qwen3_moe, qwen2_moe, mixtral, olmoe, deepseek_v3, glm4_moe."""
    hidden_size: int = 64
    """Model width D for a fresh model."""
    num_layers: int = 2
    """Decoder layers for a fresh model."""
    num_heads: int = 4
    """Attention (query) heads for a fresh model."""
    num_kv_heads: int = 2
    """Key/value heads for a fresh model (grouped-query attention); must divide num_heads."""
    head_dim: int = 16
    """Per-head dimension for a fresh model."""
    num_experts: int = 8
    """Routed experts per MoE layer for a fresh model."""
    top_k: int = 2
    """Experts chosen per token (top-k) for a fresh model."""
    moe_intermediate_size: int = 64
    """Hidden size of each expert's MLP for a fresh model."""
    max_position_embeddings: int = 512
    """Longest sequence (prompt + response) in tokens for a fresh model."""
    rope_theta: float = 10000.0
    """Rotary embedding base for a fresh model."""
    kv_lora_rank: int | None = None
    """MLA (``family: deepseek_v3``): rank of the shared key/value latent of a fresh model (DeepSeek-V3:
    512), what the rollout engine's latent KV cache holds per token and layer beside the rotary key
    (``head_dim // 2`` wide); None: ``hidden_size // 2``."""
    q_lora_rank: int | None = None
    """MLA (``family: deepseek_v3``): rank of the low-rank query projection of a fresh model (DeepSeek-V3:
    1536); None: a full-rank query projection."""
    first_dense_layers: int | None = None
    """``deepseek_v3`` / ``glm4_moe``: leading dense (non-MoE) layers of a fresh model (DeepSeek-V3: 3);
    None: 1 when the model has more than one layer."""
    dense_intermediate_size: int | None = None
    """Width of a fresh model's dense layers' MLP (DeepSeek-V3: 18432); None: 2 x moe_intermediate_size."""
    dtype: str = "float32"
    """Parameter dtype: float32 or bfloat16."""
    device: str = "cpu"
    """Device for the trainer's and the sync-mode engine's model: cpu, cuda, cuda:N (``meta``: shapes only,
    for code that sizes a model without its memory, e.g. bench/weight_sync_engine.py)."""

    def __post_init__(self) -> None:
        check_choice("model.dtype", self.dtype, list(DTYPE_NAMES))
        check_choice("model.family", self.family, list(MODEL_FAMILIES))
        for name in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "num_experts",
            "top_k",
            "moe_intermediate_size",
            "max_position_embeddings",
        ):
            check_range(f"model.{name}", getattr(self, name), 1)
        check_range("model.top_k", self.top_k, 1, self.num_experts)
        check_range("model.rope_theta", self.rope_theta, 0.0, lo_open=True)
        for name in ("kv_lora_rank", "q_lora_rank", "dense_intermediate_size"):
            if getattr(self, name) is not None:
                check_range(f"model.{name}", getattr(self, name), 1)
        if self.first_dense_layers is not None:
            check_range("model.first_dense_layers", self.first_dense_layers, 0, self.num_layers)
        for name in ("kv_lora_rank", "q_lora_rank"):
            if getattr(self, name) is not None and self.family != "deepseek_v3":
                raise ConfigError(
                    f"model.{name} is an MLA size: only family deepseek_v3 has it, not {self.family}"
                )
        if not re.fullmatch(r"(cpu|cuda)(:\d+)?|meta", self.device):
            raise ConfigError(f"model.device={self.device!r} is not a device; use cpu, cuda or cuda:N")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.num_kv_heads={self.num_kv_heads} must divide model.num_heads={self.num_heads}"
            )


@dataclass(kw_only=True, slots=True)
class TaskConfig:
    """Where prompts and rewards come from."""

    name: str = "arithmetic"
    """Built-in task (arithmetic, countdown), ``dataset`` (a dataset file or folder; ``jsonl`` is the same
    task under its older name) or ``env`` (episodes, ``env:``)."""
    path: str | None = None
    """The dataset when ``name`` is ``dataset`` or ``jsonl``: a ``.jsonl`` file, a ``.parquet`` file or a
    folder written by the ``datasets`` library's ``save_to_disk`` (``moerl.tasks.datasets``)."""
    val_path: str | tuple[str, ...] | dict[str, str] | None = None
    """Validation sets used for held-out eval instead of a carve-out of ``path``: one dataset (a file, or a
    folder: a DatasetDict's ``test``/``validation`` split, or one split's folder such as ``data/dd/test``),
    a list of them (named by file stem), or a mapping name -> path; the first is the main set
    (``eval/accuracy``), each one reports ``eval/<name>/...`` when there are several. Same ``layout`` as
    ``path``. None: a DatasetDict ``path`` with a ``test`` or ``validation`` split holds that split out,
    anything else is carved (``task.num_eval``)."""
    layout: str = "gsm8k"
    """Dataset layout: ``gsm8k`` (question / answer ending in ``#### N``), ``generic`` (``prompt_field`` /
    ``answer_field``), ``messages`` (``messages_field``: a list of ``{role, content}``; needs
    ``prompt_format: chat``) or ``verl`` (verl's parquet: chat ``prompt``, ``reward_model.ground_truth``;
    detected when left at ``gsm8k``). See docs/data.md."""
    prompt_field: str = "prompt"
    """Prompt field name for the generic layout."""
    answer_field: str = "answer"
    """Gold answer field name for the generic and messages layouts (messages rows may lack it when
    ``reward_fn`` scores them, or when their last assistant message ends in ``#### N``)."""
    messages_field: str = "messages"
    """Field of the messages layout holding the conversation (a trailing assistant message is the SFT target)."""
    prompt_format: str = "raw"
    """How a dataset row becomes the prompt: ``raw`` fills ``template``; ``chat`` renders it with the
    tokenizer's ``chat_template`` (Jinja, as transformers' ``apply_chat_template(..., add_generation_prompt=True)``),
    the row's messages or its prompt as one user message (put through ``template`` when that is set)."""
    system_prompt: str | None = None
    """With ``prompt_format: chat``: a system message put first in every conversation that has none."""
    reward_fn: str | None = None
    """Import path ``package.module:function`` of a custom reward ``(prompt, response, answer) -> float |
    Reward``; the module is looked up on the import path, then in ``import_dirs``. A parameter named
    ``extra`` receives the row's unconsumed columns (``moerl.tasks.rewards``)."""
    reward_batched: bool = False
    """Call ``reward_fn`` with lists (prompts, responses, answers[, extra]) once per group (training) or per
    held-out set (eval), returning a list of scores; False: once per sample."""
    reward_timeout_s: float | None = None
    """Seconds one ``reward_fn`` call may take (a batched call counts once); longer counts as a failed
    reward (score 0, ``error`` 1), as a raising one does. None: no limit."""
    import_dirs: tuple[str, ...] = ()
    """Folders searched for ``reward_fn``'s and ``env.name``'s module (in every process of the run, Ray
    workers too); ``moerl train`` and ``moerl sft`` add the config file's folder and the folder they run from
    (``with_import_dirs``)."""
    max_reward_error_fraction: float = 0.5
    """Stop the run when the reward function fails (raises, returns a non-number) on more than this share
    of the samples of the last ``reward_error_window`` steps, in [0, 1] (1: never on a share); failing on
    every sample of the first step always stops it."""
    reward_error_window: int = 10
    """Trainer steps over which ``max_reward_error_fraction`` is measured."""
    tokenizer: str | None = None
    """Folder or file with ``tokenizer.json``; ``None``: the model folder's, else the built-in char tokenizer."""
    seed: int = 0
    """Seed of generated tasks and of the data order."""
    num_eval: int = 200
    """Held-out prompts used for eval accuracy."""
    min_digits: int = 1
    """Smallest operand size (digits) for arithmetic."""
    max_digits: int = 2
    """Largest operand size (digits) for arithmetic."""
    operations: tuple[str, ...] = ("+", "-")
    """Arithmetic operations to draw from: any of + - *."""
    countdown_min_numbers: int = 3
    """Fewest numbers given in a countdown problem."""
    countdown_max_numbers: int = 4
    """Most numbers given in a countdown problem."""
    countdown_max_value: int = 50
    """Countdown numbers are drawn uniformly from [1, countdown_max_value]."""
    template: str | None = None
    """Prompt template with a ``{prompt}`` placeholder; ``None``: the task's default
    (arithmetic ``"{prompt}="``, countdown ``"{prompt}:"``, jsonl ``"Question: {prompt}\nAnswer:"``)."""

    def __post_init__(self) -> None:
        # here, not at the top: moerl.tasks loads torch, and this module must load without it (``moerl --help``)
        from moerl.tasks import TASKS
        from moerl.tasks.arithmetic import OPERATIONS
        from moerl.tasks.chat import PROMPT_FORMATS
        from moerl.tasks.datasets import LAYOUTS

        check_choice("task.name", self.name, TASKS)
        check_choice("task.prompt_format", self.prompt_format, PROMPT_FORMATS)
        self.import_dirs = tuple(self.import_dirs)
        check_range("task.max_reward_error_fraction", self.max_reward_error_fraction, 0.0, 1.0)
        check_range("task.reward_error_window", self.reward_error_window, 1)
        if self.reward_timeout_s is not None:
            check_range("task.reward_timeout_s", self.reward_timeout_s, 0.0, lo_open=True)
        self.val_sets()  # a malformed val_path fails here
        check_range("task.num_eval", self.num_eval, 1)
        check_range("task.countdown_min_numbers", self.countdown_min_numbers, 2)
        check_range("task.countdown_max_numbers", self.countdown_max_numbers, self.countdown_min_numbers)
        check_range("task.countdown_max_value", self.countdown_max_value, 1)
        if self.template is not None and "{prompt}" not in self.template:
            raise ConfigError(f"task.template={self.template!r} must contain the placeholder {{prompt}}")
        check_range("task.min_digits", self.min_digits, 1, 9)
        check_range("task.max_digits", self.max_digits, 1, 9)
        if self.min_digits > self.max_digits:
            raise ConfigError(
                f"task.min_digits={self.min_digits} is larger than task.max_digits={self.max_digits}; "
                "set both (min_digits <= max_digits)"
            )
        check_choice("task.layout", self.layout, LAYOUTS)
        for op in self.operations:
            check_choice("task.operations[]", op, OPERATIONS)
        if self.name == "arithmetic" and not self.operations:
            raise ConfigError("task.operations=[] is empty; arithmetic needs at least one of + - *")
        if self.name in DATASET_TASKS and not self.path:
            raise ConfigError(f"task.path is required when task.name={self.name!r}")
        if self.prompt_format == "chat" and self.name not in DATASET_TASKS:
            raise ConfigError(
                f"task.prompt_format=chat with task.name={self.name!r}: chat prompts are built from dataset "
                f"rows; use task.name=dataset (or prompt_format=raw)"
            )
        if self.val_path is not None and self.name not in DATASET_TASKS:
            raise ConfigError(
                f"task.val_path is for dataset tasks; task.name={self.name!r} has its own eval split"
            )
        if self.layout == "messages" and self.name in DATASET_TASKS and self.prompt_format != "chat":
            raise ConfigError(
                "task.layout=messages needs task.prompt_format=chat (messages are rendered by the chat template)"
            )

    def val_sets(self) -> dict[str, str]:
        """``val_path`` as name -> path, in order (the first is the main set): a mapping as it is, a path or
        a list named by each path's file stem (a split folder ``dd/test``: ``test``); ``{}`` when None.

        Raises:
            ConfigError: an empty list or mapping, an empty path, a name that is not a plain word
                (letters, digits, ``_.-``), or two sets with one name.
        """
        value = self.val_path
        if value is None:
            return {}
        if isinstance(value, str):
            value = (value,)
        if isinstance(value, dict):
            named = [(str(k), v) for k, v in value.items()]
        else:
            named = [(Path(str(v)).stem, v) for v in value]
        if not named:
            raise ConfigError(
                "task.val_path is empty; give a path, a list of paths or a mapping name -> path"
            )
        names = [k for k, _ in named]
        for name, path in named:
            if not isinstance(path, str) or not path:
                raise ConfigError(f"task.val_path[{name!r}]={path!r} must be a non-empty path")
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
                raise ConfigError(
                    f"task.val_path: set name {name!r} must be letters, digits, '_', '.' or '-'"
                )
        if len(set(names)) < len(names):
            raise ConfigError(
                f"task.val_path: two sets named alike ({names}); name them: {{name: path, ...}}"
            )
        return dict(named)


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    """Rollout generation: the engine's sizes and the sampling of one group."""

    num_workers: int = 2
    """Rollout workers (Ray actors) in async mode; sync mode uses one in-process engine."""
    group_size: int = 8
    """Samples per prompt, n: one task is one GRPO group."""
    max_new_tokens: int = 16
    """Longest response in tokens."""
    temperature: float = 1.0
    """Sampling temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = 0
    """Sample among the k most likely tokens; 0 disables."""
    max_slots: int = 64
    """Most sequences decoding together in one engine (the rows of a decode batch). With the slot cache
    (``kv_cache: slots``) also its number of slots, each reserving ``kv_token_budget // max_slots``
    tokens."""
    kv_token_budget: int = 16384
    """KV cache capacity of one engine in tokens (keys and values of every layer of that many tokens).
    Paged: any sequence up to this length (and the model context) can run; sequences are admitted while
    their blocks fit, and the youngest are preempted (recomputed later) when decoding outgrows it."""
    kv_cache: str = "paged"
    """KV cache policy of the rollout engine (``moerl.rollout.Engine(cache=...)``, ``CACHE_POLICIES``):
    ``paged`` (``moerl.rollout.paged_policy``: blocks of ``kv_block_size`` tokens, a group's prompt
    prefilled once and its blocks shared, common prompt preambles shared, memory bounded by the tokens
    held) or ``slots`` (``moerl.rollout.slot_policy``: ``max_slots`` contiguous slots of
    ``kv_token_budget // max_slots`` tokens each)."""
    kv_block_size: int = 16
    """Tokens per block of the paged KV cache (``kv_cache: paged``)."""
    mla_cache: str = "latent"
    """How the engine caches a multi-head latent attention policy (DeepSeek-V3): ``latent`` keeps each
    token's ``kv_lora_rank + qk_rope_head_dim`` values per layer (576 for DeepSeek-V3, 1/71 of the
    expanded form) and decodes with the up-projections folded into the query and output; ``expanded``
    keeps per-head keys and values. ``kv_token_budget`` counts tokens either way; other models ignore it."""
    return_routed_experts: bool = False
    """Record the top routed experts per token and layer (rollout routing replay, R3)."""
    max_prefill_tokens: int = 4096
    """Prompt tokens the engine prefills per scheduler step (at least one prompt is always admitted)."""
    sync_every: int | None = None
    """Decode steps between host copies of the sampled tokens; None: the engine's device default
    (``moerl.rollout.engine.default_sync_every``: 8 on CUDA, 1 on CPU). Larger keeps a GPU busy at the cost
    of up to ``sync_every - 1`` discarded decode steps per finished sequence."""
    overlap_sync: bool = True
    """Overlap each host copy of sampled tokens with the next decode step where the device runs
    asynchronously (CUDA; never on CPU): finished sequences are freed, and their completions returned,
    one engine step later, and each decodes one more discarded token (``moerl.rollout.engine``). False
    syncs in place."""
    lease_ahead_groups: int | None = None
    """Groups a worker leases beyond its engine's slots (they wait in the engine's queue), so that one
    ``lease`` round trip fills several groups' slots and freed slots are refilled without one;
    0 leases only for free slots; None: one engine's worth (``max_slots // group_size``)."""
    ep_size: int = 1
    """Expert-parallel ranks of one rollout worker (``moerl.rollout.ep_engine.EPEngine``: experts sharded,
    attention and KV cache data-parallel, decode steps in lockstep). Above 1 (async mode only) a worker
    is a group of this many ranks, one process each (one GPU each on CUDA), that leases and delivers as
    one worker and is lost as one (``moerl.runtime.ray.ep_group``); each rank has ``max_slots`` slots.
    Must divide the policy's routed experts. ``moerl generate --ep-size N`` runs the same engine."""
    ep_dispatcher: str = "alltoall"
    """Token dispatch/combine of the EP engine: ``alltoall`` or ``hierarchical`` (``moerl.ep``)."""
    ep_ranks_per_node: int | None = None
    """EP ranks of one rollout worker on each node (G): the group spans ``ep_size / G`` nodes, rank r on
    node ``r // G`` (``moerl.ep.Topology``); ``hierarchical`` then crosses the node boundary once per node
    a token needs. Divides ``ep_size``. None: ``min(ep_size, cluster.rollout.gpus_per_node)`` (one node
    whenever the group fits in one; ``rollout_ep_ranks_per_node``). On a Ray cluster of several nodes
    ``moerl.runtime.ray.ep_group`` places each node's G ranks together and the nodes apart (N distinct
    nodes, or the group cannot be placed); on a one-node Ray cluster the nodes are simulated there."""
    on_weight_update: str = "continue"
    """What a worker does with its sequences in flight when it switches to a new policy version:
    ``continue`` decodes on over the KV cache computed by the old weights (tokens then carry mixed
    per-token versions); ``recompute`` re-prefills every running prefix under the new weights first
    (as partial rollout does), so later tokens are those a fresh prefill would give; ``abort`` releases
    the in-flight tasks to the queue (requeued, their tokens discarded). Per-token policy versions are
    recorded in every case (``moerl.weights.buckets``)."""

    speculative: str = "off"
    """Speculative decoding in the engine's decode over the paged cache (``moerl.rollout.spec_decode``,
    docs/speculative.md): ``off``; ``mtp`` drafts with the policy's multi-token-prediction module (a release's, else a fresh one
    that ``trainer.mtp_loss_weight`` trains online); ``ngram`` drafts by prompt lookup (model-free). The
    drafts are verified in one forward and accepted by the rejection-sampling rule, so tokens and log-probs
    are distributed exactly as without speculation; steps with more than ``speculative_max_batch``
    sequences, or whose recent acceptance rate is too low, decode plainly."""
    speculative_tokens: int = 3
    """Tokens drafted per sequence and speculative step, k (1..16)."""
    speculative_max_batch: int = 32
    """Most sequences decoding together for a step to speculate (above: a plain decode step)."""

    weight_dtype: str = "auto"
    """Precision of the rollout engine's weights (``moerl.rollout.weight_dtype.WEIGHT_DTYPES``): ``auto``
    keeps the policy's dtype (``model.dtype``; what the trainer computes with); ``bf16`` casts the
    engine's copy to bfloat16; ``fp8`` block-quantizes its attention, MLP and expert projections to
    float8_e4m3fn with one float32 scale per 128 x 128 block (the DeepSeek-V3 release format,
    ``moerl.models.fp8``), quantized in the engine as each version loads (the bytes sent stay the
    policy's), activations in the model dtype; FP8 GEMMs on CUDA with Triton, else dequantize-then-matmul.
    With ``fp8`` the train/rollout mismatch correction must stay on (``algorithm.mismatch_mode``, truncate
    by default) and the log-prob gap to the policy is reported (``rollout/fp8_*`` metrics). With
    ``ep_size > 1`` each EP rank holds its experts' FP8 shards (``moerl.ep.parallelize``)."""

    def __post_init__(self) -> None:
        if self.lease_ahead_groups is not None:
            check_range("rollout.lease_ahead_groups", self.lease_ahead_groups, 0)
        check_range("rollout.num_workers", self.num_workers, 1)
        check_range("rollout.group_size", self.group_size, 1)
        check_range("rollout.max_new_tokens", self.max_new_tokens, 1)
        check_range("rollout.temperature", self.temperature, 0.0)
        check_range("rollout.top_p", self.top_p, 0.0, 1.0, lo_open=True)
        check_range("rollout.top_k", self.top_k, 0)
        check_range("rollout.max_slots", self.max_slots, 1)
        check_range("rollout.kv_token_budget", self.kv_token_budget, 1)
        check_range("rollout.max_prefill_tokens", self.max_prefill_tokens, 1)
        if self.sync_every is not None:
            check_range("rollout.sync_every", self.sync_every, 1)
        # here, not at the top: moerl.ep and moerl.rollout load torch, and this module must load without it
        from moerl.ep.registry import DISPATCHERS
        from moerl.rollout.engine import CACHE_POLICIES
        from moerl.rollout.kv_cache import MLA_CACHE_FORMS
        from moerl.rollout.weight_update import ON_WEIGHT_UPDATE

        check_choice("rollout.kv_cache", self.kv_cache, sorted(CACHE_POLICIES))
        check_choice("rollout.mla_cache", self.mla_cache, MLA_CACHE_FORMS)
        check_range("rollout.kv_block_size", self.kv_block_size, 1)
        check_choice("rollout.ep_dispatcher", self.ep_dispatcher, DISPATCHERS)
        check_range("rollout.ep_size", self.ep_size, 1)
        if self.ep_ranks_per_node is not None:
            check_range("rollout.ep_ranks_per_node", self.ep_ranks_per_node, 1, self.ep_size)
            if self.ep_size % self.ep_ranks_per_node:
                raise ConfigError(
                    f"rollout.ep_ranks_per_node={self.ep_ranks_per_node} does not divide rollout.ep_size="
                    f"{self.ep_size}: an EP group spans whole nodes of the same number of ranks"
                )
        check_choice("rollout.on_weight_update", self.on_weight_update, ON_WEIGHT_UPDATE)
        from moerl.rollout.weight_dtype import WEIGHT_DTYPES

        check_choice("rollout.weight_dtype", self.weight_dtype, WEIGHT_DTYPES)
        from moerl.rollout.speculative import SPECULATIVE

        check_choice("rollout.speculative", self.speculative, SPECULATIVE)
        check_range("rollout.speculative_tokens", self.speculative_tokens, 1, 16)
        check_range("rollout.speculative_max_batch", self.speculative_max_batch, 1)
        if self.speculative != "off" and (self.kv_cache != "paged" or self.ep_size > 1):
            raise ConfigError(
                f"rollout.speculative={self.speculative} runs in one rank's engine over the paged cache: "
                f"it needs rollout.kv_cache=paged (got {self.kv_cache}) and rollout.ep_size=1 (got {self.ep_size})"
            )


@dataclass(kw_only=True, slots=True)
class RuntimeConfig:
    """Processes, queue, buffer and weight store."""

    mode: str = "async"
    """``async``: Ray actors (local instance or --ray-address); ``sync``: one process, no Ray, on-policy."""
    ray_address: str | None = None
    """Existing Ray cluster address; ``None`` starts a local instance."""
    buffer_groups: int = 32
    """Experience buffer capacity in groups; producers block when it is full. A value below
    ``trainer.batch_groups`` is raised to it (the buffer must hold one batch)."""
    max_staleness: int = 2
    """Admit a group only if its oldest policy version >= trainer version - max_staleness."""
    stale_policy: str = "requeue"
    """What happens to a stale group: ``drop`` it, or ``requeue`` its task."""
    lease_ttl_s: float = 60.0
    """Task lease lifetime in seconds; workers renew it by heartbeat."""
    store_url: str | None = None
    """Weight store URL (fsspec): local folder or ``s3://bucket/prefix``; ``None``: RUN_DIR/weights."""
    weight_sync: str = "object_store"
    """How async-mode workers get each new version: the name of a transport in
    ``moerl.weights.transport.TRANSPORTS`` (sync mode always hands weights over in process).

    - ``object_store`` (default): buckets of ``publish_bucket_mb`` through Ray's object store, one ref
      each, a version and an xxh3 checksum per bucket, no whole-model copy (a trainer group puts them
      from its rank 0); the durable store written in the background every ``durable_every`` versions.
      For most runs: nothing to set up, and EP rollout groups are served.
    - ``collective``: a ``torch.distributed`` group per rollout worker (gloo) between the trainer's
      sender (trainer rank 0 or the one-process trainer) and every rank of the worker, broadcasting the
      same checksummed buckets; workers join and leave (a lost worker only loses its group; each
      collective times out after ``collective_timeout_s``). For moving weights without the object store.
    - ``cuda_ipc`` (``moerl.weights.ipc``): a trainer and workers sharing a GPU host (hybrid / colocated
      engines): buckets through a ring of shared device buffers (CUDA IPC; shared memory on CPU),
      checksummed on the device; needs ``trainer.num_ranks=1`` and ``rollout.ep_size=1``.
    - ``store``: every version written to the weight store and offered whole (the serialize-and-load
      path; slowest, simplest)."""
    collective_timeout_s: float = 60.0
    """With ``weight_sync=collective``: most seconds a sender-side collective (a worker's group being
    built, one bucket's broadcast) may take; a worker whose group misses it is dropped (treated as
    lost: its leases expire and it is replaced), the trainer goes on."""
    durable_every: int = 10
    """Every this many versions (and version 0, each checkpoint's and the last one) also go to the weight
    store, in both modes and with every ``weight_sync``, off the step's path (``moerl.weights.durable``):
    the publish returns at once, a copier thread takes a host snapshot (on CUDA a non-blocking
    device-to-host copy into pinned memory; on CPU a copy into reused buffers; the trainer's next
    optimizer step waits for it, not for the write) and the store's writer thread serializes and writes
    it. At most two versions wait for the writer (one host copy of the model each); a publish waits only
    when the writer is that far behind (no due version is dropped). Resume and trainer recovery start
    from the checkpoints' versions; workers that start later load the store's newest and are then
    offered the newest sent version. A smaller value keeps a fresher store for readers outside the run
    at the price of more disk writes and writer-thread time (sha256, I/O); 1 writes every version,
    which suits a writer that keeps up with the steps (small models, fast disks). A trainer group
    (``trainer.num_ranks > 1``) in sync mode or with ``weight_sync=collective`` gathers and writes its
    due versions in the foreground (with ``object_store``: from the streamed buckets, in the
    background); ``weight_sync=store`` writes every version, as its name says."""
    overlap_publish: bool = True
    """Async mode with ``weight_sync=object_store`` and one trainer process: ``publish`` returns at once;
    a thread copies the weights on their device into a spare copy (one more copy of the model in device
    memory, reused for every version; the trainer's next optimizer step waits for the copy) and sends
    that copy to the workers while the trainer trains on (double buffering: a publish waits only for the
    send before it). The run's last version is sent in the foreground. ``false`` saves that device copy
    (for a model that fits the GPU only without it) at the price of the send on every step's path.
    Ignored elsewhere."""
    keep_versions: int = 3
    """Weight versions kept in the store."""
    max_materialized_tasks: int = 1024
    """Most tasks the task queue holds at once (pending + leased); bounds its memory."""
    keep_checkpoints: int = 2
    """Full checkpoints kept in RUN_DIR/checkpoints (newest by step)."""
    publish_bucket_mb: float = 256.0
    """Bucket size of a version on its way out: with ``weight_sync=object_store|collective|cuda_ipc`` each bucket
    is one object ref / one slot of the shared ring (whose two slots are the largest bucket); with
    ``trainer.num_ranks > 1`` a version is gathered from the shards in buckets of about this many MiB
    of full tensors (streamed, or one safetensors file each), so no process holds more than one bucket
    of gathered weights at a time."""

    def __post_init__(self) -> None:
        check_choice("runtime.mode", self.mode, ["async", "sync"])
        check_choice("runtime.stale_policy", self.stale_policy, ["drop", "requeue"])
        check_range("runtime.buffer_groups", self.buffer_groups, 1)
        check_range("runtime.max_staleness", self.max_staleness, 0)
        check_range("runtime.lease_ttl_s", self.lease_ttl_s, 0.0, lo_open=True)
        # imported here: the transports need torch, which a process reading a config (the exchange actor) does not
        from moerl.weights.transport import TRANSPORTS

        check_choice("runtime.weight_sync", self.weight_sync, list(TRANSPORTS))
        check_range("runtime.collective_timeout_s", self.collective_timeout_s, 0.0, lo_open=True)
        check_range("runtime.durable_every", self.durable_every, 1)
        check_range("runtime.keep_versions", self.keep_versions, 1)
        check_range("runtime.max_materialized_tasks", self.max_materialized_tasks, 1)
        check_range("runtime.keep_checkpoints", self.keep_checkpoints, 1)
        check_range("runtime.publish_bucket_mb", self.publish_bucket_mb, 0.0, lo_open=True)


@dataclass(kw_only=True, slots=True)
class SFTConfig:
    """Supervised warm start on task solutions (``moerl sft``)."""

    steps: int = 300
    """Optimizer steps; 0 skips the warm start (only where a policy is given: ``model.path`` or ``init_from``)."""
    batch_size: int = 32
    """Sequences per step."""
    lr: float = 3e-3
    """Peak learning rate (AdamW, cosine decay to 10%)."""
    num_examples: int = 20000
    """Training examples drawn from the task's train split."""
    warmup_steps: int = 20
    """Linear LR warm-up steps before the cosine decay."""
    aux_loss_coef: float = 0.01
    """Coefficient of the MoE load-balancing loss added to the SFT loss."""

    def __post_init__(self) -> None:
        check_range("sft.steps", self.steps, 0)
        check_range("sft.warmup_steps", self.warmup_steps, 0)
        check_range("sft.aux_loss_coef", self.aux_loss_coef, 0.0)
        check_range("sft.batch_size", self.batch_size, 1)
        check_range("sft.lr", self.lr, 0.0, 1.0, lo_open=True)
        check_range("sft.num_examples", self.num_examples, 1)


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    """Held-out evaluation: greedy exact match (``eval/accuracy``) and, with ``k``, sampled pass@k."""

    every: int = 10
    """Evaluate every this many trainer steps (and at the start and the end); 0: only start and end."""
    k: int = 0
    """Sampled eval: the k of ``eval/pass@<k>`` (unbiased estimator, Chen et al. 2021, eq. 1) and
    ``eval/mean@<k>`` (mean correctness of the samples), beside the greedy exact match, per validation
    set; the samples go to ``RUN_DIR/eval_samples.jsonl``. 0: greedy only."""
    num_samples: int = 0
    """Samples drawn per held-out prompt for pass@k, n >= k (a larger n lowers the estimator's variance);
    0: n = k."""
    temperature: float = 1.0
    """Sampling temperature of the eval samples (> 0)."""

    def __post_init__(self) -> None:
        check_range("eval.every", self.every, 0)
        check_range("eval.k", self.k, 0)
        check_range("eval.temperature", self.temperature, 0.0, lo_open=True)
        if self.num_samples and self.num_samples < self.k:
            raise ConfigError(f"eval.num_samples={self.num_samples} must be >= eval.k={self.k} (or 0: n = k)")

    @property
    def n(self) -> int:
        """Samples per held-out prompt: ``num_samples``, or ``k`` when that is 0."""
        return self.num_samples or self.k


@dataclass(kw_only=True, slots=True)
class TelemetryConfig:
    """Where a run's metrics go (``moerl.telemetry``): loggers and the Prometheus endpoint."""

    loggers: tuple[str, ...] = ("jsonl",)
    """Step-record sinks: ``jsonl`` (``metrics.jsonl``, required: report and resume read it),
    ``tensorboard`` (``RUN_DIR/tensorboard``, extra ``tensorboard``), ``wandb`` (extra ``wandb``)."""
    metrics_port: int = 0
    """TCP port of the Prometheus endpoint served while ``moerl train`` runs (``--metrics-port``);
    0: no endpoint. Off by default so that concurrent runs on one host never collide; 9464 is the
    port the deploy/ files use."""
    metrics_address: str = "127.0.0.1"
    """Interface the endpoint binds; ``0.0.0.0`` exposes it to other hosts (a cluster's Prometheus)."""
    wandb_project: str = "moerl"
    """W&B project name."""
    wandb_mode: str = "offline"
    """W&B mode: ``offline`` (files under ``RUN_DIR/wandb``, upload later with ``wandb sync``) or
    ``online`` (needs ``wandb login`` and network)."""

    def __post_init__(self) -> None:
        self.loggers = tuple(self.loggers)
        for name in self.loggers:
            check_choice("telemetry.loggers", name, ["jsonl", "tensorboard", "wandb"])
        if "jsonl" not in self.loggers:
            raise ConfigError(
                f"telemetry.loggers={list(self.loggers)} must include jsonl "
                "(metrics.jsonl is the run's record that moerl report and --resume read)"
            )
        if len(set(self.loggers)) != len(self.loggers):
            raise ConfigError(f"telemetry.loggers={list(self.loggers)} names a logger twice")
        check_range("telemetry.metrics_port", self.metrics_port, 0, 65535)
        if not self.metrics_address:
            raise ConfigError("telemetry.metrics_address must not be empty (e.g. 127.0.0.1 or 0.0.0.0)")
        check_choice("telemetry.wandb_mode", self.wandb_mode, ["offline", "online"])


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """A whole run: the components plus the run's name, seed and output folder."""

    name: str = "run"
    """Run name; the run folder is ``<output_dir>/<name>-<timestamp>``."""
    output_dir: str = "runs"
    """Parent folder of run folders."""
    seed: int = 0
    """Global seed (model init, sampling, data order)."""
    init_from: str | None = None
    """Checkpoint folder to start RL from, as it is (no warm start). ``None``: warm-start with SFT first
    (``sft.steps`` steps on the task's solutions, from ``model.path`` or a fresh model), unless
    ``sft.steps == 0``, which starts RL from ``model.path`` itself."""
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    chaos: ChaosConfig = field(default_factory=ChaosConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    """A learned reward model beside the task's verifiable reward (``moerl.config_reward``)."""

    def __post_init__(self) -> None:
        # here, not at the top: moerl.rl loads torch, and this module must load without it (``moerl --help``)
        from moerl.rl.presets import preset_from_config

        if not self.name or self.name in (".", "..") or any(c in self.name for c in "/\\"):
            raise ConfigError(
                f"name={self.name!r} must be a plain folder name (no '/' or '\\'); "
                "set output_dir to put runs elsewhere"
            )
        try:
            preset = preset_from_config(self.algorithm)
        except ValueError as e:  # a combination the per-field checks cannot see
            raise ConfigError(f"algorithm: {e}") from e
        check_algorithm_combination(self, preset)
        if self.algorithm.routing_replay == "r3":  # R3 replays what the engine records
            self.rollout.return_routed_experts = True
        _check_expert_parallel(self)
        check_engine_sizes(self)
        # the transports need torch: imported where a config is checked, not where one is only read
        from moerl.weights.transport import check_transport

        try:  # each transport checks what it supports (moerl.weights.transport)
            check_transport(
                self.runtime, trainer_ranks=self.trainer.num_ranks, rollout_ep_size=self.rollout.ep_size
            )
        except ValueError as e:
            raise ConfigError(str(e)) from e
        self.fleet.check_bounds(self.rollout.num_workers)
        check_episode_run(self.task.name, self.rollout.return_routed_experts)
        check_group_samples(self, preset.estimator)
        if self.sft.steps == 0 and self.init_from is None and self.model.path is None:
            raise ConfigError(
                "sft.steps=0 skips the warm start, but no policy is given: set model.path (a Hugging Face "
                "folder) or init_from, or sft.steps > 0 to warm-start a fresh model"
            )


def _num_experts(cfg: RunConfig) -> int | None:
    """Routed experts of the run's policy: from ``init_from``'s or ``model.path``'s config.json when
    the folder exists, else ``model.num_experts`` (a fresh model or an SFT warm start of it)."""
    for folder in (cfg.init_from, cfg.model.path):
        if folder is not None and (Path(folder) / "config.json").is_file():
            try:
                hf = json.loads((Path(folder) / "config.json").read_text())
            except (OSError, ValueError):
                return None  # the loader reports a broken folder with its own message
            for key in ("num_experts", "num_local_experts", "n_routed_experts"):
                if isinstance(hf.get(key), int):
                    return hf[key]
            return None
    return cfg.model.num_experts


def rollout_ep_ranks_per_node(cfg: RunConfig) -> int:
    """G, the EP ranks of one rollout worker per node: ``rollout.ep_ranks_per_node``, else
    ``min(rollout.ep_size, cluster.rollout.gpus_per_node)`` (1 <= G <= ep_size, G divides ep_size:
    ``RunConfig`` checks it)."""
    r = cfg.rollout
    if r.ep_ranks_per_node is not None:
        return r.ep_ranks_per_node
    return min(r.ep_size, cfg.cluster.rollout.gpus_per_node or r.ep_size)


def _check_expert_parallel(cfg: RunConfig) -> None:
    """``trainer.ep_size`` and ``rollout.ep_size`` must divide the routed experts of the policy; an EP
    rollout group needs processes (async mode) and a single-turn task (its weight transport is checked
    by ``check_transport``) (``ConfigError`` otherwise)."""
    num_experts = _num_experts(cfg)
    for name, ep_size in (("trainer.ep_size", cfg.trainer.ep_size), ("rollout.ep_size", cfg.rollout.ep_size)):
        if ep_size > 1 and num_experts is not None and num_experts % ep_size:
            raise ConfigError(
                f"{name}={ep_size} does not divide the policy's {num_experts} routed experts; "
                "every EP rank holds the same number of experts"
            )
    ep_size = cfg.rollout.ep_size
    per_node = rollout_ep_ranks_per_node(cfg)
    if ep_size % per_node:
        raise ConfigError(
            f"rollout.ep_size={ep_size} is not a multiple of cluster.rollout.gpus_per_node="
            f"{cfg.cluster.rollout.gpus_per_node} (the default rollout.ep_ranks_per_node): an EP group "
            "spans whole nodes; set rollout.ep_ranks_per_node to a divisor of rollout.ep_size"
        )
    if ep_size > 1 and cfg.runtime.mode == "sync":
        raise ConfigError(
            f"rollout.ep_size={ep_size} needs runtime.mode=async: an EP rollout worker is a group of "
            "processes (Ray actors), and sync mode runs one in-process engine"
        )
    if ep_size > 1 and cfg.task.name == "env":
        raise ConfigError(
            f"rollout.ep_size={ep_size} with task.name=env: multi-turn EP workers are not supported yet"
        )


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML run config, apply CLI overrides, validate every component.

    Args:
        path: YAML file; ``None`` uses the defaults of ``RunConfig``.
        overrides: ``["trainer.lr=1e-5", ...]``.

    Raises:
        ConfigError: unknown key (with the closest valid key), wrong type or out-of-range value.
        FileNotFoundError: ``path`` does not exist.
    """
    data: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not a UTF-8 text file ({e.reason} at byte {e.start})") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}{yaml_problem(e)}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
    apply_overrides(data, overrides or [])
    return from_dict(RunConfig, data)


def with_import_dirs(cfg: RunConfig, config_path: str | Path | None) -> RunConfig:
    """Put the config file's folder and the current folder (absolute) into ``task.import_dirs`` (``moerl
    train`` and ``moerl sft`` do): a reward module beside the config, or in the folder a run starts from,
    imports without ``PYTHONPATH``, in every process of the run; and make its input paths absolute
    (``resolve_paths``). Returns ``cfg``, changed in place.

    Raises:
        ConfigError: a relative input path found in neither folder (``resolve_paths``).
    """
    found = [str(Path(config_path).resolve().parent)] if config_path is not None else []
    cfg.task.import_dirs = tuple(dict.fromkeys([*cfg.task.import_dirs, *found, str(Path.cwd())]))
    return resolve_paths(cfg, config_path)


def save_config(cfg: RunConfig, path: str | Path) -> None:
    """Write the resolved config as YAML (atomically: ``moerl.atomic``)."""
    atomic_write_text(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))
