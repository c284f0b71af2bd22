"""Run configuration: one dataclass per component, loaded from YAML, overridden from the CLI.

Every component takes only its own config (``RolloutConfig``, ``TrainerConfig``, ...). Each is a
``@dataclass(kw_only=True, slots=True)`` that validates itself in ``__post_init__`` and raises
``ConfigError`` naming the field, the bad value and the allowed range. ``RunConfig`` composes them.

A YAML run config mirrors the nesting (``trainer: {lr: 1e-5}``); ``--set trainer.lr=1e-5`` overrides
one field, its value parsed as YAML. Unknown keys are an error that suggests the closest valid key.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from moerl.atomic import atomic_write_text
from moerl.choices import DTYPE_NAMES, MODEL_FAMILIES
from moerl.config_env import EnvConfig, check_episode_run  # noqa: F401 - re-exported
from moerl.config_fleet import ChaosConfig, FleetConfig  # noqa: F401 - re-exported
from moerl.configlib import (  # noqa: F401 - re-exported: the config API lives here
    ConfigError,
    apply_overrides,
    check_choice,
    check_range,
    from_dict,
    to_dict,
)

# ----------------------------------------------------------------------------------------------
# Components


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
    dtype: str = "float32"
    """Parameter dtype: float32 or bfloat16."""
    device: str = "cpu"
    """Device for the trainer's and the sync-mode engine's model: cpu, cuda, cuda:N."""

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
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.num_kv_heads={self.num_kv_heads} must divide model.num_heads={self.num_heads}"
            )


@dataclass(kw_only=True, slots=True)
class TaskConfig:
    """Where prompts and rewards come from."""

    name: str = "arithmetic"
    """Built-in task (arithmetic, countdown), ``jsonl`` (a dataset file) or ``env`` (episodes, ``env:``)."""
    path: str | None = None
    """JSONL dataset file when ``name == "jsonl"``."""
    layout: str = "gsm8k"
    """JSONL layout: ``gsm8k`` (question / answer ending in ``#### N``) or ``generic`` (see fields)."""
    prompt_field: str = "prompt"
    """Prompt field name for the generic layout."""
    answer_field: str = "answer"
    """Answer field name for the generic layout."""
    reward_fn: str | None = None
    """Import path ``package.module:function`` of a custom reward ``(prompt, response, answer) -> float``."""
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
        check_choice("task.name", self.name, ["arithmetic", "countdown", "jsonl", "env"])
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
        check_choice("task.layout", self.layout, ["gsm8k", "generic"])
        for op in self.operations:
            check_choice("task.operations[]", op, ["+", "-", "*"])
        if self.name == "jsonl" and not self.path:
            raise ConfigError("task.path is required when task.name='jsonl'")


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
    """Sequence slots of the continuous-batching scheduler (concurrent sequences)."""
    kv_token_budget: int = 16384
    """KV cache capacity in tokens over all slots."""
    return_routed_experts: bool = False
    """Record the top routed experts per token and layer (rollout routing replay, R3)."""
    max_prefill_tokens: int = 4096
    """Prompt tokens the engine prefills per scheduler step (at least one prompt is always admitted)."""
    sync_every: int = 1
    """Decode steps between host copies of the sampled tokens (1 on CPU; 4-16 keeps a GPU busy)."""
    lease_ahead_groups: int | None = None
    """Groups a worker leases beyond its engine's slots (they wait in the engine's queue), so that one
    ``lease`` round trip fills several groups' slots and freed slots are refilled without one;
    0 leases only for free slots; None: one engine's worth (``max_slots // group_size``)."""

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
        check_range("rollout.sync_every", self.sync_every, 1)


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    """The RL objective: advantage estimator, policy loss preset and its coefficients (moerl.rl).

    Fields left at ``None`` take the preset's value (``moerl.rl.PRESETS``); resolve the effective
    loss with ``moerl.rl.preset_from_config(cfg)``.
    """

    preset: str = "grpo"
    """Loss preset: grpo, dr_grpo, dapo, gspo, cispo, ppo."""
    estimator: str | None = None
    """Advantage estimator: grpo, dr_grpo, rloo (group-relative) or gae (value head); None: the preset's."""
    eps_low: float | None = None
    """Lower clip offset in [0, 1]: the ratio is clipped below at 1 - eps_low; None: the preset's."""
    eps_high: float | None = None
    """Upper clip offset >= 0 (clip-higher when > eps_low): clipped above at 1 + eps_high; None: the preset's."""
    dual_clip_c: float | None = None
    """Dual-clip constant c > 1: where A < 0 the token loss is capped at -c A; None: the preset's (off)."""
    aggregation: str | None = None
    """Loss aggregation: token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm; None: the preset's."""
    norm_length: int | None = None
    """Constant length (tokens) of seq-mean-token-sum-norm (Dr. GRPO); None: rollout.max_new_tokens."""
    mismatch_mode: str | None = None
    """Train/rollout mismatch correction (importance weights old/behaviour, ``moerl.rl.mismatch``): none,
    truncate (truncated IS) or mask; None: the preset's (truncate)."""
    mismatch_level: str | None = None
    """Mismatch ratio level: token, or sequence (geometric mean over the sequence); None: the preset's (token)."""
    mismatch_cap: float | None = None
    """IS cap C >= 1 (truncate) or upper bound (mask); None: the preset's (2.0)."""
    mismatch_cap_low: float | None = None
    """Lower IS bound in [0, 1] of mask mode; None: the preset's (0.5)."""
    tis_mode: InitVar[str | None] = None
    """Former name of ``mismatch_mode`` (keyword only, not a YAML key)."""
    tis_level: InitVar[str | None] = None
    """Former name of ``mismatch_level``."""
    tis_cap: InitVar[float | None] = None
    """Former name of ``mismatch_cap``."""
    tis_cap_low: InitVar[float | None] = None
    """Former name of ``mismatch_cap_low``."""
    kl_coef: float = 0.0
    """Coefficient of the KL penalty against the reference policy; 0 disables it (no reference model)."""
    kl_kind: str = "k3"
    """KL estimator: k1, k2, k3 (Schulman 2020)."""
    kl_in_reward: bool = False
    """Fold the KL penalty into the per-token reward (PPO with GAE) instead of adding it to the loss."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    dynamic_sampling: bool | None = None
    """DAPO dynamic sampling: drop groups whose rewards are all equal at buffer admission; None: the preset's."""
    gae_gamma: float = 1.0
    """GAE discount gamma in [0, 1] (estimator gae)."""
    gae_lambda: float = 0.95
    """GAE lambda in [0, 1] (estimator gae)."""
    value_clip: float | None = 0.2
    """Value-loss clip range around the rollout-time values (estimator gae); None disables clipping."""
    value_coef: float = 0.5
    """Coefficient of the value loss (estimator gae)."""

    def __post_init__(self, tis_mode=None, tis_level=None, tis_cap=None, tis_cap_low=None) -> None:
        former = {"mode": tis_mode, "level": tis_level, "cap": tis_cap, "cap_low": tis_cap_low}
        for suffix, value in former.items():
            if value is not None:
                setattr(self, f"mismatch_{suffix}", value)
        check_choice("algorithm.preset", self.preset, ["grpo", "dr_grpo", "dapo", "gspo", "cispo", "ppo"])
        check_choice("algorithm.kl_kind", self.kl_kind, ["k1", "k2", "k3"])
        check_range("algorithm.kl_coef", self.kl_coef, 0.0)
        check_range("algorithm.entropy_coef", self.entropy_coef, 0.0)
        choices = {
            "estimator": ["grpo", "dr_grpo", "rloo", "gae"],
            "aggregation": [
                "token-mean",
                "seq-mean-token-mean",
                "seq-mean-token-sum",
                "seq-mean-token-sum-norm",
            ],
            "mismatch_mode": ["none", "truncate", "mask"],
            "mismatch_level": ["token", "sequence"],
        }
        for name, allowed in choices.items():
            if getattr(self, name) is not None:
                check_choice(f"algorithm.{name}", getattr(self, name), allowed)
        ranges = {
            "eps_low": (0.0, 1.0),
            "eps_high": (0.0, None),
            "mismatch_cap": (1.0, None),
            "mismatch_cap_low": (0.0, 1.0),
            "norm_length": (1, None),
        }
        for name, (lo, hi) in ranges.items():
            if getattr(self, name) is not None:
                check_range(f"algorithm.{name}", getattr(self, name), lo, hi)
        if self.dual_clip_c is not None:
            check_range("algorithm.dual_clip_c", self.dual_clip_c, 1.0, lo_open=True)
        if self.value_clip is not None:
            check_range("algorithm.value_clip", self.value_clip, 0.0, lo_open=True)
        check_range("algorithm.gae_gamma", self.gae_gamma, 0.0, 1.0)
        check_range("algorithm.gae_lambda", self.gae_lambda, 0.0, 1.0)
        check_range("algorithm.value_coef", self.value_coef, 0.0)
        if self.kl_in_reward and self.kl_coef == 0.0:
            raise ConfigError("algorithm.kl_in_reward=True needs algorithm.kl_coef > 0")


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    """Policy optimization: AdamW, LR schedule, batch sizes, publishing and checkpointing."""

    steps: int = 40
    """Optimizer steps of the run."""
    batch_groups: int = 8
    """Groups consumed per optimizer step."""
    micro_batch_size: int = 32
    """Sequences per forward/backward; gradients accumulate over a step's micro-batches."""
    lr: float = 1e-4
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    warmup_steps: int = 0
    """Linear warm-up steps, then ``lr_schedule``."""
    lr_schedule: str = "constant"
    """After warm-up: ``constant`` peak LR, or ``cosine`` decay from the peak to ``0.1 x lr`` at
    ``steps`` (Loshchilov & Hutter 2017, SGDR eq. 5, one cycle). The cosine is laid over ``steps``: a
    resume that raises ``steps`` stretches the rest of the decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables."""
    aux_loss_coef: float = 0.0
    """Coefficient of the MoE load-balancing loss."""
    recompute_proximal: bool = False
    """Recompute proximal (old) log-probs before the update instead of using the behaviour ones."""
    share_prompt: bool = True
    """Forward each group's prompt once instead of once per sample (shared-prefix forward, Prefix
    Grouper, Liu et al. 2025): the same log-probs up to float rounding, for fewer tokens. Off while
    ``aux_loss_coef > 0``, whose load-balancing loss is not additive over the two passes' tokens."""
    publish_every: int = 1
    """Publish weights every this many steps."""
    background_publish: bool = False
    """Write published versions to the weight store on a background thread (``WeightStore.
    publish_in_background``) except the first and the last step's; the trainer goes on at once. For
    slow stores (object stores); on a local folder the write is ~2 ms and the thread's GIL share costs
    about as much (async A/B on 2 cores: no measurable gain)."""
    checkpoint_every: int = 10
    """Write a full checkpoint every this many steps; 0 disables."""
    max_nan_steps: int = 3
    """Stop the run after this many consecutive steps with a non-finite loss."""

    def __post_init__(self) -> None:
        check_range("trainer.steps", self.steps, 1)
        check_range("trainer.batch_groups", self.batch_groups, 1)
        check_range("trainer.micro_batch_size", self.micro_batch_size, 1)
        check_range("trainer.lr", self.lr, 0.0, 1.0, lo_open=True)
        check_range("trainer.weight_decay", self.weight_decay, 0.0)
        check_range("trainer.warmup_steps", self.warmup_steps, 0)
        check_choice("trainer.lr_schedule", self.lr_schedule, ["constant", "cosine"])
        check_range("trainer.grad_clip", self.grad_clip, 0.0)
        check_range("trainer.aux_loss_coef", self.aux_loss_coef, 0.0)
        check_range("trainer.publish_every", self.publish_every, 1)
        check_range("trainer.checkpoint_every", self.checkpoint_every, 0)
        check_range("trainer.max_nan_steps", self.max_nan_steps, 1)


@dataclass(kw_only=True, slots=True)
class RuntimeConfig:
    """Processes, queue, buffer and weight store."""

    mode: str = "async"
    """``async``: Ray actors (local instance or --ray-address); ``sync``: one process, no Ray, on-policy."""
    ray_address: str | None = None
    """Existing Ray cluster address; ``None`` starts a local instance."""
    buffer_groups: int = 32
    """Experience buffer capacity in groups; producers block when it is full."""
    max_staleness: int = 2
    """Admit a group only if its oldest policy version >= trainer version - max_staleness."""
    stale_policy: str = "requeue"
    """What happens to a stale group: ``drop`` it, or ``requeue`` its task."""
    lease_ttl_s: float = 60.0
    """Task lease lifetime in seconds; workers renew it by heartbeat."""
    store_url: str | None = None
    """Weight store URL (fsspec): local folder or ``s3://bucket/prefix``; ``None``: RUN_DIR/weights."""
    keep_versions: int = 3
    """Weight versions kept in the store."""
    max_materialized_tasks: int = 1024
    """Most tasks the task queue holds at once (pending + leased); bounds its memory."""
    keep_checkpoints: int = 2
    """Full checkpoints kept in RUN_DIR/checkpoints (newest by step)."""

    def __post_init__(self) -> None:
        check_choice("runtime.mode", self.mode, ["async", "sync"])
        check_choice("runtime.stale_policy", self.stale_policy, ["drop", "requeue"])
        check_range("runtime.buffer_groups", self.buffer_groups, 1)
        check_range("runtime.max_staleness", self.max_staleness, 0)
        check_range("runtime.lease_ttl_s", self.lease_ttl_s, 0.0, lo_open=True)
        check_range("runtime.keep_versions", self.keep_versions, 1)
        check_range("runtime.max_materialized_tasks", self.max_materialized_tasks, 1)
        check_range("runtime.keep_checkpoints", self.keep_checkpoints, 1)


@dataclass(kw_only=True, slots=True)
class SFTConfig:
    """Supervised warm start on task solutions (``moerl sft``)."""

    steps: int = 300
    """Optimizer steps."""
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
        check_range("sft.steps", self.steps, 1)
        check_range("sft.warmup_steps", self.warmup_steps, 0)
        check_range("sft.aux_loss_coef", self.aux_loss_coef, 0.0)
        check_range("sft.batch_size", self.batch_size, 1)
        check_range("sft.lr", self.lr, 0.0, 1.0, lo_open=True)
        check_range("sft.num_examples", self.num_examples, 1)


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    """Held-out evaluation (greedy, exact-match accuracy)."""

    every: int = 10
    """Evaluate every this many trainer steps (and at the start and the end); 0: only start and end."""

    def __post_init__(self) -> None:
        check_range("eval.every", self.every, 0)


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
    """Checkpoint folder to start RL from; ``None`` with ``sft.steps > 0``: warm-start with SFT first."""
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
    env: EnvConfig = field(default_factory=EnvConfig)

    def __post_init__(self) -> None:
        # lazy: moerl.rl imports torch, and the config must load without it (``moerl --help``, YAML checks);
        # not a cycle: moerl.rl.presets needs this module only for type checking
        from moerl.rl.presets import preset_from_config

        if not self.name or self.name in (".", "..") or any(c in self.name for c in "/\\"):
            raise ConfigError(
                f"name={self.name!r} must be a plain folder name (no '/' or '\\'); "
                "set output_dir to put runs elsewhere"
            )
        try:
            estimator = preset_from_config(self.algorithm).estimator
        except ValueError as e:  # a combination the per-field checks cannot see
            raise ConfigError(f"algorithm: {e}") from e
        check_episode_run(self.task.name, self.rollout.return_routed_experts)
        if estimator in ("grpo", "dr_grpo", "rloo") and self.rollout.group_size < 2:
            raise ConfigError(
                f"rollout.group_size={self.rollout.group_size}: the {estimator} estimator compares samples "
                "of one prompt, so a group needs at least 2 (every advantage would be 0)"
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
        text = Path(path).read_text()
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
            raise ConfigError(f"{path}{where}: not valid YAML ({getattr(e, 'problem', None) or e})") from e
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
    apply_overrides(data, overrides or [])
    return from_dict(RunConfig, data)


def save_config(cfg: RunConfig, path: str | Path) -> None:
    """Write the resolved config as YAML (atomically: ``moerl.atomic``)."""
    atomic_write_text(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))
