"""One transport-neutral way for a rollout worker to receive weights (``moerl.weights.offer``): a
``WeightOffer`` through an ``OfferSink``, taken by the worker actor's one ``receive_weights`` method and
handed to its receiving side; the weights package never calls a worker actor."""

from __future__ import annotations

import ast
import threading
from pathlib import Path
from types import SimpleNamespace

from moerl.runtime.ray.ep_group import EPFollowerActor
from moerl.runtime.ray.worker_actor import RolloutWorkerActor, WorkerOffers
from moerl.weights.offer import WeightOffer
from moerl.weights.transport import TRANSPORTS
from moerl.weights.transports import OfferedWeights

ROOT = Path(__file__).resolve().parents[2] / "moerl"


def test_an_offer_says_whether_it_completes_its_version():
    whole, first, last = WeightOffer(3, "r"), WeightOffer(3, "r", 0, 2), WeightOffer(3, "r", 1, 2)
    assert (whole.is_whole, whole.completes_version) == (True, True)
    assert (first.is_whole, first.completes_version, last.completes_version) == (False, False, True)


def _actor(group=None) -> tuple[RolloutWorkerActor, list]:
    taken = []
    actor = object.__new__(RolloutWorkerActor)  # no Ray, no model: only the receiving path
    actor.source, actor.group, actor._offered = (
        SimpleNamespace(receive=taken.append),
        group,
        threading.Event(),
    )
    return actor, taken


def test_the_worker_actor_takes_every_offer_through_one_method():
    forwarded = []
    actor, taken = _actor(SimpleNamespace(forward=forwarded.append))
    bucket0, bucket1, whole = (
        WeightOffer(1, "a", 0, 2),
        WeightOffer(1, "b", 1, 2),
        WeightOffer(2, "w", to_followers=False),
    )
    actor.receive_weights(bucket0)
    assert taken == [bucket0] and forwarded == [bucket0] and not actor._offered.is_set()  # not whole yet
    actor.receive_weights(bucket1)
    assert actor._offered.is_set()  # the version's last bucket wakes an idle loop
    actor._offered.clear()
    actor.receive_weights(whole)
    assert taken[-1] is whole and forwarded == [bucket0, bucket1] and actor._offered.is_set()
    assert not any(name.startswith("offer_") for name in vars(RolloutWorkerActor))
    assert not any(name.startswith("offer_") for name in vars(EPFollowerActor))


def test_a_sink_calls_the_actors_receive_weights_without_waiting():
    sent = []
    handle = SimpleNamespace(receive_weights=SimpleNamespace(remote=sent.append))
    offer = WeightOffer(4, "ref", 2, 5)
    WorkerOffers(handle)(offer)
    assert sent == [offer]


def test_a_whole_version_reaches_the_store_transports_receiver_through_receive():
    receiver = OfferedWeights(None)
    receiver.receive(WeightOffer(7, "ref"))
    assert receiver._offer == (7, "ref")


def test_every_transport_says_whether_it_sends_from_a_snapshot():
    assert {name: t.sends_from_snapshot for name, t in TRANSPORTS.items()} == {
        "object_store": True,
        "collective": False,
        "cuda_ipc": False,
        "store": False,
    }


def _remote_calls(path: Path) -> list[str]:
    """``obj.method.remote(...)`` calls in ``path`` (an actor method called)."""
    tree = ast.parse(path.read_text())
    return [
        f"{path.name}:{n.lineno}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "remote"
    ]


def test_the_weights_package_never_calls_an_actor_and_the_rollouts_never_branch_on_a_transport():
    found = [c for f in sorted((ROOT / "weights").rglob("*.py")) for c in _remote_calls(f)]
    assert not found, f"the weights package calls actor methods (pass an OfferSink in): {found}"
    rollouts = (ROOT / "runtime" / "ray" / "rollouts.py").read_text()
    assert "weight_sync ==" not in rollouts and "weight_sync !=" not in rollouts
