"""SFT building blocks with hand-computed values: batching, completion-only loss, LR schedule."""

import math
from types import SimpleNamespace

import pytest
import torch

from moerl.tasks import Prompt, load_tokenizer
from moerl.tasks.eval import teacher_forced_exact_match
from moerl.tasks.sft import Example, collate, completion_nll, encode_example, lr_at


def test_encode_example_and_collate():
    tok = load_tokenizer(None)
    ex = encode_example(tok, Prompt(id="a", text="1+2=", answer="3", solution="3"))
    assert ex == Example(tok.encode("1+2=3") + [tok.eos_id], 4)
    batch = collate([ex, Example([5, 6, 7], 1)], pad_id=0)
    assert batch.input_ids.tolist() == [tok.encode("1+2=3") + [1], [5, 6, 7, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1] * 6, [1, 1, 1, 0, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 0, 0, 0, 1, 1], [0, 1, 1, 0, 0, 0]]
    with pytest.raises(ValueError, match="has no solution"):
        encode_example(tok, Prompt(id="b", text="x", answer="y"))


def test_completion_nll_masks_prompt_and_padding():
    batch = collate([Example([3, 4, 5], 1), Example([6, 7], 1)], pad_id=0)
    vocab = 8
    logits = torch.zeros(2, 3, vocab)
    # uniform predictions give log(V) per completion token
    assert completion_nll(logits, batch).item() == pytest.approx(math.log(vocab))
    # make the 3 completion targets (4, 5 in row 0; 7 in row 1) certain; prompt/pad positions are ignored
    logits[0, 0, 4] = logits[0, 1, 5] = logits[1, 0, 7] = 100.0
    logits[1, 1, :] = torch.randn(vocab) * 50  # predicts the padding position: must not count
    assert completion_nll(logits, batch).item() == pytest.approx(0.0, abs=1e-6)
    # one target at probability 1/2: loss = log(2) / 3 tokens
    logits[0, 1, 5], logits[0, 1, 6] = 100.0, 100.0
    assert completion_nll(logits, batch).item() == pytest.approx(math.log(2) / 3, rel=1e-5)


def test_lr_schedule_hand_computed():
    assert lr_at(0, 100, 1.0, 10) == pytest.approx(0.1)
    assert lr_at(9, 100, 1.0, 10) == pytest.approx(1.0)
    assert lr_at(10, 100, 1.0, 10) == pytest.approx(1.0)
    assert lr_at(55, 100, 1.0, 10) == pytest.approx(0.55)  # half-way through the cosine
    assert lr_at(100, 100, 2.0, 10) == pytest.approx(0.2)  # floor: 10% of the peak
    assert lr_at(0, 100, 1.0, 0) == pytest.approx(1.0)


class _Oracle(torch.nn.Module):
    """Predicts the input's own next token at every position (a perfect model), except at ``wrong_at``."""

    def __init__(self, wrong_at=None):
        super().__init__()
        self.wrong_at = wrong_at

    def forward(self, input_ids, attention_mask=None):
        b, t = input_ids.shape
        logits = torch.zeros(b, t, 99)
        for i in range(b):
            for j in range(t - 1):
                nxt = int(input_ids[i, j + 1])
                logits[i, j, (nxt + 1) % 99 if self.wrong_at == (i, j) else nxt] = 1.0
        return SimpleNamespace(logits=logits)


def test_teacher_forced_exact_match_counts_whole_completions():
    tok = load_tokenizer(None)
    prompts = [Prompt(id=str(i), text=f"{i}+1=", answer=str(i + 1), solution=str(i + 1)) for i in (8, 9)]
    last = len(encode_example(tok, prompts[1]).ids) - 2  # the position that predicts eos
    assert teacher_forced_exact_match(_Oracle(), tok, prompts) == 1.0
    # a wrong prediction inside the prompt does not matter; inside the completion it does
    assert teacher_forced_exact_match(_Oracle(wrong_at=(0, 0)), tok, prompts) == 1.0
    assert teacher_forced_exact_match(_Oracle(wrong_at=(1, last)), tok, prompts) == 0.5
