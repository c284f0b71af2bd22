"""Placement by node group (``moerl.cluster.placement``): the exchange on the ``exchange`` node or the
driver's, never a rollout node; trainer ranks only on ``train``; and a lost exchange stops a run in one
line with the resume command (``ExchangeLostError`` from ``RayRollouts._ask`` to ``moerl train``'s exit)."""

import pytest

from moerl.cluster.placement import Placement, exchange_placement, trainer_rank_resources
from moerl.configlib import ConfigError
from moerl.errors import ExchangeLostError

NODE = "ab" * 28  # a Ray node id: 28 bytes in hex
CLUSTER = {"CPU": 8.0, "train": 1.0, "rollout": 4.0, "env": 2.0}


def test_exchange_goes_to_the_exchange_node_else_the_drivers():
    assert exchange_placement({**CLUSTER, "exchange": 1.0}, NODE) == Placement({"exchange": 0.001})
    pinned = exchange_placement(CLUSTER, NODE)  # rollout nodes, no exchange resource: the driver's node
    assert pinned == Placement(node_id=NODE)
    opts = pinned.ray_options()
    assert opts["resources"] == {}
    strategy = opts["scheduling_strategy"]
    assert strategy.node_id == NODE and strategy.soft is False  # fails rather than land on a rollout node
    assert exchange_placement({"CPU": 4.0}, None) == Placement()  # a laptop: anywhere (one node)
    with pytest.raises(ConfigError, match="exchange"):
        exchange_placement(CLUSTER, None)


def test_trainer_ranks_only_on_train_nodes():
    assert trainer_rank_resources(CLUSTER) == {"train": 0.001}
    assert trainer_rank_resources({"CPU": 4.0}) == {}
    with pytest.raises(ConfigError, match="no `train` resource"):
        trainer_rank_resources({"CPU": 4.0, "rollout": 2.0})


def test_a_dead_exchange_becomes_one_line(monkeypatch):
    import ray

    from moerl.runtime.ray.rollouts import RayRollouts

    def dead(ref, **kw):
        raise ray.exceptions.ActorDiedError()

    monkeypatch.setattr(ray, "get", dead)
    with pytest.raises(ExchangeLostError, match="exchange actor .* was lost") as info:
        RayRollouts._ask(object(), object())
    assert "\n" not in str(info.value) and info.value.__cause__ is None


def test_the_cli_prints_the_resume_command(monkeypatch, capsys, tmp_path):
    import moerl.train
    from moerl.cli import main
    from moerl.run.interrupt import stops_on_lost_exchange

    def lost(cfg, **kw):
        with stops_on_lost_exchange(tmp_path):  # as moerl.train.train wraps the run
            raise ExchangeLostError("the exchange actor was lost")

    monkeypatch.setattr(moerl.train, "train", lost)
    assert main(["train", "--config", "configs/default.yaml"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    # no checkpoint in the folder: named, but not resumable
    assert err.startswith("moerl: the exchange actor was lost before the first checkpoint: " + str(tmp_path))
    e = ExchangeLostError("x", tmp_path, True)
    assert e.line() == f"moerl: x; continue with: moerl train --resume {tmp_path}"


def test_a_lost_node_is_one_event_and_counted():
    from moerl.runtime.ray.nodes import NodeWatch

    table = [
        {"NodeID": "a", "Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"train": 1.0}},
        {"NodeID": "b", "Alive": True, "NodeManagerAddress": "10.0.0.2", "Resources": {"rollout": 1.0}},
    ]
    now = [0.0]
    watch = NodeWatch(lambda: [dict(n) for n in table], every_s=2.0, clock=lambda: now[0])
    assert watch.poll() == [] and watch.lost == {}
    table[1]["Alive"], table[1]["Resources"] = False, {}  # as Ray lists a dead node
    assert watch.poll() == []  # read at most every 2 s
    now[0] = 2.0
    (line,) = watch.poll()
    assert "10.0.0.2 lost" in line and "rollout" in line and "\n" not in line
    now[0] = 4.0
    assert watch.poll() == [] and watch.lost == {"b": "10.0.0.2"}  # reported once
    table.append({"NodeID": "c", "Alive": False, "NodeManagerAddress": "10.0.0.3"})  # never seen alive
    now[0] = 6.0
    assert watch.poll() == [] and len(watch.lost) == 1


def test_the_trainer_groups_collective_timeout_comes_from_the_config(monkeypatch, tmp_path):
    import moerl.trainer.distributed.factory as factory
    from moerl.config import load_config

    with pytest.raises(ConfigError, match="trainer.collective_timeout_s"):
        load_config(None, ["trainer.collective_timeout_s=0"])
    seen = {}
    monkeypatch.setattr(factory, "TrainerGroup", lambda *a, **kw: seen.update(kw))
    cfg = load_config(None, ["trainer.num_ranks=2", "runtime.mode=sync", "trainer.collective_timeout_s=7"])
    factory.make_trainer(cfg, object(), str(tmp_path), tmp_path)
    assert seen["timeout_s"] == 7.0  # a rank behind a cut link fails its step after 7 s, not 120


def test_a_failed_groups_message_is_one_line():
    from moerl.train import one_line

    rank_error = (
        "trainer rank 1, train_step:\nTraceback (most recent call last):\n  File x\nRuntimeError: timed out\n"
    )
    assert one_line(rank_error) == "trainer rank 1, train_step: ... RuntimeError: timed out"
    assert one_line(RuntimeError("chaos kill")) == "chaos kill"


def test_the_rank_bundle_refuses_a_cluster_with_rollout_nodes_only(monkeypatch):
    import ray

    from moerl.config import load_config
    from moerl.trainer.distributed.ray_ranks import _bundle

    cfg = load_config(None, ["trainer.num_ranks=2", "runtime.mode=async"])
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 4.0, "rollout": 2.0})
    with pytest.raises(ConfigError, match="no `train` resource"):
        _bundle(cfg, 2)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 4.0, "rollout": 2.0, "train": 1.0})
    assert _bundle(cfg, 2)["train"] == 0.001
