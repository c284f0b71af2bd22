"""The Ray proxies a worker talks to accept exactly the arguments of the local classes they stand for."""

import inspect

from moerl.runtime.queue import TaskQueue
from moerl.runtime.ray.exchange import ExchangeActor
from moerl.runtime.ray.worker_actor import QueueProxy


def test_queue_proxy_methods_take_the_queue_methods_arguments():
    for name in ("lease", "heartbeat", "release", "settle"):
        local = list(inspect.signature(getattr(TaskQueue, name)).parameters)[1:]
        proxy = list(inspect.signature(getattr(QueueProxy, name)).parameters)[1:]
        assert proxy == local, f"QueueProxy.{name}{proxy} != TaskQueue.{name}{local}"


def _arguments(method) -> list[str]:
    """Parameter names after ``self``; without ``_ray_trace_ctx``, which ``ray.remote`` adds to the class's
    methods once any test of this process has made the exchange an actor."""
    return [p for p in list(inspect.signature(method).parameters)[1:] if p != "_ray_trace_ctx"]


def test_exchange_queue_methods_take_the_queue_methods_arguments():
    for name in ("heartbeat", "release", "settle", "requeue"):
        local = _arguments(getattr(TaskQueue, name))
        actor = _arguments(getattr(ExchangeActor, name))
        assert actor == local, f"ExchangeActor.{name}{actor} != TaskQueue.{name}{local}"


def test_queue_proxy_release_forwards_partial(monkeypatch):
    calls = []
    monkeypatch.setattr("moerl.runtime.ray.worker_actor._remote_call", lambda *a, **k: calls.append((a, k)))
    QueueProxy("handle").release("lease", partial=("p",))
    assert calls == [(("handle", "release", "lease"), {"partial": ("p",)})]
