"""DeepSeek-V3's multi-token-prediction (MTP) module: one more decoder block that predicts the token
after next from the main model's hidden state and the next token's embedding.

Shape legend: B batch, T positions, H hidden size, V vocabulary.

DeepSeek-V3 technical report (arXiv 2412.19437), Sec. 2.2, Eq. 21-23, with the tensor layout of the
Hugging Face release (``config.json`` ``num_nextn_predict_layers``; tensors ``model.layers.{N + j}.*``
for N = ``num_hidden_layers``), which vLLM's and SGLang's ``deepseek_mtp`` read:

    h'_i = eh_proj([enorm(Emb(t_{i+1})); hnorm(h_i)])           (Eq. 21; embedding first, as the release)
    h_i^mtp = block(h'_i)                                       (Eq. 22: one decoder layer, causal)
    logits_i = head(shared_head.norm(h_i^mtp))  ->  P(t_{i+2})  (Eq. 23)

``h_i`` is the main model's last hidden state after its final norm (``CausalLMOutput.hidden``; what
vLLM and SGLang feed the module). The embedding and the output head are the main model's (shared, Sec.
2.2); the release also stores copies as ``model.layers.{N + j}.embed_tokens`` and
``shared_head.head``, which ``save_pretrained`` writes and ``from_pretrained`` reads past. Depth j > 0
chains on depth j - 1's ``h^mtp``; drafting k > depth tokens reuses the last layer on its own output
(as vLLM does).

``MtpLayer`` (in ``model.py``, beside ``DecoderLayer``) is one depth. The MTP layers live in
``MoeForCausalLM.mtp_layers`` so that the state dict, the optimizer, the weight
store and ``update_weights`` carry them like any other tensor; ``MoeForCausalLM.forward`` never runs them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moerl.models.model import MoeForCausalLM, MtpLayer, positions_from_mask


def has_mtp(model: nn.Module) -> bool:
    """Whether ``model`` carries at least one MTP layer."""
    return len(getattr(model, "mtp_layers", ())) > 0


@torch.no_grad()
def attach_fresh_mtp(model: MoeForCausalLM, num_layers: int = 1, std: float = 0.02) -> MoeForCausalLM:
    """Give a model without an MTP module a freshly initialised one (``num_layers`` depths; the model's
    config records ``num_nextn_predict_layers``). A model that has one is returned unchanged.

    The block starts as the model's last decoder layer (a copy: a trained layer drafts better than
    noise), ``eh_proj`` as [0, I] (h' = hnorm(h): the module first passes the main hidden state through),
    norms at 1. Returns the model (modified in place).

    Raises:
        ValueError: ``num_layers`` < 1.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers={num_layers} must be >= 1")
    if has_mtp(model):
        return model
    cfg = model.config.replace(num_nextn_predict_layers=num_layers)
    model.config = cfg
    param = next(model.parameters())
    layers = nn.ModuleList(MtpLayer(cfg, j) for j in range(num_layers)).to(param.device, param.dtype)
    for layer in layers:
        hsz = cfg.hidden_size
        layer.eh_proj.weight.zero_()
        layer.eh_proj.weight[:, hsz:] = torch.eye(hsz, dtype=param.dtype, device=param.device)
        layer.block.load_state_dict(model.layers[-1].state_dict())
    model.mtp_layers = layers
    model.keep_router_buffers_fp32()
    return model


def mtp_loss(
    model: MoeForCausalLM,
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP cross-entropy on a batch (DeepSeek-V3 Eq. 24-25 for depth 1): position i predicts
    t_{i+2} from h_i and t_{i+1}, averaged over the target tokens that ``loss_mask`` marks.

    ``hidden`` is detached: the MTP loss trains the MTP module only, never the policy (the RL loss
    alone moves the policy; the draft follows it).

    Args:
        hidden: [B, T, H] the policy's final hidden states of ``input_ids``.
        input_ids: [B, T] int64.
        loss_mask: [B, T] 1 where the token is a target (response tokens).
        attention_mask: [B, T] 1 = real token; None = all.
    Returns:
        loss (scalar float32, 0 without targets), accuracy (scalar float32: argmax == target share).
    Raises:
        ValueError: the model has no MTP layer.
    """
    if not has_mtp(model):
        raise ValueError(
            "the model has no MTP layer (attach_fresh_mtp or a release with num_nextn_predict_layers)"
        )
    b, t = input_ids.shape
    if t < 3:
        zero = hidden.new_zeros((), dtype=torch.float32)
        return zero, zero
    am = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    pos = positions_from_mask(am)
    h, logits = model.mtp_layers[0](
        model, hidden[:, :-2].detach(), input_ids[:, 1:-1], pos[:, 1:-1], am[:, 1:-1]
    )
    target = input_ids[:, 2:]
    weight = (loss_mask[:, 2:] * am[:, 2:]).float()
    ce = F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), reduction="none").view(b, t - 2)
    n = weight.sum().clamp(min=1.0)
    hit = (logits.argmax(-1) == target).float()
    return (ce * weight).sum() / n, ((hit * weight).sum() / n).detach()
