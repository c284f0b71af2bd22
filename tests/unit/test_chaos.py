"""ChaosMonkey schedule (seeded, injected clock), limits, victims; SIGKILL and notice helpers."""

import subprocess
import sys

import pytest

from moerl.config import ChaosConfig, ConfigError, load_config
from moerl.runtime.chaos import ChaosMonkey, sigkill, write_notice
from moerl.runtime.notice import FileNotice


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class Target:
    def __init__(self):
        self.calls = []

    def kill_hard(self, worker_id):
        self.calls.append(("kill", worker_id))

    def notify(self, worker_id):
        self.calls.append(("notice", worker_id))


def test_off_by_default_and_set_from_cli():
    assert not ChaosConfig().is_enabled
    cfg = load_config(None, ["chaos.kill_rollout_every_s=20", "chaos.notice_rollout_every_s=30"])
    assert cfg.chaos.kill_rollout_every_s == 20.0 and cfg.chaos.notice_rollout_every_s == 30.0
    assert cfg.chaos.is_enabled
    with pytest.raises(ConfigError, match="chaos.max_kills=-1"):
        load_config(None, ["chaos.max_kills=-1"])
    monkey = ChaosMonkey(ChaosConfig(), clock=Clock())
    assert monkey.due(["a", "b"]) == [] and monkey.counts() == {"kill": 0, "notice": 0}


def test_schedule_gaps_limits_and_distinct_victims():
    clock = Clock()
    cfg = ChaosConfig(
        kill_rollout_every_s=10.0,
        notice_rollout_every_s=10.0,
        max_kills=2,
        max_notices=1,
        start_after_s=5.0,
        seed=3,
    )
    monkey = ChaosMonkey(cfg, clock=clock)
    monkey.start()
    workers = ["w0", "w1", "w2", "w3"]
    assert monkey.due(workers) == []  # t = 0: nothing before start_after_s + a gap of at least 5 s
    clock.t += 9.99
    assert monkey.due(workers) == []  # the earliest possible fault is at 5 + 0.5 * 10 = 10 s
    seen = []
    for _ in range(200):  # 100 s in 0.5 s ticks
        clock.t += 0.5
        seen += monkey.due(workers)
    kinds = [a.kind for a in seen]
    assert kinds.count("kill") == 2 and kinds.count("notice") == 1
    assert len({a.worker_id for a in seen}) == 3  # never the same victim twice
    kills = [a.at_s for a in seen if a.kind == "kill"]
    assert 10.0 <= kills[0] <= 20.5 and 5.0 <= kills[1] - kills[0] <= 15.5
    target = Target()
    monkey.apply(seen, target)
    assert target.calls == [(a.kind, a.worker_id) for a in seen]


def test_same_seed_same_schedule():
    def run():
        clock = Clock()
        monkey = ChaosMonkey(ChaosConfig(kill_rollout_every_s=3.0, seed=7), clock=clock)
        out = []
        for _ in range(40):
            clock.t += 0.5
            out += [(a.worker_id, a.at_s) for a in monkey.due([f"w{i}" for i in range(30)])]
        return out

    assert run() == run() and len(run()) >= 4


def test_fault_waits_for_a_candidate():
    clock = Clock()
    monkey = ChaosMonkey(ChaosConfig(kill_rollout_every_s=1.0), clock=clock)
    monkey.start()
    clock.t += 2.0
    assert monkey.due([]) == []
    (a,) = monkey.due(["w9"])
    assert a.worker_id == "w9" and monkey.due(["w9"]) == []  # already a victim


def test_trainer_kill_fires_once_at_step():
    monkey = ChaosMonkey(ChaosConfig(kill_trainer_at_step=3))
    assert [monkey.should_kill_trainer(s) for s in (1, 2, 3, 3, 4)] == [False, False, True, False, False]


def test_sigkill_kills_a_child_and_refuses_self(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    sigkill(child.pid)
    assert child.wait(timeout=10) == -9
    sigkill(child.pid)  # already gone: no error
    with pytest.raises(ValueError, match="refusing"):
        import os

        sigkill(os.getpid())


def test_write_notice_is_seen_by_file_notice(tmp_path):
    path = write_notice(tmp_path / "notices" / "w0.json", seconds_from_now=30.0)
    notice = FileNotice(path).check()
    assert notice.action == "terminate" and 28.0 <= notice.seconds_left() <= 31.0
    assert [p.name for p in (tmp_path / "notices").iterdir()] == ["w0.json"]


def test_schedule_starts_when_the_fleet_first_has_candidates():
    clock = Clock()
    monkey = ChaosMonkey(ChaosConfig(kill_rollout_every_s=10.0, seed=0), clock=clock)
    clock.t += 100.0
    assert monkey.due([]) == []  # fleet still starting: the schedule has not begun
    assert monkey.due(["w0"]) == []  # starts now; the first kill comes 5-15 s later, not at once
    clock.t += 4.9
    assert monkey.due(["w0"]) == []
    clock.t += 10.2
    assert [a.worker_id for a in monkey.due(["w0"])] == ["w0"]
