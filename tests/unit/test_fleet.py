"""FleetManager on a scripted backend and clock: liveness, losses, replacement, admission, scaling hint."""

import pytest

from moerl.config import FleetConfig
from moerl.runtime.drain import DrainReport
from moerl.runtime.fleet import FleetManager, WorkerExit, WorkerHealth, WorkerState


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class FakeBackend:
    """Workers answer pings while in ``answering``; exits are queued by the test."""

    def __init__(self):
        self.spawned, self.killed, self.notified = [], [], []
        self.answering: dict[str, WorkerHealth] = {}
        self.exits: list[WorkerExit] = []

    def spawn(self, worker_id):
        self.spawned.append(worker_id)

    def poll(self):
        exits, self.exits = self.exits, []
        return dict(self.answering), exits

    def kill(self, worker_id):
        self.killed.append(worker_id)
        self.answering.pop(worker_id, None)

    def notify(self, worker_id):
        self.notified.append(worker_id)

    def up(self, *ids, **health):
        for i in ids:
            self.answering[i] = WorkerHealth(**health)


def _fleet(n=4, **kw):
    clock, backend = Clock(), FakeBackend()
    fleet = FleetManager(
        backend, num_workers=n, clock=clock, heartbeat_timeout_s=10.0, startup_timeout_s=60.0, **kw
    )
    return fleet, backend, clock


def test_start_and_workers_become_alive_on_first_answer():
    fleet, backend, clock = _fleet()
    assert fleet.start() == ["rollout-0", "rollout-1", "rollout-2", "rollout-3"] == backend.spawned
    assert fleet.alive_ids() == [] and len(fleet.active_ids()) == 4
    backend.up("rollout-0", "rollout-1")
    backend.up("rollout-1", groups_in_flight=2)
    fleet.check()
    assert fleet.alive_ids() == ["rollout-0", "rollout-1"] and fleet.busy_ids() == ["rollout-1"]
    assert fleet.records["rollout-2"].state is WorkerState.STARTING
    m = fleet.metrics()
    assert (m.workers_alive, m.interruptions, m.time_to_replace_s) == (2, 0, None)


def test_sigkilled_worker_is_replaced_and_its_in_flight_tokens_are_lost():
    fleet, backend, clock = _fleet()
    fleet.start()
    backend.up("rollout-0", "rollout-1", "rollout-2", "rollout-3", tokens_delivered=100, tokens_in_flight=30)
    fleet.check()
    clock.t = 5.0
    del backend.answering["rollout-2"]
    backend.exits.append(WorkerExit("rollout-2", "crashed", error="SIGKILL"))
    fleet.check()  # detected at t = 5; replacement spawned at once
    assert backend.spawned[-1] == "rollout-4" and fleet.records["rollout-2"].state is WorkerState.KILLED
    clock.t = 12.5
    backend.up("rollout-4")
    fleet.check()
    m = fleet.metrics()
    assert (m.killed, m.drained, m.interruptions, m.spawned) == (1, 0, 1, 5)
    assert (m.replaced, m.workers_alive) == (1, 4)
    assert m.time_to_replace_s == 7.5
    # generated = 4 x 100 delivered + 30 discarded; lost = 30 / 430
    assert (m.tokens_generated, m.tokens_discarded) == (430, 30)
    assert m.lost_work_frac == pytest.approx(30 / 430)


def test_drained_worker_reports_discarded_tokens_and_final_health():
    fleet, backend, clock = _fleet(n=2)
    fleet.start()
    backend.up("rollout-0", "rollout-1", tokens_delivered=50, tokens_in_flight=20)
    fleet.check()
    report = DrainReport(
        groups_delivered=1, groups_released=1, tokens_kept=0, tokens_discarded=8, seconds=3.0, grace_s=90.0
    )
    del backend.answering["rollout-1"]
    backend.exits.append(
        WorkerExit("rollout-1", "drained", drain=report, final=WorkerHealth(tokens_delivered=62))
    )
    fleet.check()
    m = fleet.metrics()
    assert (m.drained, m.killed, m.interruptions) == (1, 0, 1)
    assert (m.tokens_generated, m.tokens_discarded) == (50 + 62 + 8, 8)
    assert backend.spawned == ["rollout-0", "rollout-1", "rollout-2"]


def test_silent_worker_is_declared_lost_killed_and_replaced():
    fleet, backend, clock = _fleet(n=2)
    fleet.start()
    backend.up("rollout-0", "rollout-1")
    fleet.check()
    backend.answering.pop("rollout-1")  # node lost: no answer, no exit event
    clock.t = 10.0
    fleet.check()
    assert fleet.records["rollout-1"].state is WorkerState.ALIVE  # 10 s is not more than the timeout
    clock.t = 10.5
    (lost,) = fleet.check()
    assert (lost.worker_id, lost.reason) == ("rollout-1", "crashed") and "10 s" in lost.error
    assert backend.killed == ["rollout-1"] and fleet.records["rollout-1"].state is WorkerState.KILLED
    assert backend.spawned[-1] == "rollout-2" and fleet.metrics().killed == 1
    # a late exit event of the lost worker is not counted twice
    backend.exits.append(WorkerExit("rollout-1", "crashed"))
    fleet.check()
    assert fleet.metrics().killed == 1


def test_worker_that_never_starts_hits_startup_timeout():
    fleet, backend, clock = _fleet(n=1)
    fleet.start()
    clock.t = 59.0
    fleet.check()
    assert backend.killed == []
    clock.t = 61.0
    fleet.check()
    assert backend.killed == ["rollout-0"] and backend.spawned == ["rollout-0", "rollout-1"]


def test_no_replacement_below_target_without_replace_dead_but_min_is_kept():
    fleet, backend, clock = _fleet(n=3, min_workers=2, replace_dead=False)
    fleet.start()
    backend.up("rollout-0", "rollout-1", "rollout-2")
    fleet.check()
    backend.exits.append(WorkerExit("rollout-0", "crashed"))
    fleet.check()
    assert backend.spawned == ["rollout-0", "rollout-1", "rollout-2"]  # 2 left = min_workers
    backend.exits.append(WorkerExit("rollout-1", "crashed"))
    fleet.check()
    assert backend.spawned[-1] == "rollout-3" and len(fleet.active_ids()) == 2


def test_stopped_worker_is_not_an_interruption():
    fleet, backend, clock = _fleet(n=1)
    fleet.start()
    backend.exits.append(WorkerExit("rollout-0", "stopped"))
    fleet.check()
    m = fleet.metrics()
    assert m.interruptions == 0 and fleet.records["rollout-0"].state is WorkerState.STOPPED


def test_admit_and_scale_within_bounds():
    fleet, backend, clock = _fleet(n=2, min_workers=1, max_workers=3)
    fleet.start()
    assert fleet.admit() == "rollout-2" and fleet.target == 3
    assert fleet.admit() is None  # at max_workers
    assert fleet.scale_to(1) == 1
    assert backend.notified == ["rollout-2", "rollout-1"]  # newest surplus workers drain first
    backend.exits.append(WorkerExit("rollout-2", "drained"))
    fleet.check()  # a drain asked for by scale_to is not an interruption, and is not replaced
    assert fleet.metrics().interruptions == 0 and fleet.records["rollout-2"].state is WorkerState.STOPPED
    assert backend.spawned == ["rollout-0", "rollout-1", "rollout-2"]
    assert fleet.scale_to(10) == 3 and backend.spawned[-1] == "rollout-3"  # rollout-1 still draining
    with pytest.raises(ValueError, match="min_workers"):
        FleetManager(backend, num_workers=2, min_workers=3)


def test_scaling_hint_is_proportional_and_clamped():
    fleet, backend, clock = _fleet(n=4, min_workers=1, max_workers=8)
    fleet.start()
    # empty buffer, 8 groups wanted: ratio 8 / 1 -> 32 workers, clamped to 8
    assert fleet.scaling_hint(queue_pending=0, buffer_depth=0, batch_groups=8).desired_workers == 8
    # buffer holds 32 groups, 8 wanted: ratio 0.25 -> ceil(4 * 0.25) = 1
    hint = fleet.scaling_hint(queue_pending=0, buffer_depth=32, batch_groups=8)
    assert (hint.desired_workers, hint.ratio) == (1, 0.25)
    # 8 wanted + 2 requeued waiting, 10 buffered: ratio 1.0, within 10%: keep 4
    assert fleet.scaling_hint(queue_pending=2, buffer_depth=10, batch_groups=8).desired_workers == 4
    # 8 + 4 over 8: ratio 1.5 -> ceil(6) = 6
    assert fleet.scaling_hint(queue_pending=4, buffer_depth=8, batch_groups=8).desired_workers == 6
    assert fleet.metrics().desired_workers == 6
    assert fleet.metrics().as_metrics()["fleet/desired_workers"] == 6


def test_from_config():
    backend = FakeBackend()
    fleet = FleetManager.from_config(
        FleetConfig(min_workers=2, max_workers=6, heartbeat_timeout_s=7.0), 4, backend
    )
    assert (fleet.min_workers, fleet.target, fleet.max_workers, fleet.heartbeat_timeout_s) == (2, 4, 6, 7.0)
    small = FleetManager.from_config(FleetConfig(min_workers=3), 2, backend)
    assert (small.min_workers, small.target, small.max_workers) == (2, 2, 2)


def test_finish_counts_late_deaths_without_replacing():
    fleet, backend, clock = _fleet(n=2)
    fleet.start()
    backend.up("rollout-0", "rollout-1", tokens_in_flight=4)
    fleet.check()
    fleet.finish([WorkerExit("rollout-0", "stopped"), WorkerExit("rollout-1", "crashed")])
    m = fleet.metrics()
    assert (m.killed, m.interruptions, m.tokens_discarded) == (1, 1, 4)
    assert backend.spawned == ["rollout-0", "rollout-1"]


def test_lost_worker_late_delivery_is_fenced_and_task_trained_once():
    """Hard loss at the protocol level: the manager declares a silent worker lost, its leases are
    expired at once, another worker delivers the task; the lost worker's late delivery is refused."""
    from moerl.records import Group, Sample
    from moerl.runtime.buffer import ExperienceBuffer, PutResult
    from moerl.runtime.fleet import EXPIRE_NOW_TTL_S
    from moerl.runtime.queue import TaskQueue
    from moerl.tasks import Prompt

    clock = Clock()
    queue = TaskQueue(
        [Prompt(id="p0", text="1+1=", answer="2")], num_samples=1, tokenize=lambda s: [1, 2], clock=clock
    )
    buffer = ExperienceBuffer(4, max_staleness=0, settle=queue.settle, requeue=queue.requeue)
    fleet, backend, _ = _fleet(n=2)
    fleet.clock = clock
    fleet.start()
    backend.up("rollout-0", "rollout-1")
    fleet.check()
    (old,) = queue.lease("rollout-0", ttl_s=60.0)
    backend.answering.pop("rollout-0")
    clock.t = 11.0
    for e in fleet.check():
        queue.heartbeat(e.worker_id, EXPIRE_NOW_TTL_S)
    clock.t += 0.001  # the queue's next call: expired long before its 60 s ttl
    assert queue.stats().pending == 1
    (new,) = queue.lease("rollout-1", ttl_s=60.0)
    assert new.task_id == old.task_id and new.token > old.token

    def group(lease):
        sample = Sample(
            prompt_ids=(1, 2),
            response_ids=(3,),
            response_logprobs=(-0.1,),
            loss_mask=(1,),
            finish_reason="stop",
            policy_versions=(0,),
            reward=1.0,
        )
        return Group.from_lease(lease, [sample], gen_seconds=0.1)

    assert buffer.put(group(new), timeout=0) is PutResult.ADMITTED
    assert buffer.put(group(old), timeout=0) is PutResult.REFUSED_STALE_TOKEN  # the 'dead' worker was slow
    assert [g.task_id for g in buffer.get(1, timeout=0)] == ["0:p0"] and buffer.metrics().depth == 0
    assert (queue.stats().expired, queue.stats().refused) == (1, 1)
