"""R3 routing replay: the engine's recorded experts travel in the batch and the trainer replays them."""

import copy

import pytest
import torch
from _tiny import tiny_model

from moerl.config import AlgorithmConfig, TrainerConfig
from moerl.records import Group, Lease, RolloutTask, Sample
from moerl.rollout import Engine, Request, SamplingParams
from moerl.trainer.batch import build_train_batch
from moerl.trainer.local import LocalTrainer

VOCAB = 32


def _policy():
    """A 2-layer, 8-expert policy with weights of std 0.3: at the usual 0.02 the experts' outputs are so
    small that no expert choice moves a log-prob; at 0.3 the choices matter, as in a trained model, and
    bf16 rounding flips ~1.5% of the (token, layer) choices (the H200 bench model: 3-4% of slots)."""
    torch.manual_seed(0)
    model = tiny_model(VOCAB, num_layers=2, num_experts=8, hidden_size=32, max_position_embeddings=64)
    model.init_weights(std=0.3)
    return model


def _engine_groups(engine_model, *, num_prompts=6, n=4, new_tokens=10):
    """Groups sampled (in one batched ``generate``) by an engine over ``engine_model``, experts recorded."""
    engine = Engine(engine_model, max_slots=64, kv_token_budget=64 * 32)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, VOCAB, (6,), generator=gen).tolist() for _ in range(num_prompts)]
    requests = [
        Request(
            request_id=f"t{g}",
            prompt_ids=prompt,
            params=SamplingParams(
                temperature=1.0, max_new_tokens=new_tokens, n=n, seed=10 + g, return_routed_experts=True
            ),
        )
        for g, prompt in enumerate(prompts)
    ]
    outs = engine.generate(requests)
    groups = []
    for g, prompt in enumerate(prompts):
        task = RolloutTask(task_id=f"t{g}", prompt_ids=prompt, prompt_text="p", answer="a", num_samples=n)
        samples = [
            Sample(
                prompt_ids=prompt,
                response_ids=c.token_ids,
                response_logprobs=c.logprobs,
                loss_mask=[1] * len(c.token_ids),
                finish_reason=c.finish_reason,
                policy_versions=[0] * len(c.token_ids),
                reward=float(c.sample_index % 2),
                routed_experts=c.routed_experts,
            )
            for c in sorted((c for c in outs if c.request_id == f"t{g}"), key=lambda c: c.sample_index)
        ]
        groups.append(Group.from_lease(Lease(task, "w", g + 1, 0.0), samples, 0.1))
    return groups


def _trainer(model, replay, share_prompt=True):
    return LocalTrainer(
        model,
        TrainerConfig(lr=1e-3, micro_batch_size=64, share_prompt=share_prompt),
        AlgorithmConfig(routing_replay=replay),
    )


def _mean_abs_gap(trainer, batch):
    logp = trainer.no_grad_logprobs(batch)
    return float((logp - batch.behaviour_logprobs).abs()[batch.loss_mask].mean())


@pytest.mark.parametrize("share_prompt", [True, False])
def test_replayed_forward_is_closer_to_a_bf16_engine_than_the_free_forward(share_prompt):
    policy = _policy()  # float32 trainer
    engine_model = copy.deepcopy(policy).to(torch.bfloat16).keep_router_buffers_fp32()
    batch = build_train_batch(_engine_groups(engine_model), pad_id=0)
    assert batch.routed_experts is not None
    free = _trainer(policy, "off", share_prompt)
    with torch.no_grad():  # the experts a free float32 forward picks differ from the engine's somewhere
        own = policy(batch.input_ids, batch.attention_mask, return_routed_experts=True).routed_experts
    fed = batch.attention_mask.bool().clone()
    fed[torch.arange(fed.shape[0]), batch.attention_mask.sum(1) - 1] = False  # last token: never fed
    flips = (own.sort(-1).values != batch.routed_experts.sort(-1).values).any(-1)[fed]
    assert flips.float().mean() > 0.005
    gap_free = _mean_abs_gap(free, batch)
    gap_replay = _mean_abs_gap(_trainer(policy, "r3", share_prompt), batch)
    assert gap_replay < 0.8 * gap_free, (gap_replay, gap_free)


@pytest.mark.parametrize("share_prompt", [True, False])
def test_the_experts_replayed_in_training_are_exactly_the_engines(share_prompt):
    policy = _policy()
    groups = _engine_groups(
        copy.deepcopy(policy).to(torch.bfloat16).keep_router_buffers_fp32(), num_prompts=3
    )
    batch = build_train_batch(groups, pad_id=0)
    trainer = _trainer(policy, "r3", share_prompt)
    used = []  # what the expert modules were actually given, per call
    hooks = [
        b.experts.register_forward_pre_hook(lambda mod, args: used.append(args[1].clone()))
        for b in policy.moe_blocks()
    ]
    out = trainer._forward(batch, with_grad=True)
    for h in hooks:
        h.remove()
    assert used, "no expert call was observed"
    rows = [s for g in groups for s in g.samples]
    for row, s in enumerate(rows):  # every fed token's experts, prompt and response, are the engine's
        n = s.routed_experts.shape[0]
        assert torch.equal(out.routed_experts[row, :n], s.routed_experts)
    if not share_prompt:  # one call per MoE layer: compare the experts' own inputs
        b, t = batch.input_ids.shape
        for layer, topk in enumerate(used):
            topk = topk.view(b, t, -1)
            for row, s in enumerate(rows):
                n = s.routed_experts.shape[0]
                assert torch.equal(topk[row, :n], s.routed_experts[:, layer])


def test_replay_without_recorded_experts_is_a_clear_error():
    policy = _policy()
    groups = _engine_groups(policy, num_prompts=1)
    batch = build_train_batch(groups, pad_id=0)
    stripped = type(batch)(
        **{**{f: getattr(batch, f) for f in batch.__dataclass_fields__}, "routed_experts": None}
    )
    with pytest.raises(ValueError, match="routed_experts"):
        _trainer(policy, "r3").train_step(stripped)


def test_recording_decode_steps_go_through_the_graph_runner():
    """On CUDA the engine captures decode steps in graphs; a stand-in runner (CPU has none) shows that
    steps recording experts are handed to it too, keyed apart, once the static buffer exists."""

    class Runner:
        def __init__(self):
            self.keys = []

        def run(self, key, fn):
            self.keys.append(key)
            return fn()

    policy = _policy()
    engine = Engine(policy, max_slots=8, kv_token_budget=8 * 32)
    engine._graphs = Runner()
    params = SamplingParams(temperature=1.0, max_new_tokens=5, n=2, seed=1, return_routed_experts=True)
    out = engine.generate([Request(request_id="a", prompt_ids=[1, 2, 3], params=params)])
    # every decode step, keyed as recording (the key's 5th entry: want_routed, ``Engine._decode``)
    assert engine._graphs.keys and all(k[4] is True for k in engine._graphs.keys)
    with torch.no_grad():  # and the record is still the full forward's choice
        seq = torch.tensor(out[0].prompt_ids + out[0].token_ids[:-1])[None]
        ref = policy(seq, return_routed_experts=True).routed_experts[0]
    assert torch.equal(out[0].routed_experts.sort(-1).values, ref.sort(-1).values)


def test_expert_load_figures_under_replay_leave_out_the_never_fed_last_token():
    policy = _policy()
    batch = build_train_batch(_engine_groups(policy, num_prompts=2), pad_id=0)
    lengths = batch.attention_mask.sum(1)
    free = _trainer(copy.deepcopy(policy), "off").algo.load_mask(batch)
    replay = _trainer(copy.deepcopy(policy), "r3").algo.load_mask(batch)
    assert torch.equal(free, batch.attention_mask.bool())
    rows = torch.arange(len(lengths))
    assert not replay[rows, lengths - 1].any() and torch.equal(replay.sum(1), lengths - 1)
    assert _trainer(policy, "r3").train_step(batch).algo.expert_load_max_min >= 1.0
