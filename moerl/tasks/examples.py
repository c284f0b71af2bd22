"""Tokenized solution examples: what the SFT warm start trains on and teacher-forced eval scores.

Each example is ``prompt_ids + solution_ids + [eos]``; completion tokens (solution and eos) carry the
loss, the prompt is masked out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moerl.tasks.base import Prompt
from moerl.tasks.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class Example:
    """One tokenized SFT example: ``ids`` = prompt + solution + eos; ``num_prompt`` prompt tokens.
    ``mask`` (length ``len(ids)``, 1 = trained) replaces "everything after the prompt" when given, e.g.
    for multi-turn demonstrations whose observations are not trained (``moerl.envs.task``)."""

    ids: list[int]
    num_prompt: int
    mask: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class SFTBatch:
    """Right-padded SFT batch.

    Attributes:
        input_ids: [B, T] int64, padded with the tokenizer's pad id.
        attention_mask: [B, T] int64, 1 = token, 0 = padding.
        loss_mask: [B, T] float32, 1 where the token is a completion token (solution or eos); the
            loss at position t predicts token t from tokens < t.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor


def encode_example(tokenizer: Tokenizer, prompt: Prompt) -> Example:
    """Tokenize ``prompt.text`` + ``prompt.solution`` + eos.

    Raises:
        ValueError: the prompt has no solution, or the solution encodes to no tokens.
    """
    if not prompt.solution:
        raise ValueError(f"prompt {prompt.id!r} has no solution to fine-tune on")
    prompt_ids = tokenizer.encode(prompt.text)
    return Example(prompt_ids + tokenizer.encode(prompt.solution) + [tokenizer.eos_id], len(prompt_ids))


def collate(examples: list[Example], pad_id: int, device: torch.device | str = "cpu") -> SFTBatch:
    """Right-pad examples to the longest one (see ``SFTBatch``); tensors are moved to ``device``."""
    t = max(len(e.ids) for e in examples)
    input_ids = torch.full((len(examples), t), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), t), dtype=torch.long)
    loss_mask = torch.zeros((len(examples), t), dtype=torch.float32)
    for i, e in enumerate(examples):
        input_ids[i, : len(e.ids)] = torch.tensor(e.ids)
        attention_mask[i, : len(e.ids)] = 1
        if e.mask is None:
            loss_mask[i, e.num_prompt : len(e.ids)] = 1.0
        else:
            loss_mask[i, : len(e.ids)] = torch.tensor(e.mask, dtype=torch.float32)
    return SFTBatch(input_ids.to(device), attention_mask.to(device), loss_mask.to(device))
