"""Episodes on the engine: parking while an environment works, loss masks, faults."""

import pytest
import torch
from _envs import EchoEnv, FaultEnv, SleepEnv
from _tiny import tiny_model

from moerl.config import AlgorithmConfig, EnvConfig, TrainerConfig
from moerl.envs import EpisodeEngine, LocalEnvPool
from moerl.envs.pool import STEP
from moerl.records import Group, RolloutTask, Sample
from moerl.rollout import Engine, Request, SamplingParams
from moerl.tasks import Prompt, load_tokenizer
from moerl.trainer.batch import build_train_batch
from moerl.trainer.local import LocalTrainer

TOK = load_tokenizer(None)
NL = TOK.encode("\n")[0]


def _episodes(env_cls, *, num_workers=2, timeout=30.0, max_turns=4, max_pending=4, model=None):
    torch.manual_seed(0)
    engine = Engine(
        model or tiny_model(TOK.vocab_size), max_slots=16, kv_token_budget=16 * 128, cuda_graphs=False
    )
    pool = LocalEnvPool(
        lambda: env_cls(EnvConfig()), num_workers, step_timeout_s=timeout, max_pending_per_worker=max_pending
    )
    eps = EpisodeEngine(
        engine, pool, TOK.encode, TOK.decode, max_turns=max_turns, max_tokens=100, turn_stop_ids=(NL,)
    )
    return eps, pool


def _start(eps, rid, text, *, n=1, turns=3, max_new_tokens=6, seed=1):
    eps.bind_task(rid, Prompt(id=rid, text=text, answer=str(turns)))
    params = SamplingParams(
        temperature=1.0, max_new_tokens=max_new_tokens, stop_token_ids=(TOK.eos_id,), n=n, seed=seed
    )
    eps.add_request(Request(request_id=rid, prompt_ids=[1], params=params))


def _run(eps, limit=5000):
    done = []
    for _ in range(limit):
        done += eps.step()
        if not eps.num_unfinished:
            return done
    raise AssertionError("episodes did not finish")


def test_episode_tokens_masks_and_versions():
    eps, pool = _episodes(EchoEnv)
    _start(eps, "r", "hi\n", n=2, turns=3)
    done = sorted(_run(eps), key=lambda c: c.sample_index)
    pool.close()
    assert [c.sample_index for c in done] == [0, 1]
    ok = TOK.encode("ok\n")
    for c in done:
        assert c.prompt_ids == TOK.encode("hi\n") and c.reward == 1.0 and c.reward_info["turns"] == 3
        assert len(c.token_ids) == len(c.logprobs) == len(c.policy_versions) == len(c.loss_mask)
        # two observations, each "ok\n" with loss mask 0 and log-prob 0; every other token is the policy's
        obs = [i for i, m in enumerate(c.loss_mask) if m == 0]
        assert len(obs) == 2 * len(ok) and [c.token_ids[i] for i in obs] == ok * 2
        assert all(c.logprobs[i] == 0.0 for i in obs) and all(
            c.logprobs[i] < 0 for i in range(len(c.loss_mask)) if c.loss_mask[i]
        )
        assert set(c.policy_versions) == {0}


def test_engine_keeps_decoding_while_an_episode_is_parked_on_a_slow_environment():
    eps, pool = _episodes(SleepEnv, num_workers=13)  # one environment worker per episode
    SleepEnv.gate.clear()  # the slow environment sleeps until every fast episode is done
    marks = {}
    submit = pool.submit

    def recording_submit(call):  # note the decode-step count when the slow episode parks on its env
        if call.episode.startswith("slow") and call.kind == STEP and "start" not in marks:
            marks["start"] = eps.decode_steps
        submit(call)

    pool.submit = recording_submit
    _start(eps, "slow", "slow\n", turns=1)
    for i in range(6):
        _start(eps, f"fast{i}", "fast\n", n=2, turns=4, max_new_tokens=12, seed=i)
    done = []
    while eps.num_unfinished:
        for c in eps.step():
            done.append(c)
            if c.request_id == "slow":
                marks["end"] = eps.decode_steps
        if sum(c.request_id != "slow" for c in done) == 12:
            SleepEnv.gate.set()
    pool.close()
    during_wait = marks["end"] - marks["start"]
    print(f"decode steps while the slow episode was parked: {during_wait}")
    assert (
        marks["start"] < 15 and during_wait >= 10
    )  # parked early; the fast episodes' decode steps came meanwhile
    assert sorted({c.request_id for c in done}) == [
        "fast0",
        "fast1",
        "fast2",
        "fast3",
        "fast4",
        "fast5",
        "slow",
    ]
    assert eps.stats.parked_max >= 1 and eps.stats.decode_steps_parked >= during_wait


def test_observation_tokens_get_no_gradient_and_policy_tokens_do():
    model = tiny_model(TOK.vocab_size)
    eps, pool = _episodes(EchoEnv, model=model)
    _start(eps, "r", "hi\n", n=2, turns=3)
    done = sorted(_run(eps), key=lambda c: c.sample_index)
    pool.close()
    task = RolloutTask(
        task_id="t", prompt_ids=done[0].prompt_ids, prompt_text="hi\n", answer="3", num_samples=2
    )
    samples = [
        Sample(
            prompt_ids=c.prompt_ids,
            response_ids=c.token_ids,
            response_logprobs=c.logprobs,
            loss_mask=c.loss_mask,
            finish_reason=c.finish_reason,
            policy_versions=c.policy_versions,
            reward=float(i),  # different rewards: non-zero advantages
        )
        for i, c in enumerate(done)
    ]
    group = Group(
        task=task,
        lease_token=1,
        worker_id="w",
        samples=samples,
        min_policy_version=0,
        gen_seconds=0.0,
        num_tokens=0,
    )
    batch = build_train_batch([group], pad_id=TOK.pad_id)
    trainer = LocalTrainer(
        model, TrainerConfig(micro_batch_size=8, share_prompt=False), AlgorithmConfig(preset="grpo")
    )
    captured = []

    def keep_logits(module, args, out):
        out.logits.retain_grad()
        captured.append(out.logits)

    handle = model.register_forward_hook(keep_logits)
    trainer.train_step(batch)
    handle.remove()
    grad = captured[-1].grad  # [B, T, V]: position t - 1 predicts token t
    for b, c in enumerate(done):
        p = len(c.prompt_ids)
        for i, m in enumerate(c.loss_mask):
            g = grad[b, p + i - 1].abs().sum().item()
            if m:
                assert g > 0, f"policy token {i} of sample {b} got no gradient"
            else:
                assert g == 0.0, f"observation token {i} of sample {b} got gradient {g}"
    assert batch.loss_mask.sum() == sum(sum(c.loss_mask) for c in done)


@pytest.mark.parametrize("mode, error", [("raise", "raised"), ("hang", "timeout")])
def test_environment_faults_end_the_group_once_and_others_continue(mode, error):
    eps, pool = _episodes(FaultEnv, num_workers=1, timeout=2.0)
    _start(eps, "bad", f"{mode}\n", n=2)
    _start(eps, "good", "fine\n", n=2, seed=3)
    done, failed = [], {}
    for _ in range(20000):
        done += eps.step()
        failed.update(eps.pop_failed())
        if not eps.num_unfinished:
            break
    num_workers = pool.num_workers
    pool.close()
    assert failed["bad"].startswith(error)
    if mode == "raise":  # the worker survives: the good group finishes
        assert list(failed) == ["bad"] and sorted(c.request_id for c in done) == ["good", "good"]
        assert pool.stats.raised >= 1 and pool.stats.workers_lost == 0
    else:  # the hung worker is replaced; episodes it hosted end too (their tasks go back to the queue)
        assert pool.stats.timeouts >= 1 and pool.stats.workers_lost >= 1 and num_workers == 1
        assert failed.get("good", "lost").startswith("lost")  # on the same worker: lost with it


def test_backpressure_bounds_calls_in_flight_per_worker():
    SleepEnv.gate.set()  # slow steps sleep delay_s
    eps, pool = _episodes(SleepEnv, num_workers=1, max_pending=2)
    for i in range(3):
        _start(eps, f"slow{i}", "slow\n", n=2, turns=1, seed=i)
    seen = 0
    while eps.num_unfinished:
        eps.step()
        seen = max(seen, max(len(w.outstanding) for w in pool._workers))
    pool.close()
    assert seen <= 2 and pool.stats.backlog_max >= 1
