"""``TrainerConfig``: the policy trainer's section of the run config (``trainer:``), re-exported by
``moerl.config``: optimizer and LR schedule, micro-/mini-batches and policy epochs, checkpoints, and the
trainer group's layout (``num_ranks``, ``ep_size``, ``ep_dispatcher``, ``gpus_per_node``).
"""

from __future__ import annotations

from dataclasses import dataclass

from moerl.configlib import ConfigError, check_choice, check_range


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
    mtp_loss_weight: float = 0.0
    """Weight of the multi-token-prediction loss (``moerl.models.mtp.mtp_loss``, DeepSeek-V3 Eq. 24-25 at
    depth 1) added to the RL loss on the trainer's batches; it trains only the MTP module (the policy's
    hidden states enter detached), which is published with each version like the policy, so the draft
    of ``rollout.speculative=mtp`` tracks the policy. A policy without an MTP module gets a fresh one.
    0: off. One-process trainer only (``trainer.num_ranks`` 1). Metrics ``train/mtp_loss``,
    ``train/mtp_accuracy``."""
    aux_loss_coef: float = 0.0
    """Coefficient of the MoE load-balancing loss. The loss is computed per micro-batch (over its tokens,
    weighted by its share of the mini-batch's rows), on a sharded trainer per micro-batch of each rank
    (as Megatron-LM's default): it equals the one-rank trainer's when each rank's part of a mini-batch is
    a multiple of ``micro_batch_size`` rows (then the micro-batches are the same rows); otherwise the
    ranks' micro-batches are smaller and so is the set of tokens each balance term sees."""
    aux_loss_level: str = "batch"
    """Load-balancing loss over the micro-batch's tokens (``batch``: Switch, Fedus et al. 2021, eq. 4-6) or
    per sequence and averaged (``sequence``: DeepSeek-V3's complementary sequence-wise loss, arXiv:2412.19437
    eq. 17-20). ``sequence`` needs ``aux_loss_coef > 0``."""
    bias_update_rate: float = 0.0
    """Aux-loss-free load balancing (DeepSeek-V3, arXiv:2412.19437 sec. 2.1.2): after every optimizer step
    each router's ``e_score_correction_bias`` moves by this rate gamma times the sign of its expert's load
    error (mean load - load). 0 disables it; DeepSeek-V3 used 0.001. Needs a model with the bias
    (families deepseek_v3, glm4_moe)."""
    recompute_proximal: bool = False
    """Recompute proximal (old) log-probs with an extra no-grad forward before the update. Off: the
    proximal policy is the trainer's weights at the step's start, read from the first forward (exact for
    one update per step), and the mismatch correction uses the engine's behaviour log-probs without any
    extra forward. Needed for ``ppo_epochs * mini_batches > 1`` with a mismatch correction."""
    ppo_epochs: int = 1
    """Passes over each step's batch (PPO epochs, Schulman et al. 2017, Alg. 1); each pass makes
    ``mini_batches`` optimizer steps. The policy version still advances by one per trainer step."""
    mini_batches: int = 1
    """Optimizer steps per epoch: the batch's groups are split into this many mini-batches (each with its
    own token/sequence normalizers); at most ``batch_groups``. With ``num_ranks > 1`` each rank trains an
    equal part of every mini-batch, so ``batch_groups`` must be a multiple of ``num_ranks x mini_batches``."""
    critic_lr: float | None = None
    """Peak learning rate of the critic's AdamW (estimator gae); None: ``10 x lr``, since the value head
    starts from zero while the trunk is the warm-started policy's."""
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
    num_ranks: int = 1
    """Size of the training group (torch.distributed ranks; one GPU each on a GPU machine, gloo
    processes on CPU). 1: today's one-process trainer. Every rank is a data-parallel rank: dense
    parameters are sharded with FSDP2 over all of them (``moerl.trainer.distributed``)."""
    ep_size: int = 1
    """Expert-parallel degree: the routed experts of every MoE layer are split over groups of this many
    consecutive ranks (EP ranks), and each EP shard is FSDP2-sharded over the ``num_ranks / ep_size``
    ranks that hold the same experts. Divides ``num_ranks`` and the number of experts."""
    ep_dispatcher: str = "alltoall"
    """Token dispatch/combine between EP ranks: ``alltoall`` (one flat all-to-all) or ``hierarchical``
    (intra-node gather, one cross-node transfer per node pair; ``moerl.ep``)."""
    gpus_per_node: int = 8
    """Ranks per node: the node topology the hierarchical dispatcher and the placement use (on CPU it
    simulates nodes). An EP group of more ranks than this spans ``ep_size / gpus_per_node`` nodes."""
    collective_timeout_s: float = 120.0
    """Seconds a trainer rank waits in a collective for its peers (``num_ranks > 1``) before its step fails
    and the run restarts the group from its newest checkpoint: a rank that died, hung, or sits behind a
    cut link. The driver waits 10 x this for a whole step's replies."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them
    (per-layer activation checkpointing, Chen et al. 2016, "Training Deep Nets with Sublinear Memory
    Cost"): less memory for one more forward pass."""

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
        check_range("trainer.mtp_loss_weight", self.mtp_loss_weight, 0.0)
        if self.mtp_loss_weight > 0 and self.num_ranks > 1:
            raise ConfigError(
                f"trainer.mtp_loss_weight={self.mtp_loss_weight} needs the one-process trainer "
                f"(trainer.num_ranks=1, got {self.num_ranks})"
            )
        check_choice("trainer.aux_loss_level", self.aux_loss_level, ["batch", "sequence"])
        check_range("trainer.bias_update_rate", self.bias_update_rate, 0.0)
        check_range("trainer.ppo_epochs", self.ppo_epochs, 1)
        check_range("trainer.mini_batches", self.mini_batches, 1)
        if self.critic_lr is not None:
            check_range("trainer.critic_lr", self.critic_lr, 0.0, 1.0, lo_open=True)
        if self.aux_loss_level == "sequence" and self.aux_loss_coef == 0:
            raise ConfigError("trainer.aux_loss_level='sequence' needs trainer.aux_loss_coef > 0")
        check_range("trainer.publish_every", self.publish_every, 1)
        check_range("trainer.checkpoint_every", self.checkpoint_every, 0)
        check_range("trainer.max_nan_steps", self.max_nan_steps, 1)
        check_range("trainer.num_ranks", self.num_ranks, 1)
        check_range("trainer.collective_timeout_s", self.collective_timeout_s, 0.0, lo_open=True)
        check_range("trainer.ep_size", self.ep_size, 1)
        from moerl.ep.registry import DISPATCHERS  # here: moerl.ep loads torch, this module must not

        check_choice("trainer.ep_dispatcher", self.ep_dispatcher, DISPATCHERS)
        check_range("trainer.gpus_per_node", self.gpus_per_node, 1)
        if self.num_ranks % self.ep_size:
            raise ConfigError(
                f"trainer.ep_size={self.ep_size} does not divide trainer.num_ranks={self.num_ranks}; "
                "EP groups are ep_size consecutive ranks"
            )
        ranks_per_node = min(self.gpus_per_node, self.ep_size)
        if self.ep_size % ranks_per_node:
            raise ConfigError(
                f"trainer.ep_size={self.ep_size} is not a multiple of trainer.gpus_per_node="
                f"{self.gpus_per_node}: an EP group spans whole nodes"
            )
        if self.batch_groups % self.num_ranks:
            raise ConfigError(
                f"trainer.batch_groups={self.batch_groups} is not a multiple of trainer.num_ranks="
                f"{self.num_ranks}: every data-parallel rank trains the same number of whole groups"
            )
        if self.num_ranks > 1 and self.batch_groups % (self.num_ranks * self.mini_batches):
            raise ConfigError(
                f"trainer.batch_groups={self.batch_groups} is not a multiple of trainer.num_ranks x "
                f"trainer.mini_batches={self.num_ranks * self.mini_batches}: every rank trains an equal part "
                "of each mini-batch"
            )
