"""Progress snapshots (issue 50): the queue keeps the newest per live lease, a lost worker's tasks come back
with them, the next worker continues them, and each token keeps the log-prob of the version that sampled it."""

import copy
import threading

import pytest
import torch
from _tiny import tiny_model

from moerl.config import RolloutConfig
from moerl.records import LeaseSnapshot, PartialResponse
from moerl.rollout import Engine
from moerl.runtime.buffer import ExperienceBuffer, PutResult
from moerl.runtime.drain import Drainer
from moerl.runtime.queue import TaskQueue
from moerl.runtime.snapshots import SnapshotSender
from moerl.runtime.worker import RolloutWorker
from moerl.tasks import Prompt, Reward, load_tokenizer

TOK = load_tokenizer(None)
MAX_NEW = 16


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class OneTask:
    def reward(self, prompt_text, response_text, answer):
        return Reward(float(response_text.startswith(answer)), {})


def _prefix(i, n, version=0):
    return PartialResponse(i, list(range(n)), [-0.5] * n, [version] * n)


def _queue(clock=None, n=3, num_prompts=20):
    prompts = (Prompt(id=f"p{i}", text=f"{i}+{i}=", answer=str(2 * i)) for i in range(num_prompts))
    return TaskQueue(prompts, num_samples=n, tokenize=TOK.encode, clock=clock or Clock())


# -- the exchange's side: TaskQueue ------------------------------------------------------------------


def test_queue_keeps_the_newest_snapshot_per_live_lease_and_drops_it_on_settle():
    q = _queue()
    a, b = q.lease("w0", 10.0, 2)
    assert q.save_progress([LeaseSnapshot(a.task_id, a.token, [_prefix(0, 4), _prefix(1, 2)])]) == 1
    assert q.save_progress([LeaseSnapshot(a.task_id, a.token, [_prefix(0, 8)])]) == 1  # newer: longer
    assert q.save_progress([LeaseSnapshot(b.task_id, b.token + 99, [_prefix(0, 5)])]) == 0  # not its lease
    s = q.stats()
    assert (s.snapshots_saved, s.snapshots_refused, s.snapshot_tokens_held) == (2, 1, 8 + 2)
    q.settle(a.task_id, a.token, "admitted")  # delivered: its snapshot is dropped
    assert q.stats().snapshot_tokens_held == 0
    q.release(b)  # released without prefixes (e.g. aborted for new weights): nothing kept either
    assert q.stats().snapshot_tokens_held == 0 and q.lease("w1", 10.0)[0].task.partial == ()


def test_snapshot_deltas_append_and_a_gap_is_refused():
    q = _queue()
    (a,) = q.lease("w0", 10.0)
    q.save_progress([LeaseSnapshot(a.task_id, a.token, [_prefix(0, 4)])])
    more = PartialResponse(0, [7, 8], [-0.1, -0.2], [1, 1])
    assert q.save_progress([LeaseSnapshot(a.task_id, a.token, [more], [4])]) == 1  # tokens 4, 5
    assert q.save_progress([LeaseSnapshot(a.task_id, a.token, [more], [9])]) == 0  # a gap: refused
    assert q.stats().snapshot_tokens_held == 6 and q.expire_worker("w0") == 6
    (again,) = q.lease("w1", 10.0)
    assert again.task.partial[0].response_ids == (0, 1, 2, 3, 7, 8)
    assert again.task.partial[0].policy_versions == (0, 0, 0, 0, 1, 1)


def test_an_expired_lease_requeues_its_task_with_the_newest_snapshot():
    clock = Clock()
    q = _queue(clock)
    (a,) = q.lease("w0", 10.0)
    q.save_progress([LeaseSnapshot(a.task_id, a.token, [_prefix(0, 4), _prefix(2, 6)])])
    clock.now = 11.0  # the worker was lost: no heartbeat
    (again,) = q.lease("w1", 10.0)
    assert again.task_id == a.task_id and again.token > a.token
    assert [(p.sample_index, len(p.response_ids)) for p in again.task.partial] == [(0, 4), (2, 6)]
    assert q.stats().tokens_restored == 10 and q.stats().snapshot_tokens_held == 0
    # the lost worker's late snapshot and its late delivery's settlement are both refused (fencing)
    assert q.save_progress([LeaseSnapshot(a.task_id, a.token, [_prefix(0, 9)])]) == 0
    assert not q.settle(a.task_id, a.token, "admitted")


def test_a_task_requeued_as_stale_starts_over():
    """A continued group too stale to train came back: its kept prefix (the old tokens) is dropped, else
    every later lease would continue it and be refused again."""
    clock = Clock()
    q = _queue(clock)
    (a,) = q.lease("w0", 10.0)
    q.save_progress([LeaseSnapshot(a.task_id, a.token, [_prefix(0, 4)])])
    clock.now = 11.0
    (b,) = q.lease("w1", 10.0)
    assert b.task.partial
    assert q.settle(b.task_id, b.token, "requeued_stale")
    (c,) = q.lease("w2", 10.0)
    assert c.task_id == a.task_id and c.task.partial == ()
    q.settle(c.task_id, c.token, "admitted")
    q.requeue(b.task)  # a trained task handed back (its group went stale in the buffer): from scratch too
    assert q.lease("w3", 10.0)[0].task.partial == ()


def test_expire_worker_now_and_a_resume_keeps_the_snapshot():
    q = _queue()
    a, b = q.lease("w0", 60.0, 2)
    (c,) = q.lease("w1", 60.0)
    q.save_progress([LeaseSnapshot(a.task_id, a.token, [_prefix(1, 5)])])
    q.save_progress([LeaseSnapshot(c.task_id, c.token, [_prefix(0, 3)])])
    state = q.state_dict()  # a checkpoint: leased tasks saved as pending, with their snapshots
    assert {t["task_id"]: len(t["partial"]) for t in state["tasks"]}[c.task_id] == 1
    assert q.expire_worker("w0") == 5
    s = q.stats()
    assert (s.expired, s.outstanding, s.tokens_restored) == (2, 1, 5)  # w1's lease lives on
    leases = {lease.task_id: lease for lease in q.lease("w2", 60.0, 2)}
    assert leases[a.task_id].task.partial[0].response_ids == tuple(range(5))
    assert leases[b.task_id].task.partial == ()


# -- the worker's side: SnapshotSender -----------------------------------------------------------------


def _worker(queue, buffer, model, worker_id, *, version=0, keep_partial=True, max_new=MAX_NEW):
    cfg = RolloutConfig(
        group_size=3, max_new_tokens=max_new, max_slots=6, kv_token_budget=6 * 64, lease_ahead_groups=0
    )
    engine = Engine(model, max_slots=cfg.max_slots, kv_token_budget=cfg.kv_token_budget, version=version)
    # no stop token: every response runs to max_new tokens
    return RolloutWorker(
        worker_id,
        engine,
        OneTask(),
        TOK.decode,
        queue,
        buffer,
        cfg,
        stop_token_ids=(),
        run_seed=1,
        keep_partial=keep_partial,
    )


@pytest.fixture
def setup():
    torch.manual_seed(0)
    model = tiny_model(TOK.vocab_size).float().eval()
    clock = Clock()
    queue = _queue(clock)
    buffer = ExperienceBuffer(16, max_staleness=4, settle=queue.settle, requeue=queue.requeue)
    return model, queue, buffer, clock


def test_snapshots_are_sent_every_n_tokens_per_sequence_in_one_batch(setup):
    model, queue, buffer, _ = setup
    worker = _worker(queue, buffer, model, "w0")
    calls = []

    def sink(batch):
        calls.append(batch)
        return queue.save_progress(batch)

    sender = SnapshotSender("w0", worker.in_flight, sink, every_tokens=4)
    worker.step()  # prefill + 1 decode: 2 tokens per sample
    assert sender.flush() == 0 and calls == []  # no sequence has 4 tokens yet
    worker.step(), worker.step()  # 4 tokens per sample
    assert sender.flush() == 2 and len(calls) == 1  # both groups due: one call
    assert queue.stats().snapshot_tokens_held == 2 * 3 * 4 and sender.tokens_covered == 24
    worker.step()
    assert sender.flush() == 0  # 5 tokens: 1 more than the last snapshot, not 4
    for _ in range(3):
        worker.step()
    assert sender.flush() == 2 and queue.stats().snapshot_tokens_held == 2 * 3 * 8
    assert sender.stats.bytes_sent > 0 and sender.stats.snapshots_kept == 4
    assert sender.stats.tokens_sent == 2 * 3 * 8  # deltas: each token sent once, not 4 + 8 per sample
    held = {g.lease.task_id: g for g in worker.in_flight()}
    queue.expire_worker("w0")  # the exchange's copy, put together from deltas, is the worker's prefixes
    again = {lease.task_id: lease for lease in queue.lease("w1", 10.0, 2)}
    for task_id, g in held.items():
        assert again[task_id].task.partial == tuple(
            PartialResponse(
                p.sample_index, p.response_ids[:8], p.response_logprobs[:8], p.policy_versions[:8]
            )
            for p in g.prefixes
        )


def test_the_decode_loop_never_waits_for_a_snapshot(setup):
    """Structural, no clock: the exchange's ``save_progress`` blocks until released; meanwhile the worker's
    own thread keeps stepping (its sequences grow), and the send runs on the sender's named thread."""
    model, queue, buffer, _ = setup
    worker = _worker(queue, buffer, model, "w0")
    entered, release, threads = threading.Event(), threading.Event(), []

    def blocked_sink(batch):
        threads.append(threading.current_thread().name)
        entered.set()
        release.wait(30)
        return queue.save_progress(batch)

    sender = SnapshotSender("w0", worker.in_flight, blocked_sink, every_tokens=2, poll_s=0.001).start()
    try:
        worker.step()  # 2 tokens per sample: due
        assert entered.wait(30)  # the snapshot thread is inside the (blocked) exchange call
        before = max(len(p.response_ids) for g in worker.in_flight() for p in g.prefixes)
        for _ in range(5):
            worker.step()  # the decode loop goes on while the send is blocked
        after = max(len(p.response_ids) for g in worker.in_flight() for p in g.prefixes)
        assert after == before + 5 and not release.is_set()
    finally:
        release.set()
        sender.close()
    assert threads and set(threads) == {"moerl-snapshot-w0"}


# -- a hard loss, continued elsewhere ----------------------------------------------------------------


def _teacher_forced(model, prompt, response):
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    targets = torch.tensor(response)
    return logp[len(prompt) - 1 : -1].gather(-1, targets[:, None])[:, 0]


def test_a_killed_workers_snapshot_is_continued_and_each_token_keeps_its_versions_logprob(setup):
    model, queue, buffer, clock = setup
    v1 = copy.deepcopy(model)
    with torch.no_grad():
        for p in v1.parameters():
            p.add_(0.05 * torch.randn_like(p))  # the next published version: different log-probs
    lost = _worker(queue, buffer, model, "lost", version=0)
    sender = SnapshotSender("lost", lost.in_flight, queue.save_progress, every_tokens=4)
    for _ in range(7):
        lost.step()  # 8 tokens per sample
    sender.flush()  # snapshot at 8 tokens per sample
    lost.step(), lost.step()  # 10 tokens: the last 2 are never snapshotted (the kill comes first)
    held = {g.lease.task_id: g for g in lost.in_flight()}
    in_flight = sum(g.num_tokens for g in held.values())
    assert in_flight == 2 * 3 * 10
    clock.now = 1e6  # SIGKILL: no more heartbeats, its leases expire
    assert queue.expire_worker("lost") == 2 * 3 * 8  # 48 of the 60 tokens in flight continue

    nxt = _worker(queue, buffer, v1, "next", version=1)
    assert nxt.run(num_groups=2) == 2
    assert nxt.stats.tokens_resumed == 48
    groups = buffer.get(2, timeout=0)
    assert sorted(g.task_id for g in groups) == sorted(held)
    for g in groups:
        assert g.worker_id == "next" and g.min_policy_version == 0  # admitted by its oldest token
        for s, kept in zip(g.samples, held[g.task_id].prefixes, strict=True):
            assert len(s.response_ids) == MAX_NEW and s.policy_versions == (0,) * 8 + (1,) * 8
            assert s.response_ids[:8] == kept.response_ids[:8]  # continued, not restarted
            want0 = _teacher_forced(model, s.prompt_ids, s.response_ids)[:8]
            want1 = _teacher_forced(v1, s.prompt_ids, s.response_ids)[8:]
            got = torch.tensor(s.response_logprobs)
            torch.testing.assert_close(got[:8], want0, atol=1e-5, rtol=0)  # v0 sampled these
            torch.testing.assert_close(got[8:], want1, atol=1e-5, rtol=0)  # v1 sampled these
            assert (got[8:] - _teacher_forced(model, s.prompt_ids, s.response_ids)[8:]).abs().max() > 1e-3

    # the trainer's batch keeps each token's own behaviour log-prob: the mismatch correction (TIS/MIS)
    # against a policy equal to the version that sampled each token is exactly 1 at every token
    from moerl.rl.mismatch import mismatch_weights
    from moerl.rl.presets import preset_from_config
    from moerl.trainer.batch import build_train_batch

    batch = build_train_batch(groups, pad_id=0)
    sampled_by = torch.zeros_like(batch.behaviour_logprobs)
    for row, s in enumerate(x for g in groups for x in g.samples):
        lo, hi = len(s.prompt_ids), len(s.prompt_ids) + len(s.response_ids)
        assert batch.behaviour_logprobs[row, lo:hi].tolist() == list(s.response_logprobs)
        sampled_by[row, lo : lo + 8] = _teacher_forced(model, s.prompt_ids, s.response_ids)[:8]
        sampled_by[row, lo + 8 : hi] = _teacher_forced(v1, s.prompt_ids, s.response_ids)[8:]
    from moerl.config import AlgorithmConfig

    preset = preset_from_config(AlgorithmConfig(mismatch_mode="truncate"))
    w = mismatch_weights(sampled_by, batch.behaviour_logprobs, batch.loss_mask, preset).weights
    torch.testing.assert_close(w[batch.loss_mask], torch.ones_like(w[batch.loss_mask]), atol=1e-4, rtol=0)

    # the lost worker's late delivery is refused by its lease's fence: each sequence is trained once
    clock.now = 0.0
    late = [r for _ in range(MAX_NEW) for r in lost.step()]
    assert late and set(late) == {PutResult.REFUSED_STALE_TOKEN}
    assert buffer.metrics().depth == 0 and queue.stats().acked == 2


def test_drain_on_notice_with_the_default_config_discards_nothing(setup):
    model, queue, buffer, _ = setup
    from moerl.config import FleetConfig

    fleet = FleetConfig()
    assert fleet.keep_partial and fleet.snapshot_tokens > 0  # the defaults this test is about
    first = _worker(queue, buffer, model, "w0", keep_partial=fleet.keep_partial)
    for _ in range(5):
        first.step()
    in_flight = sum(g.num_tokens for g in first.in_flight())
    report = Drainer(0.0, keep_partial=fleet.keep_partial).drain(first)  # no time left: all released
    assert report.groups_released == 2 and report.tokens_discarded == 0 and report.tokens_kept == in_flight
    second = _worker(queue, buffer, model, "w1")
    assert second.run(num_groups=2) == 2 and second.stats.tokens_resumed == in_flight


def test_a_stop_hands_prefixes_back_unless_keep_partial_is_off(setup):
    model, queue, buffer, _ = setup
    keeping = _worker(queue, buffer, model, "w0")
    for _ in range(3):
        keeping.step()
    assert keeping.release_all() == 2 and keeping.stats.tokens_discarded == 0
    leases = queue.lease("w1", 10.0, 2)
    assert [len(lease.task.partial) for lease in leases] == [3, 3]
    for lease in leases:
        queue.release(lease)
    dropping = _worker(queue, buffer, model, "w2", keep_partial=False)
    dropping.step()
    assert dropping.release_all() == 2 and dropping.stats.tokens_discarded > 0


def test_the_fleet_counts_a_hard_loss_less_what_its_snapshots_kept():
    from test_fleet import FakeBackend

    from moerl.runtime.fleet import FleetManager, WorkerExit

    backend = FakeBackend()
    fleet = FleetManager(backend, num_workers=2, clock=lambda: 0.0)
    fleet.start()
    backend.up(
        "rollout-0", tokens_delivered=100, tokens_in_flight=300, tokens_snapshotted=280, tokens_resumed=5
    )
    backend.up("rollout-1", tokens_delivered=100, tokens_in_flight=300, tokens_discarded=7)
    fleet.check()
    del backend.answering["rollout-0"], backend.answering["rollout-1"]
    backend.exits += [WorkerExit("rollout-0", "crashed"), WorkerExit("rollout-1", "crashed")]
    fleet.check()
    fleet.credit_restored("rollout-0", 290)  # the queue restored its newest snapshots (newer than the ping)
    fleet.credit_restored("rollout-1", 0)  # no snapshot: every in-flight token is lost
    assert fleet.tokens_lost("rollout-0") == 300 - 280 and fleet.tokens_lost("rollout-1") == 300
    m = fleet.metrics()
    assert (m.tokens_discarded, m.rollout_tokens_discarded, m.rollout_tokens_resumed) == (320, 327, 5)
    assert m.as_metrics()["rollout/tokens_discarded"] == 327
    assert fleet.records["rollout-1"].tokens_discarded == 307  # its own 7 and the 300 of the loss
    assert fleet.tokens_in_flight_at_losses == 600
