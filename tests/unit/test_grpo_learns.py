"""GRPO learns: on one fixed prompt, a few on-policy trainer steps raise the rewarded answer's probability.

The pieces are wired by hand (engine -> scored ``Sample``s -> ``Group`` -> ``Trainer`` -> engine weight
update), without the queue, buffer or controller, so a failure points at the sampling / batch / loss /
optimizer / weight-sync path rather than at the runtime. The reward is 1 when the single generated token
is in a fixed set T of half the vocabulary, so the probability of the rewarded answer is
P(T | prompt) = sum over t in T of softmax(logits)[t], computed exactly from the model's logits.
"""

import torch

from moerl.config import AlgorithmConfig, ModelConfig, TrainerConfig
from moerl.models import build_model
from moerl.records import Group, Lease, RolloutTask, Sample
from moerl.rollout import Engine, Request, SamplingParams
from moerl.trainer.local import LocalTrainer

VOCAB = 16
PAD = 0
PROMPT = (3, 7, 5)
REWARDED = frozenset(range(1, VOCAB, 2))  # odd token ids


def _model() -> torch.nn.Module:
    cfg = ModelConfig(
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        num_experts=4,
        top_k=2,
        moe_intermediate_size=16,
        max_position_embeddings=32,
    )
    return build_model(cfg, VOCAB)


@torch.no_grad()
def _p_rewarded(model: torch.nn.Module) -> float:
    """Exact probability that one sampled token (temperature 1) is rewarded."""
    model.eval()
    ids = torch.tensor([PROMPT])
    probs = model(ids, torch.ones_like(ids)).logits[0, -1].float().softmax(-1)
    return float(probs[sorted(REWARDED)].sum())


def _group(engine: Engine, step: int, n: int) -> Group:
    params = SamplingParams(temperature=1.0, max_new_tokens=1, n=n, seed=1000 + step)
    completions = engine.generate([Request(request_id=f"r{step}", prompt_ids=list(PROMPT), params=params)])
    task = RolloutTask(task_id=f"t{step}", prompt_ids=PROMPT, prompt_text="p", answer="odd", num_samples=n)
    samples = [
        Sample(
            prompt_ids=PROMPT,
            response_ids=c.token_ids,
            response_logprobs=c.logprobs,
            loss_mask=c.loss_mask,
            finish_reason=c.finish_reason,
            policy_versions=c.policy_versions,
            reward=float(c.token_ids[0] in REWARDED),
        )
        for c in sorted(completions, key=lambda c: c.sample_index)
    ]
    return Group.from_lease(Lease(task, "w", step + 1, 0.0), samples, 0.0)


def test_grpo_steps_raise_rewarded_answer_probability():
    torch.manual_seed(0)
    model = _model()
    engine = Engine(_model(), max_slots=32, kv_token_budget=32 * 8, seed=0, version=-1)
    trainer = LocalTrainer(model, TrainerConfig(lr=3e-3, micro_batch_size=64), AlgorithmConfig(preset="grpo"))
    engine.update_weights(trainer.named_weights(), trainer.version)
    before = _p_rewarded(model)
    assert 0.2 < before < 0.8  # a near-uniform random policy: both outcomes are sampled
    kls = []
    for step in range(5):
        groups = [_group(engine, 2 * step + g, n=16) for g in range(2)]
        stats = trainer.train_step(trainer.build_batch(groups, PAD))
        kls.append(abs(stats.ppo_kl))
        engine.update_weights(trainer.named_weights(), trainer.version)
    after = _p_rewarded(model)
    assert max(kls) < 1e-4  # the engine's behaviour log-probs are the trainer's: on-policy
    assert after > before + 0.15, (before, after)
