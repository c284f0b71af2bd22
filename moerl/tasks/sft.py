"""Supervised warm start (``moerl sft``): next-token cross-entropy on task solutions, completion only.

Each example is ``prompt_ids + solution_ids + [eos]``; the loss is the mean negative log-likelihood
of the completion tokens (solution and eos), the prompt is masked out. Optimizer: AdamW with linear
warm-up then cosine decay to 10% of the peak LR (Loshchilov & Hutter 2017, SGDR eq. 5, one cycle).
The MoE load-balancing loss is added with ``sft.aux_loss_coef``; ``train_sft(mtp_loss_weight=w)`` adds
w times the MTP module's loss (``moerl.models.mtp.mtp_loss``, DeepSeek-V3 Eq. 24-25 at depth 1, on the
same completion tokens; it trains the MTP module alone), so a speculative rollout's draft starts trained.

Output: a Hugging Face checkpoint folder (``config.json`` + safetensors) with the tokenizer
(``tokenizer.json``, ``tokenizer_config.json``) and ``sft_summary.json`` (``SFTSummary``).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from moerl.atomic import atomic_write_text
from moerl.lr_schedule import warmup_cosine_lr
from moerl.models import build_model, save_pretrained
from moerl.models.checkpoint import INDEX_FILE
from moerl.models.mtp import attach_fresh_mtp, mtp_loss
from moerl.tasks import make_task
from moerl.tasks.base import Prompt
from moerl.tasks.eval import METRIC_NAMES, evaluate
from moerl.tasks.examples import Example, SFTBatch, collate, encode_example
from moerl.tasks.tokenizer import (
    MODEL_COMPANIONS,
    TOKENIZER_COMPANIONS,
    Tokenizer,
    copy_companions,
    load_run_tokenizer,
)

if TYPE_CHECKING:  # the config sits above this package (docs/architecture.md, Layers)
    from moerl.config import RunConfig, SFTConfig

log = logging.getLogger(__name__)

SUMMARY_FILE = "sft_summary.json"
_OUTPUT_FILES = frozenset(
    {"config.json", "model.safetensors", INDEX_FILE, "tokenizer.json", "tokenizer_config.json", SUMMARY_FILE}
    | set(TOKENIZER_COMPANIONS)
    | set(MODEL_COMPANIONS)
)
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def is_sft_file(name: str) -> bool:
    """Whether ``name`` is one of the files ``run_sft`` writes into its output folder: ``save_pretrained``'s
    (``config.json``, ``model.safetensors`` or its shards and index), the tokenizer's and ``sft_summary.json``.
    ``moerl sft --out`` replaces only a folder of such files (``moerl.cli``)."""
    return name in _OUTPUT_FILES or _SHARD_FILE.fullmatch(name) is not None


@dataclass(frozen=True, slots=True)
class SFTSummary:
    """What one SFT run did; written as ``sft_summary.json`` beside the checkpoint.

    Attributes:
        accuracy_before, accuracy_after: greedy held-out accuracy (``moerl.tasks.eval.evaluate``) in [0, 1].
        num_eval: held-out prompts evaluated.
        steps: optimizer steps taken.
        final_loss: mean completion NLL (nats/token) over the last 10% of steps.
        train_seconds: wall time of the optimization loop; total_seconds: including both evals and saving.
    """

    accuracy_before: float
    accuracy_after: float
    num_eval: int
    steps: int
    final_loss: float
    train_seconds: float
    total_seconds: float


def completion_nll(logits: torch.Tensor, batch: SFTBatch) -> torch.Tensor:
    """Mean NLL (nats/token) of the completion tokens: logits [B, T, V] predict input_ids shifted by one.

    Returns:
        A scalar: sum over masked positions of -log p(token_t | tokens < t), divided by their count.
    """
    targets = batch.input_ids[:, 1:]  # [B, T-1]
    mask = batch.loss_mask[:, 1:]
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), reduction="none")
    return (nll * mask.flatten()).sum() / mask.sum().clamp(min=1.0)


def lr_at(step: int, num_steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay from ``peak`` to ``0.1 * peak`` at the end
    (``moerl.lr_schedule.warmup_cosine_lr``)."""
    return warmup_cosine_lr(step, num_steps, warmup, peak)


def _examples(
    tokenizer: Tokenizer, prompts: list[Prompt], limit: int, encode=encode_example
) -> list[Example]:
    examples = [encode(tokenizer, p) for p in prompts]
    too_long = sum(len(e.ids) > limit for e in examples)
    if too_long == len(examples):
        raise ValueError(f"every SFT example is longer than model.max_position_embeddings={limit}")
    if too_long:
        log.warning("sft: dropping %d examples longer than %d tokens", too_long, limit)
    return [e for e in examples if len(e.ids) <= limit]


def _clip_groups(model: torch.nn.Module) -> list[list[torch.nn.Parameter]]:
    """Parameters clipped together (max norm 1 each): the policy's, and apart the MTP module's (if any)."""
    mtp = getattr(model, "mtp_layers", None)
    own = {id(p) for p in mtp.parameters()} if mtp is not None else set()
    groups = [[p for p in model.parameters() if id(p) not in own]]
    return groups + [list(mtp.parameters())] if own else groups


def train_sft(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    train: list[Prompt],
    sft: SFTConfig,
    *,
    seed: int,
    max_len: int,
    log_every: int = 100,
    progress: Callable[[int, int, float], None] | None = None,
    encode: Callable[[Tokenizer, Prompt], Example] = encode_example,
    mtp_loss_weight: float = 0.0,
) -> float:
    """Fine-tune ``model`` in place on ``train`` for ``sft.steps`` steps; returns the final loss.

    Batches are ``sft.batch_size`` examples drawn in shuffled epochs (seeded by ``seed``); examples longer
    than ``max_len`` tokens (the model's context, ``model.max_position_embeddings``) are dropped.
    ``progress(step, num_steps, loss)`` is called after each optimizer step (step 1-based, loss the
    step's completion NLL in nats/token), e.g. ``moerl.telemetry.live.LiveView.warm_start_progress``.
    ``mtp_loss_weight`` > 0 trains the model's multi-token-prediction module beside it (a fresh one,
    ``attach_fresh_mtp``, where it has none): ``mtp_loss_weight * mtp_loss`` (``moerl.models.mtp``; the
    policy's hidden states enter detached, so it moves the MTP module only) is added to each step's loss;
    the returned loss stays the completion NLL.

    Raises:
        ValueError: every example is longer than ``max_len``; ``mtp_loss_weight`` < 0.
    """
    if mtp_loss_weight < 0:
        raise ValueError(f"mtp_loss_weight={mtp_loss_weight} must be >= 0")
    if mtp_loss_weight > 0:  # before the optimizer: the MTP module's parameters train too
        attach_fresh_mtp(model)
    examples = _examples(tokenizer, train, max_len, encode)
    rng = random.Random(seed)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=sft.lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    order: list[int] = []
    recent: list[float] = []
    tail = max(1, sft.steps // 10)
    for step in range(sft.steps):
        if len(order) < sft.batch_size:
            epoch = list(range(len(examples)))
            rng.shuffle(epoch)
            order += epoch
        batch = collate([examples[i] for i in order[: sft.batch_size]], tokenizer.pad_id, device)
        del order[: sft.batch_size]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, sft.steps, sft.lr, sft.warmup_steps)
        out = model(batch.input_ids, batch.attention_mask, return_hidden=mtp_loss_weight > 0)
        loss = completion_nll(out.logits, batch)
        total = loss + sft.aux_loss_coef * out.aux_loss if sft.aux_loss_coef else loss
        if mtp_loss_weight > 0:
            m_loss, _ = mtp_loss(model, out.hidden, batch.input_ids, batch.loss_mask, batch.attention_mask)
            total = total + mtp_loss_weight * m_loss
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        for params in _clip_groups(model):  # the MTP module's gradient never scales the policy's step
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        recent = (recent + [loss.item()])[-tail:]  # .item() syncs; negligible on CPU
        if progress is not None:
            progress(step + 1, sft.steps, recent[-1])
        if log_every and (step + 1) % log_every == 0:
            log.info("sft step %d/%d loss %.4f", step + 1, sft.steps, sum(recent) / len(recent))
    return sum(recent) / len(recent)


def run_sft(
    cfg: RunConfig, out_dir: str | Path, progress: Callable[[int, int, float], None] | None = None
) -> Path:
    """Warm-start the policy: build (or load) the model, fine-tune on the task's solutions, save it.

    Steps: seed torch with ``cfg.seed``; tokenizer = ``task.tokenizer`` or the model folder's or the
    built-in one; model = ``build_model(cfg.model, vocab_size)``; greedy held-out accuracy before;
    ``cfg.sft.steps`` steps on ``cfg.sft.num_examples`` train prompts; accuracy after; save.
    ``progress``: called after each step as ``progress(step, num_steps, loss)`` (see ``train_sft``).

    Returns:
        ``out_dir`` as a ``Path``: a Hugging Face checkpoint folder with the tokenizer and ``sft_summary.json``.

    Raises:
        ValueError: the task's prompts have no solutions, or every example is too long for the model.
    """
    start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    tokenizer = load_run_tokenizer(cfg)
    task = make_task(cfg.task, cfg.env, tokenizer)
    model = build_model(cfg.model, tokenizer.vocab_size)
    held_out = task.eval_prompts()
    eval_kwargs = dict(
        max_new_tokens=cfg.rollout.max_new_tokens,
        max_slots=cfg.rollout.max_slots,
        kv_token_budget=cfg.rollout.kv_token_budget,
    )
    first = evaluate(model, tokenizer, task, held_out, **eval_kwargs)
    before, metric = first.accuracy, METRIC_NAMES[first.metric]
    log.info("sft: held-out accuracy before %.3f (%d prompts)", before, len(held_out))
    train = [p for p in itertools.islice(task.train_prompts(cfg.seed), cfg.sft.num_examples) if p.solution]
    if not train:
        raise ValueError(
            "the task's rows have no SFT targets (no answer and no assistant message): set sft.steps=0 "
            "and start from a trained policy (model.path or init_from)"
        )
    t0 = time.perf_counter()
    final_loss = train_sft(
        model,
        tokenizer,
        train,
        cfg.sft,
        seed=cfg.seed,
        max_len=cfg.model.max_position_embeddings,
        progress=progress,
        encode=getattr(task, "sft_example", encode_example),
    )
    train_seconds = time.perf_counter() - t0
    after = evaluate(model, tokenizer, task, held_out, **eval_kwargs).accuracy
    out = Path(out_dir)
    save_pretrained(
        model, out, extra=lambda folder: save_tokenizer_and_companions(tokenizer, cfg.model.path, folder)
    )
    summary = SFTSummary(
        accuracy_before=before,
        accuracy_after=after,
        num_eval=len(held_out),
        steps=cfg.sft.steps,
        final_loss=final_loss,
        train_seconds=train_seconds,
        total_seconds=time.perf_counter() - start,
    )
    atomic_write_text(out / SUMMARY_FILE, json.dumps(dataclasses.asdict(summary), indent=2))
    log.info(
        "sft: held-out accuracy %.3f -> %.3f in %.1f s; saved %s", before, after, summary.total_seconds, out
    )
    print(
        f"sft: {metric} {before:.3f} -> {after:.3f} ({len(held_out)} prompts), "
        f"loss {final_loss:.3f}, {summary.total_seconds:.1f} s -> {out}"
    )
    return out


def save_tokenizer_and_companions(tokenizer: Tokenizer, model_folder: str | None, folder: str | Path) -> None:
    """Write the tokenizer's files into ``folder`` and copy the model folder's ``MODEL_COMPANIONS``
    (``generation_config.json``): an export keeps what the model came with. Without one, a
    ``generation_config.json`` naming the tokenizer's eos and pad ids is written (transformers' ``generate``
    then stops at eos, as ``moerl generate`` does)."""
    tokenizer.save(folder)
    if model_folder is not None and "://" not in model_folder:
        copy_companions(Path(model_folder), Path(folder), MODEL_COMPANIONS)
    generation = Path(folder) / "generation_config.json"
    if not generation.exists():  # none came with the model: transformers' generate must still stop at eos
        atomic_write_text(  # read by transformers and moerl generate: never seen half-written
            generation,
            json.dumps({"eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}, indent=2) + "\n",
        )


def read_summary(checkpoint: str | Path) -> SFTSummary:
    """The ``SFTSummary`` saved beside an SFT checkpoint.

    Raises:
        FileNotFoundError: the folder has no ``sft_summary.json``.
    """
    return SFTSummary(**json.loads((Path(checkpoint) / SUMMARY_FILE).read_text()))
