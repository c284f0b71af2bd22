"""Config of a learned reward model (``reward:`` in a run config); re-exported by ``moerl.config``,
which composes it into ``RunConfig``. The model runs in ``moerl.runtime.reward`` (sync mode, in process)
or on reward worker actors (``moerl.runtime.ray.reward_pool``, async mode)."""

from __future__ import annotations

from dataclasses import dataclass

from moerl.configlib import check_choice, check_range


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """A Hugging Face reward model that scores every completed group before it enters the buffer.

    The model scores each sample's prompt + response token ids as the policy's tokenizer produced them,
    so it must share the policy's vocabulary (ids outside its vocabulary are refused). Unset
    ``model_path``: only the task's verifiable reward.
    """

    model_path: str | None = None
    """Sequence-classification folder (config.json + safetensors: a causal LM body and a ``score``
    head, e.g. ``Qwen3ForSequenceClassification``, ``LlamaForSequenceClassification``,
    ``Qwen3MoeForSequenceClassification``), run on moerl's model code; another body is refused at load."""
    combine: str = "sum"
    """How the score joins the task's verifiable reward: ``sum`` (task_weight * verifiable +
    model_weight * score) or ``model`` (model_weight * score alone) (``moerl.rl.reward_mix``)."""
    normalize: str = "none"
    """Score normalization before the combine: ``none``, ``group`` (z-score within each group, GRPO) or
    ``batch`` (z-score over one scored delivery, Ziegler et al. 2019) (``moerl.rl.reward_mix``)."""
    task_weight: float = 1.0
    """Weight of the verifiable reward in ``combine: sum``."""
    model_weight: float = 1.0
    """Weight of the (normalized) score."""
    batch_size: int = 32
    """Sequences per reward-model forward."""
    num_workers: int = 1
    """Reward worker actors (async mode), each holding the model; sync mode scores in process."""
    gpus_per_worker: float = 1.0
    """GPUs each reward worker asks Ray for when ``model.device`` is CUDA; below 1 shares a GPU with
    the rollout workers or the trainer (e.g. 0.25 on a one-GPU machine). Ignored on CPU."""
    cpus_per_worker: float = 1.0
    """CPUs each reward worker asks Ray for (async mode)."""
    timeout_s: float = 120.0
    """Seconds one batch may take on a reward worker; past it the worker is replaced and the batch is
    scored on another."""
    max_attempts: int = 3
    """Tries of one batch (a lost or timed-out worker costs one) before the delivery fails."""
    dtype: str = "float32"
    """Reward model parameter dtype: float32 or bfloat16."""

    def __post_init__(self) -> None:
        from moerl.choices import DTYPE_NAMES
        from moerl.rl.reward_mix import COMBINES, NORMALIZATIONS

        check_choice("reward.combine", self.combine, list(COMBINES))
        check_choice("reward.normalize", self.normalize, list(NORMALIZATIONS))
        check_choice("reward.dtype", self.dtype, list(DTYPE_NAMES))
        check_range("reward.batch_size", self.batch_size, 1)
        check_range("reward.num_workers", self.num_workers, 1)
        check_range("reward.gpus_per_worker", self.gpus_per_worker, 0.0, lo_open=True)
        check_range("reward.cpus_per_worker", self.cpus_per_worker, 0.0)
        check_range("reward.timeout_s", self.timeout_s, 0.0, lo_open=True)
        check_range("reward.max_attempts", self.max_attempts, 1)
        check_range("reward.model_weight", self.model_weight, 0.0)
        check_range("reward.task_weight", self.task_weight, 0.0)
        if self.model_path == "":
            self.model_path = None

    @property
    def is_enabled(self) -> bool:
        """A reward model is configured."""
        return self.model_path is not None
