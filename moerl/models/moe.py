"""The Mixture-of-Experts block: router, stacked experts with a grouped GEMM, shared experts, aux losses.

Shape legend: N tokens (B * T flattened), H hidden size, E routed experts, k experts per token
(top-k), I expert intermediate size, M = N * k expert-sorted token copies, G expert groups.

The seam used by ``moerl.ep``: ``MoeBlock.experts`` is any module with the call signature of
``Experts.forward(x [N, H], topk_idx [N, k] int64, topk_weights [N, k] float32) -> [N, H]``; replace it
on every block returned by ``MoeForCausalLM.moe_blocks()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moerl.models.config import MoeConfig
from moerl.models.kernels import fused_experts, fused_experts_supported
from moerl.models.layers import DenseMLP
from moerl.models.moe_kernels import fused_route, fused_route_supported, router_logits_from_bf16


def softmax_rows(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim of x [N, E], computed as a softmax over dim 0 of the transposed view.

    Same values (to float round-off) as ``x.softmax(-1)``; PyTorch's CPU softmax vectorizes across the
    dimensions after the reduced one, so a short last dim (E = 8) runs ~2x slower forward and backward
    (measured at 1 thread, N = 2560). Other devices use ``softmax(-1)``.
    """
    if x.device.type != "cpu":
        return x.softmax(-1)
    return x.t().softmax(0).t()


@dataclass(frozen=True, slots=True)
class RouterOutput:
    """What the router decided for N tokens."""

    router_logits: torch.Tensor
    """[N, E] float32, raw (before softmax/sigmoid and before the correction bias)."""
    topk_idx: torch.Tensor
    """[N, k] int64 chosen experts."""
    topk_weights: torch.Tensor
    """[N, k] float32 combine weights (normalized / scaled as configured)."""


def route(
    router_logits: torch.Tensor,
    *,
    top_k: int,
    scoring_func: str = "softmax",
    norm_topk_prob: bool = False,
    routed_scaling_factor: float = 1.0,
    n_group: int = 1,
    topk_group: int = 1,
    correction_bias: torch.Tensor | None = None,
    forced_idx: torch.Tensor | None = None,
) -> RouterOutput:
    """Top-k routing of router logits [N, E] float32.

    scores = softmax(logits) (Shazeer et al. 2017) or sigmoid(logits) (DeepSeek-V3, arXiv:2412.19437
    Eq. 13). Selection uses scores + ``correction_bias`` (DeepSeek-V3 Eq. 16, auxiliary-loss-free
    balancing); with ``n_group > 1`` only the ``topk_group`` groups with the largest sum of their two
    best scores are eligible, the others masked to -inf (DeepSeek-V3 device-limited routing). The
    combine weights are the *unbiased* scores of the chosen experts, renormalized per token when
    ``norm_topk_prob`` (divided by their sum; +1e-20 for sigmoid scores), then times
    ``routed_scaling_factor``. ``forced_idx`` [N, k] int64 skips selection (rollout routing replay).

    Raises:
        ValueError: forced_idx of the wrong shape or with ids outside [0, E).
    """
    n, e = router_logits.shape
    logits = router_logits.float()
    plain = scoring_func == "softmax" and correction_bias is None and n_group == 1 and forced_idx is None
    if plain and fused_route_supported(logits, top_k):  # inference on CUDA: one Triton kernel
        topk_idx, weights = fused_route(logits, top_k, norm_topk_prob)
        if routed_scaling_factor != 1.0:
            weights = weights * routed_scaling_factor
        return RouterOutput(router_logits=logits, topk_idx=topk_idx, topk_weights=weights)
    scores = softmax_rows(logits) if scoring_func == "softmax" else logits.sigmoid()
    if forced_idx is not None:
        if forced_idx.shape != (n, top_k):
            raise ValueError(
                f"forced_experts has shape {tuple(forced_idx.shape)} per layer; expected {(n, top_k)}"
            )
        if forced_idx.numel() and (int(forced_idx.min()) < 0 or int(forced_idx.max()) >= e):  # device sync
            raise ValueError(f"forced_experts ids must lie in [0, {e})")
        topk_idx = forced_idx.long()
    else:
        choice = scores if correction_bias is None else scores + correction_bias.float()
        if n_group > 1:
            groups = choice.view(n, n_group, e // n_group)
            group_scores = groups.topk(min(2, e // n_group), dim=-1).values.sum(-1)  # (N, G)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
            choice = groups.masked_fill(~keep[..., None], float("-inf")).view(n, e)
        topk_idx = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, topk_idx)
    if norm_topk_prob:
        denom = weights.sum(-1, keepdim=True)
        weights = weights / (denom + 1e-20 if scoring_func == "sigmoid" else denom)
    if routed_scaling_factor != 1.0:  # skipped at 1: one kernel fewer per layer in a decode step
        weights = weights * routed_scaling_factor
    return RouterOutput(router_logits=logits, topk_idx=topk_idx, topk_weights=weights)


def load_balancing_loss(
    router_logits: torch.Tensor, topk_idx: torch.Tensor, token_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Switch/Mixtral load-balancing loss L = E * sum_i f_i * P_i (Fedus et al. 2021, Eq. 4-6).

    f_i: fraction of (non-padding) tokens whose top-k includes expert i (sums to k);
    P_i: mean over the same tokens of softmax(raw router logits)_i. Uniform routing gives k.

    Args:
        router_logits: [N, E] float32. topk_idx: [N, k] int64. token_mask: [N] bool, False = padding.
    Returns:
        scalar float32 (0 when there is no token).
    """
    e = router_logits.shape[-1]
    probs = softmax_rows(router_logits.float())
    if token_mask is not None:
        w = token_mask.float()
        probs = probs * w[:, None]
        n = token_mask.sum().clamp(min=1)
    else:
        w = probs.new_ones(router_logits.shape[0])
        n = max(router_logits.shape[0], 1)
    # Copies per expert: integer sums, exact in float32 in any order (no [N, k, E] one-hot tensor).
    slot_w = w[:, None].expand(topk_idx.shape).reshape(-1)
    counts = probs.new_zeros(e).index_add_(0, topk_idx.reshape(-1), slot_w)
    return e * ((counts / n) * (probs.sum(0) / n)).sum()


def sequence_balance_loss(
    router_logits: torch.Tensor,
    topk_idx: torch.Tensor,
    token_mask: torch.Tensor | None,
    batch_size: int,
    *,
    scoring_func: str = "softmax",
) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss, averaged over the sequences.

    Per sequence of T' real tokens (arXiv:2412.19437 eq. 17-20): ``L = sum_i f_i P_i`` with
    ``f_i = E / (k T') sum_t 1[i in top-k(t)]`` and ``P_i = 1/T' sum_t s'_{i,t}``, where
    ``s'_{i,t} = s_{i,t} / sum_j s_{j,t}`` are the token's normalized scores (softmax or sigmoid of the
    raw router logits). Perfectly balanced routing gives 1 per sequence. The coefficient alpha is the
    trainer's ``aux_loss_coef``.

    Args:
        router_logits: [N, E] float32 with N = batch_size * T. topk_idx: [N, k] int64.
        token_mask: [N] bool (False = padding) or None. batch_size: B.
        scoring_func: ``softmax`` or ``sigmoid``.

    Returns:
        scalar float32, the mean over sequences with at least one token (0 when there is none).
    """
    n, e = router_logits.shape
    k = topk_idx.shape[-1]
    logits = router_logits.float()
    scores = softmax_rows(logits) if scoring_func == "softmax" else logits.sigmoid()
    scores = scores / scores.sum(-1, keepdim=True).clamp_min(1e-20)
    w = torch.ones(n, device=logits.device) if token_mask is None else token_mask.float()
    w = w.view(batch_size, -1, 1)  # (B, T, 1)
    counts = (F.one_hot(topk_idx, e).sum(1).float().view(batch_size, -1, e) * w).sum(1)  # (B, E)
    tokens = w.sum(1)  # (B, 1)
    f = counts * e / (k * tokens.clamp_min(1))
    p = (scores.view(batch_size, -1, e) * w).sum(1) / tokens.clamp_min(1)
    per_seq = (f * p).sum(-1)  # (B,)
    has = tokens[:, 0] > 0
    return (per_seq * has).sum() / has.sum().clamp_min(1)


@torch.no_grad()
def update_correction_bias(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> None:
    """Aux-loss-free balancing step: ``b_i += rate * sign(mean_j c_j - c_i)`` in place.

    An overloaded expert (more tokens than the mean) gets a lower selection bias, an underloaded one a
    higher; the bias only affects which experts are chosen, never the combine weights (``route``).
    Source: DeepSeek-V3, arXiv:2412.19437 sec. 2.1.2 (bias update speed gamma).

    Args:
        bias: [E] float32 ``e_score_correction_bias``, updated in place.
        counts: [E] tokens routed to each expert over the step (all ranks' tokens on a sharded trainer).
        rate: gamma >= 0.
    """
    c = counts.to(bias.device, torch.float32)
    bias.add_(rate * torch.sign(c.mean() - c))


def router_z_loss(router_logits: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Router z-loss mean_tokens (logsumexp_i logits_i)^2 (Zoph et al. 2022, ST-MoE Eq. 5); scalar float32."""
    z = torch.logsumexp(router_logits.float(), dim=-1).pow(2)
    if token_mask is None:
        return z.mean() if z.numel() else z.sum()
    return (z * token_mask.float()).sum() / token_mask.sum().clamp(min=1)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: ``torch._grouped_mm``'s CPU
    backward rejects the stride-0 gradients that ``sum()`` produces."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return g.contiguous()


def grouped_mm_supported(x: torch.Tensor, *widths: int) -> bool:
    """Whether ``torch._grouped_mm`` can run here: it exists, the dtype suits the device and every row
    stride is 16-byte aligned.

    CPU: float32 or bfloat16. CUDA: compute capability >= 9.0 (checked on an H200 with torch 2.11:
    bfloat16, float16 and float32 match the loop exactly, forward and backward); older GPUs use the loop.
    """
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cpu":
        ok = x.dtype in (torch.float32, torch.bfloat16)
    elif x.device.type == "cuda":
        ok = torch.cuda.get_device_capability(x.device) >= (9, 0)
        ok = ok and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
    else:
        ok = False
    return ok and all((w * x.element_size()) % 16 == 0 for w in widths)


def grouped_expert_mlp(
    x_sorted: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    use_grouped_mm: bool | None = None,
) -> torch.Tensor:
    """SwiGLU experts on expert-sorted tokens: y_m = down_e (silu(g) * u), [g, u] = gate_up_e x_m.

    Args:
        x_sorted: [M, H] tokens sorted by expert (expert 0's first).
        tokens_per_expert: [E] int64 rows of each expert; sums to M.
        gate_up: [E, 2I, H] (gate rows first, then up). down: [E, H, I].
        use_grouped_mm: True forces ``torch._grouped_mm`` (one grouped GEMM per projection), False the
            per-expert loop (one device sync for the split sizes); None picks grouped where supported.
    Returns:
        [M, H] in x_sorted's dtype.
    """
    i2, h = gate_up.shape[1], gate_up.shape[2]
    if use_grouped_mm is None:
        use_grouped_mm = grouped_mm_supported(x_sorted, h, i2, i2 // 2)
    if use_grouped_mm and x_sorted.shape[0] > 0:  # the grouped backward rejects M = 0 (an idle EP rank)
        offs = tokens_per_expert.cumsum(0).to(torch.int32)
        gu = _ContiguousGrad.apply(
            torch._grouped_mm(x_sorted.contiguous(), gate_up.transpose(-2, -1), offs=offs)
        )
        gate, up = gu.chunk(2, dim=-1)
        act = (F.silu(gate) * up).contiguous()
        return _ContiguousGrad.apply(torch._grouped_mm(act, down.transpose(-2, -1), offs=offs))
    outs = []
    for e, x_e in enumerate(x_sorted.split(tokens_per_expert.tolist())):  # .tolist(): device sync
        gate, up = F.linear(x_e, gate_up[e]).chunk(2, dim=-1)
        outs.append(F.linear(F.silu(gate) * up, down[e]))
    return torch.cat(outs) if outs else x_sorted.new_zeros(0, h)


def dense_experts(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """sum_j w_j expert_{idx_j}(x) [N, H] computed by every expert for every token, with no host sync.

    The path of a CUDA-graph capture where the fused bf16 kernels do not apply (float32 on CUDA): the
    sorted path's ``bincount`` and ``torch._grouped_mm``'s float32 fallback both read from the host, which a
    capture forbids. E/k times the FLOPs of the routed computation, so used only inside a capture (decode
    steps of small batches); weighted and summed in float32 as the sorted path.

    Args:
        x: [N, H]. topk_idx: [N, k] int64. topk_weights: [N, k]. gate_up: [E, 2I, H]. down: [E, H, I].
    Returns:
        [N, H] in x's dtype.
    """
    acc = torch.promote_types(x.dtype, torch.float32)
    weights = torch.zeros(x.shape[0], gate_up.shape[0], dtype=acc, device=x.device)  # [N, E]
    weights.scatter_add_(1, topk_idx, topk_weights.to(acc))
    gate, up = torch.einsum("nh,eoh->neo", x, gate_up).chunk(2, dim=-1)  # [N, E, I] each
    y = torch.einsum("nei,ehi->neh", F.silu(gate) * up, down)  # [N, E, H]
    return (y.to(acc) * weights[..., None]).sum(1).to(x.dtype)


class Experts(nn.Module):
    """E routed SwiGLU experts stored stacked: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, use_grouped_mm: bool | None = None
    ) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.use_grouped_mm = use_grouped_mm

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [N, H], topk_idx [N, k] int64, topk_weights [N, k] float32 -> sum_j w_j expert_{idx_j}(x) [N, H]."""
        return experts_forward(
            x, topk_idx, topk_weights, self.gate_up_proj, self.down_proj, use_grouped_mm=self.use_grouped_mm
        )


def experts_forward(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    use_grouped_mm: bool | None = None,
) -> torch.Tensor:
    """The function of ``Experts.forward`` on given stacked weights (also the reference path of the
    FP8 experts, ``moerl.models.fp8.Fp8Experts``, on their dequantized weights).

    Args:
        x: [N, H]. topk_idx: [N, k] int64. topk_weights: [N, k] float32. gate_up: [E, 2I, H].
        down: [E, H, I]. use_grouped_mm: see ``grouped_expert_mlp``.
    Returns:
        sum_j w_j expert_{idx_j}(x) [N, H] in x's dtype.
    """
    if fused_experts_supported(x, gate_up, down):  # CUDA bf16: no host sync
        return fused_experts(x, topk_idx, topk_weights, gate_up, down)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():  # a CUDA graph of a decode step
        return dense_experts(x, topk_idx, topk_weights, gate_up, down)
    n, k = topk_idx.shape
    flat = topk_idx.reshape(-1)
    order = flat.argsort(stable=True)  # (M,) expert-sorted copy -> flat slot
    token = order // k
    tokens_per_expert = torch.bincount(flat, minlength=gate_up.shape[0])
    y = grouped_expert_mlp(  # index_select: its backward is index_add_, ~2x cheaper than x[token]'s
        x.index_select(0, token), tokens_per_expert, gate_up, down, use_grouped_mm=use_grouped_mm
    )
    # weighted and summed in float32, rounded once (as fused_experts): a bf16 index_add_ would round
    # after each of a token's k adds
    acc = torch.promote_types(x.dtype, torch.float32)
    y = y.to(acc) * topk_weights.reshape(-1)[order, None].to(acc)
    return torch.zeros(n, x.shape[-1], dtype=acc, device=x.device).index_add_(0, token, y).to(x.dtype)


@dataclass(frozen=True, slots=True)
class MoeLayerStats:
    """Per-layer router results collected by the model. The two losses are computed when read, so a
    forward whose caller never reads them (the rollout engine's decode step) launches none of their
    kernels."""

    topk_idx: torch.Tensor
    """[N, k] int64."""
    router_logits: torch.Tensor
    """[N, E] float32 raw router logits."""
    token_mask: torch.Tensor | None = None
    """[N] bool, False = padding (excluded from the losses); None = all tokens."""
    balance_level: str = "batch"
    """``batch``: ``load_balancing_loss``; ``sequence``: ``sequence_balance_loss`` (``MoeBlock.aux_loss_level``)."""
    batch_size: int = 1
    """B of the N = B * T tokens (for ``sequence``)."""
    scoring_func: str = "softmax"
    """The router's scoring function (for ``sequence``)."""

    @property
    def aux_loss(self) -> torch.Tensor:
        """scalar float32, the balance loss of this layer at ``balance_level`` (computed on each read)."""
        if self.balance_level == "sequence":
            return sequence_balance_loss(
                self.router_logits,
                self.topk_idx,
                self.token_mask,
                self.batch_size,
                scoring_func=self.scoring_func,
            )
        return load_balancing_loss(self.router_logits, self.topk_idx, self.token_mask)

    @property
    def z_loss(self) -> torch.Tensor:
        """scalar float32, ``router_z_loss`` of this layer (computed on each read)."""
        return router_z_loss(self.router_logits, self.token_mask)


class Router(nn.Module):
    """Linear router ``weight [E, H]`` (logits in float32) and optional ``e_score_correction_bias [E]``."""

    def __init__(self, cfg: MoeConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        if cfg.use_score_correction_bias:
            # A buffer, not a parameter: updated by a balancing rule, never by gradients (DeepSeek-V3 sec. 2.1.2).
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor, forced_idx: torch.Tensor | None = None) -> RouterOutput:
        """x [N, H] -> ``RouterOutput``; see ``route``."""
        c = self.cfg
        logits = router_logits_from_bf16(x, self.weight)  # inference on CUDA: one GEMM, no casts
        if logits is None:
            logits = F.linear(x.float(), self.weight.float())
        return route(
            logits,
            top_k=c.num_experts_per_tok,
            scoring_func=c.scoring_func,
            norm_topk_prob=c.norm_topk_prob,
            routed_scaling_factor=c.routed_scaling_factor,
            n_group=c.n_group,
            topk_group=c.topk_group,
            correction_bias=self.e_score_correction_bias,
            forced_idx=forced_idx,
        )


class MoeBlock(nn.Module):
    """router -> experts (+ shared experts, optionally gated by sigmoid(w . x)); x [B, T, H] -> [B, T, H].

    ``aux_loss_level``: ``"batch"`` (``load_balancing_loss`` over all tokens) or ``"sequence"``
    (``sequence_balance_loss``); set by the trainer from ``trainer.aux_loss_level``.
    """

    def __init__(self, cfg: MoeConfig) -> None:
        super().__init__()
        self.aux_loss_level = "batch"
        self.router = Router(cfg)
        self.experts: nn.Module = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_experts = (
            DenseMLP(cfg.hidden_size, cfg.shared_intermediate_size) if cfg.shared_intermediate_size else None
        )
        self.shared_expert_gate = (
            nn.Linear(cfg.hidden_size, 1, bias=False) if cfg.shared_expert_gate else None
        )

    def forward(
        self, x: torch.Tensor, token_mask: torch.Tensor | None = None, forced_idx: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, MoeLayerStats]:
        """x [B, T, H]; token_mask [B*T] bool (False = padding, excluded from the losses);
        forced_idx [B*T, k] int64 replaces the router's choice. Returns the output and ``MoeLayerStats``."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        r = self.router(x, forced_idx)
        y = self.experts(x, r.topk_idx, r.topk_weights)
        if self.shared_experts is not None:
            s = self.shared_experts(x)
            if self.shared_expert_gate is not None:
                s = torch.sigmoid(self.shared_expert_gate(x)) * s
            y = y + s
        stats = MoeLayerStats(
            topk_idx=r.topk_idx,
            router_logits=r.router_logits,
            token_mask=token_mask,
            balance_level=self.aux_loss_level,
            batch_size=shape[0],
            scoring_func=self.router.cfg.scoring_func,
        )
        return y.view(shape), stats
